"""The vLLM plugin's model run as vLLM runs it, without vLLM: built in bf16, loaded from an HF checkpoint's
tensors, its attention layers stood in for by the plugin's glue on vLLM-layout caches, stepped through a
chunked prefill and decode steps in a changing batch. Shared by the plugin's CPU tests and the model-family
test (tests/layers/test_new_family.py)."""
import torch

from areal_tik.dispatch.bound import bind
from areal_tik.layers import weights_digest
from areal_tik.layers.family import head_dim_of
from areal_tik.layers.logprob_head import logprobs_of, packed_logprobs
from areal_tik.vllm_plugin import glue
from areal_tik.vllm_plugin.causal_lm import TikCausalLM

OPS = bind()


def tik_lm(cfg, ops=OPS) -> TikCausalLM:
    """The plugin's model as vLLM builds it: in bf16 by default dtype (vLLM's ``set_default_torch_dtype``), so
    the stacked projections are made on the final tensors."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return TikCausalLM(cfg, ops)
    finally:
        torch.set_default_dtype(prev)


class _SimAttention(torch.nn.Module):
    """Stands in for vLLM's ``Attention`` layer: stores K/V in its layer's ``[2, pages, P, Hkv, D]`` cache and
    attends over it through the plugin's glue, with the metadata of the step the simulator is running."""

    def __init__(self, sim, kv):
        super().__init__()
        self.sim, self.kv = sim, kv

    def forward(self, q, k, v):
        glue.write_kv(k, v, self.kv, self.sim.meta.slot_mapping, OPS)
        return glue.paged_attention(q, self.kv, self.sim.meta, self.sim.scale, OPS)


_LAYERS: list = []     # the _SimAttention modules the opaque stand-in names by index


@torch.library.custom_op("tiktest::sim_attention", mutates_args=())
def _sim_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _LAYERS[layer](q, k, v)


@_sim_attention.register_fake
def _(layer, q, k, v):
    return torch.empty_like(q)


class _OpaqueSimAttention(torch.nn.Module):
    """:class:`_SimAttention` behind one custom op, as vLLM's ``Attention`` is behind
    ``vllm::unified_attention_with_output`` when vLLM compiles a model: a traced forward stops there."""

    def __init__(self, sim, kv):
        super().__init__()
        self.index = len(_LAYERS)
        _LAYERS.append(_SimAttention(sim, kv))

    def forward(self, q, k, v):
        return _sim_attention(self.index, q, k, v)


class _PagedSim:
    """vLLM's side of a run: per-layer [2, pages, P, Hkv, D] caches, block tables, steps (``opaque``: each
    layer's attention behind one custom op)."""

    def __init__(self, model, n_seqs, P=16, width=8, opaque=False):
        cfg = model.config
        D = head_dim_of(cfg)
        n_pages = n_seqs * width + 1
        self.P, self.width = P, width
        self.kv = [torch.zeros(2, n_pages, P, cfg.num_key_value_heads, D, dtype=torch.bfloat16)
                   for _ in range(cfg.num_hidden_layers)]
        perm = (torch.randperm(n_pages - 1, generator=torch.Generator().manual_seed(1)) + 1).to(torch.int32)
        self.bt = perm[: n_seqs * width].view(n_seqs, width)
        self.scale = D ** -0.5
        self.meta = None
        for layer, kv in zip(model.model.layers, self.kv):
            layer.self_attn.attn = (_OpaqueSimAttention if opaque else _SimAttention)(self, kv)

    def step(self, model, chunks):
        """chunks: (seq index, token ids, start position). Returns final hidden states [T, H]."""
        ids, pos, slots, cu, seqk, rows = [], [], [], [0], [], []
        for s, toks, start in chunks:
            ids += toks
            pos += list(range(start, start + len(toks)))
            slots += [int(self.bt[s, p // self.P]) * self.P + p % self.P for p in range(start, start + len(toks))]
            cu.append(cu[-1] + len(toks))
            seqk.append(start + len(toks))
            rows.append(s)
        self.meta = glue.metadata_from_common(cu[-1], max(len(t) for _, t, _ in chunks),
                                              torch.tensor(cu, dtype=torch.int32), torch.tensor(seqk, dtype=torch.int32),
                                              self.bt[rows].contiguous(), torch.tensor(slots, dtype=torch.int64))
        return model(torch.tensor(ids), torch.tensor(pos)), cu


def run_plugin_path(m, hf, lens, seqs, forward=None, opaque=False):
    """Prefill (one prompt chunked) then decode steps in a changing batch, on vLLM-layout caches: every
    generated token's log-prob from the plugin's model ``m`` (its forward run by ``forward``, e.g. a compiled
    ``m``; ``opaque``: attention behind a custom op), and the trainer's (``packed_logprobs`` of ``hf``), per
    sequence."""
    sim = _PagedSim(m, len(seqs), opaque=opaque)
    fwd = m if forward is None else forward
    got = {i: [] for i in range(len(seqs))}
    lp_at = lambda h, row, tok: logprobs_of(m.compute_logits(h[[row]]), torch.tensor([tok]), 1.0, OPS)
    with torch.no_grad():
        # step 1: prefill seq 0 whole, the first 8 tokens of seq 1 (chunked), nothing of seq 2 yet
        h, cu = sim.step(fwd, [(0, seqs[0][:9], 0), (1, seqs[1][:8], 0)])
        got[0].append(lp_at(h, cu[1] - 1, seqs[0][9]))
        # step 2: rest of seq 1's prompt, prefill seq 2, decode seq 0; then decode steps as rows finish
        chunks = [(1, seqs[1][8:14], 8), (0, [seqs[0][9]], 9), (2, seqs[2][:5], 0)]
        while chunks:
            h, cu = sim.step(fwd, chunks)
            nxt = []
            for j, (s, toks, start) in enumerate(chunks):
                end = start + len(toks)
                if end < len(seqs[s]):
                    got[s].append(lp_at(h, cu[j + 1] - 1, seqs[s][end]))
                    if end + 1 < len(seqs[s]):
                        nxt.append((s, [seqs[s][end]], end))
            chunks = nxt
    ids = torch.tensor(sum(seqs, []))
    cu_t = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)), dtype=torch.int32)
    with torch.no_grad():
        train = packed_logprobs(hf, ids, cu_t, temperature=1.0)
    refs = [train[int(cu_t[i]) + a - 1: int(cu_t[i]) + a + b - 1] for i, (a, b) in enumerate(lens)]
    return [torch.cat(got[i]) for i in range(len(seqs))], refs


def load_from(hf, cfg, ops=OPS, tensors=None) -> TikCausalLM:
    """The plugin's model of ``cfg``, every parameter poisoned, then loaded from ``hf``'s state dict (or the
    ``(name, tensor)`` pairs ``tensors``, e.g. a checkpoint file's); checks that
    the load wrote every parameter, through the stacked projections, and names them as the trainer does."""
    m = tik_lm(cfg, ops)
    for p in m.parameters():                            # poison: every parameter must be written by the load
        p.data.fill_(float("nan"))
    loaded = m.load_weights(hf.state_dict().items() if tensors is None else tensors)
    assert loaded == {n for n, _ in m.named_parameters()}
    assert all(layer.self_attn._tik_qkv.intact() for layer in m.model.layers)
    mlps = [mod for mod in m.model.modules() if hasattr(mod, "gate_proj") and hasattr(mod, "up_proj")]
    assert all(mod._tik_gate_up.intact() for mod in mlps)     # every dense MLP (and shared expert) stacked
    # the HF-named weights are the trainer's tensors, so the weights digests agree
    ours, theirs = dict(m.hf_named_parameters()), dict(hf.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert weights_digest.digest(ours.items()) == weights_digest.digest(theirs.items())
    return m
