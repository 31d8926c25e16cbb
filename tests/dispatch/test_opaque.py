"""dispatch/opaque.py: the decoder's ops as ``tik::`` custom ops. Each gives the bound op's bits and passes
``torch.library.opcheck`` (schema, fake shapes, dynamic-shape tracing); the vLLM plugin's model traced by
``torch.compile`` (one graph for every step length, no arithmetic outside our ops) gives the trainer's log-probs
bit for bit; negative controls: a wrong fake shape fails opcheck, the plain ops trace into arithmetic."""
import operator
import os
import sys

import pytest
import torch

from areal_tik.dispatch.bound import bind
from areal_tik.dispatch.opaque import FORWARD_OPS, OpaqueOps, opaque
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm_plugin"))
from plugin_sim import load_from, run_plugin_path  # noqa: E402  (tests/vllm_plugin/plugin_sim.py)

BF = torch.bfloat16


def _case(name, g):
    """Arguments of one call of op ``name`` on fresh random inputs (CPU, bf16 activations)."""
    r = lambda *s: torch.randn(*s, generator=g).to(BF)  # noqa: E731
    T, H, D = 5, 64, 32
    if name == "linear":
        return (r(T, H), r(48, H), r(48))
    if name == "rms_norm":
        return (r(T, H), r(H), 1e-6)
    if name == "add_rms_norm":
        return (r(T, H), r(T, H), r(H), 1e-6)
    if name == "apply_rope":
        cos, sin = bind().rope_table(D, 64, 10000.0, "cpu")
        return (r(T, 4, D), cos, sin, torch.randint(0, 64, (T,), generator=g))
    if name == "qk_norm_rope":
        cos, sin = bind().rope_table(D, 64, 10000.0, "cpu")
        qkv = r(T, 8 * D)                                    # q (4 heads), k and v (2 each) as views of one output
        return (qkv[:, :4 * D].view(T, 4, D), qkv[:, 4 * D:6 * D].view(T, 2, D), cos, sin,
                torch.randint(0, 64, (T,), generator=g), r(D), r(D), 1e-6)
    if name == "silu_mul":
        return (r(T, H), r(T, H))
    if name == "silu_mul_packed":
        return (r(T, 2 * H),)
    if name == "linear_silu_mul":
        return (r(T, H), r(2 * 24, H) * 0.2, None)
    E, k, inter = 8, 2, 32
    if name == "moe_route":
        return (r(T, E), k, True)
    if name == "moe_experts":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        return (r(T, H) * 0.5, r(E, 2 * inter, H) * 0.1, r(E, H, inter) * 0.1, ids)
    if name == "moe_combine":
        return (r(T, k, H), torch.rand(T, k, generator=g))
    if name == "moe_shared_add":
        return (r(T, H), r(T, H), r(T, 1))
    raise AssertionError(name)


def _equal(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
@pytest.mark.parametrize("name", FORWARD_OPS)
def test_opaque_op_gives_the_bound_ops_bits_and_passes_opcheck(name, backend, seed_rng):
    ops = bind(backend)
    op = opaque(ops)
    args = _case(name, torch.Generator().manual_seed(seed_rng))
    want = getattr(ops, name)(*args)
    got = getattr(op, name)(*args)
    assert _equal(got, want), name
    custom = getattr(torch.ops.tik, name).default
    slot = getattr(op, name).args[0]
    torch.library.opcheck(custom, (slot, *args),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_opaque_keeps_everything_else_and_is_idempotent():
    ops = bind()
    op = opaque(ops)
    assert isinstance(op, OpaqueOps) and opaque(op) is op and opaque(ops) is op     # one facade per bound ops
    assert op.impls is ops.impls and op.selection == ops.selection
    assert op.attention_paged is ops.attention_paged and op.rope_table is ops.rope_table
    assert op.linear is not ops.linear


def test_host_sync_rule_reads_through_the_facade():
    """Whether the experts op waits on the host (CUDA graphs or not) is the same question for the ops and for their
    opaque facade; the two backends answer differently (the rule is not constant)."""
    from areal_tik.layers.moe import experts_synced
    for spec, synced in (("moe_experts=triton", False), ("torch_ref", True)):
        ops = bind(spec)
        assert experts_synced(ops) is synced and experts_synced(opaque(ops)) is synced, spec


def test_opcheck_catches_a_wrong_fake_shape():
    """Negative control: a custom op whose fake output shape differs from the real one fails opcheck."""
    @torch.library.custom_op("tiktest::bad_fake", mutates_args=())
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @bad.register_fake
    def _(x):
        return x.new_empty((x.shape[0] + 1, *x.shape[1:]))

    with pytest.raises(Exception):
        torch.library.opcheck(bad, (torch.randn(3, 4),), test_utils=("test_faketensor",))


_VIEWS = {"reshape", "view", "split", "contiguous", "long", "size", "__getitem__"}


def _foreign(gm) -> set[str]:
    """Calls in a traced graph that are neither our custom ops, the attention stand-in, the embedding lookup nor
    views/indexing: arithmetic the tracer would own (and a compiler could rewrite)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            t = n.target
            if isinstance(t, torch._ops.OpOverload) and t.namespace in ("tik", "tiktest"):
                continue
            if t in (operator.getitem, torch.nn.functional.embedding) or getattr(t, "__name__", "") in _VIEWS:
                continue
            if getattr(t, "__name__", "") == "_log_api_usage_once":
                continue
            out.add(str(t))
        elif n.op == "call_method" and n.target not in _VIEWS:
            out.add(f".{n.target}")
    return out


def _compiled(m):
    """``m`` compiled as vLLM's decorator does it: the token dimension of the inputs dynamic, everything else
    (module attributes such as a norm's epsilon) constant; the traced graphs are collected."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    cm = torch.compile(m, backend=backend, fullgraph=True, dynamic=False)

    def forward(input_ids, positions):
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        return cm(input_ids, positions)
    forward.compute_logits = m.compute_logits
    return forward, graphs


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3-moe"])
def test_compiled_plugin_model_equals_trainer_logprobs(name):
    """The plugin's model on opaque ops, traced by torch.compile (fullgraph, the token count dynamic) with its
    attention behind a custom op as in vLLM: one graph serves every step of a chunked prefill and decode steps
    in a changing batch (a symbolic token count), holds no arithmetic outside our ops, and every log-prob equals
    the trainer's."""
    torch.manual_seed(0)
    hf = patch_model(build_model(name, device="cpu"), kernels="tik")
    m = load_from(hf, hf.config, ops=opaque(bind()))
    lens = [(9, 6), (14, 4), (5, 7)]
    seqs = [torch.randint(3, hf.config.vocab_size, (a + b,)).tolist() for a, b in lens]
    cm, graphs = _compiled(m)
    with torch.inference_mode():
        got, refs = run_plugin_path(m, hf, lens, seqs, forward=cm, opaque=True)
    # one graph for every token count (the tracer specialises a count of 1 into a second one; vLLM's wrapper
    # drops guards and replays its one graph for every size)
    ids_shapes = [next(n.meta["example_value"].shape for n in g.graph.nodes if n.name == "l_input_ids_")
                  for g in graphs]
    assert len(graphs) <= 2 and isinstance(ids_shapes[0][0], torch.SymInt), ids_shapes
    assert all(shape == (1,) for shape in ids_shapes[1:]), ids_shapes
    for g in graphs:
        assert _foreign(g) == set(), _foreign(g)
    for i, (mine, ref) in enumerate(zip(got, refs)):
        assert torch.equal(mine, ref), (name, i, (mine.float() - ref.float()).abs().max())


def test_plain_ops_trace_into_arithmetic():
    """Negative control for the graph check: the same model on the plain bound ops (torch_ref here) is traced
    into their arithmetic (or cannot be traced whole)."""
    torch.manual_seed(0)
    hf = patch_model(build_model("tiny-qwen2", device="cpu"), kernels="tik")
    m = load_from(hf, hf.config, ops=bind("torch_ref"))
    lens = [(9, 2), (6, 2)]
    seqs = [torch.randint(3, hf.config.vocab_size, (a + b,)).tolist() for a, b in lens]
    cm, graphs = _compiled(m)
    try:
        with torch.inference_mode():
            run_plugin_path(m, hf, lens + [(5, 2)], seqs + [torch.randint(3, 100, (7,)).tolist()], forward=cm,
                            opaque=True)
    except Exception:   # noqa: BLE001  (a graph break under fullgraph: not traceable whole, also a failure)
        return
    assert graphs and any(_foreign(g) for g in graphs)
