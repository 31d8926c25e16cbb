"""The vLLM plugin's pieces that run without vLLM: lazy imports and availability, the metadata
translation onto our paged-attention ops (against the engine's own call), the decoder on
flattened tokens against the trainer's forward, and the sampled-token log-probs."""
import importlib
import os
import subprocess
import sys

import pytest
import torch

from areal_tik.dispatch import ops
from areal_tik.layers.logprob_head import logprobs_of
from areal_tik.layers.patch import patch_model
from areal_tik.layers.models import build_model
from areal_tik.vllm_plugin import glue, logprobs as vlp
from areal_tik.vllm_plugin.causal_lm import TikCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from plugin_sim import OPS, load_from, run_plugin_path  # noqa: E402  (tests/vllm_plugin/plugin_sim.py)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_import_areal_tik_never_imports_vllm():
    code = ("import sys, areal_tik, areal_tik.vllm_plugin, areal_tik.vllm_plugin.glue, "
            "areal_tik.vllm_plugin.causal_lm, areal_tik.vllm_plugin.logprobs, areal_tik.vllm_plugin.register, "
            "areal_tik.cli.env; assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM installed here")
def test_unavailable_without_vllm_and_says_why():
    from areal_tik import vllm_plugin
    from areal_tik.cli.env import collect
    from areal_tik.vllm_plugin.register import register

    ok, why = vllm_plugin.available()
    assert not ok and "not installed" in why and "areal-tik[vllm]" in why
    assert collect()["vllm_plugin"] == {"available": False, "reason": why}
    with pytest.raises(ImportError):
        register()
    for mod in ("areal_tik.vllm_plugin.attention", "areal_tik.vllm_plugin.model"):
        with pytest.raises(ImportError):
            importlib.import_module(mod)


def test_llm_kwargs_and_architectures():
    from areal_tik import vllm_plugin
    kw = vllm_plugin.llm_kwargs("qwen2")
    assert kw["hf_overrides"] == {"architectures": ["TikQwen2ForCausalLM"]}
    assert kw["attention_backend"] == "CUSTOM"
    assert kw["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    # piecewise: vLLM's compile (mode 3) on its eager backend (no Inductor between our ops), graphs for mixed steps
    pw = vllm_plugin.llm_kwargs("qwen2", piecewise=True)["compilation_config"]
    assert pw == {"mode": 3, "backend": "eager", "cudagraph_mode": "FULL_AND_PIECEWISE"}
    big = vllm_plugin.llm_kwargs("qwen2", piecewise=True, graph_tokens=2048)["compilation_config"]
    assert big == {**pw, "max_cudagraph_capture_size": 2048}
    for bad in ({"graph_tokens": 2048}, {"piecewise": True, "graph_tokens": 0}):   # decode-only graphs have no size
        with pytest.raises(ValueError, match="graph_tokens"):
            vllm_plugin.llm_kwargs("qwen2", **bad)
    families = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
    assert {vllm_plugin.architecture_for(t) for t in families} == set(vllm_plugin.ARCHITECTURES.values())
    with pytest.raises(ValueError):
        vllm_plugin.architecture_for("mixtral")


def test_entry_point_declared_in_setup_py():
    import os
    src = open(os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")).read()
    assert '"vllm.general_plugins": ["areal_tik = areal_tik.vllm_plugin.register:register"]' in src
    assert '"vllm": ["vllm==0.24.0"]' in src


# ---- metadata translation: vLLM's step inputs -> our ops, vs the engine's own call ------------------

def _step_case(gen, P=16, hkv=2, hq=4, D=64, n_pages=24):
    """Three requests: a decode row (47 cached + 1 new), a chunked-prefill row (20 cached + 9 new),
    a fresh prefill (13 new); physical pages scattered."""
    cached, new = [47, 20, 0], [1, 9, 13]
    perm = torch.randperm(n_pages - 1, generator=gen) + 1          # page 0 stays free, as vLLM's null block
    width = 4
    bt = perm[: 3 * width].view(3, width).to(torch.int32)
    seqk = [c + n for c, n in zip(cached, new)]
    cu = [0]
    slots, hist_slots = [], []
    for r in range(3):
        cu.append(cu[-1] + new[r])
        for p in range(cached[r]):
            hist_slots.append(int(bt[r, p // P]) * P + p % P)
        for p in range(cached[r], seqk[r]):
            slots.append(int(bt[r, p // P]) * P + p % P)
    T = cu[-1]
    mk = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)
    return dict(P=P, hq=hq, hkv=hkv, D=D, n_pages=n_pages, bt=bt, cu=cu, seqk=seqk, slots=slots, hist=hist_slots,
                q=mk(T, hq, D), k=mk(T, hkv, D), v=mk(T, hkv, D), hk=mk(len(hist_slots), hkv, D),
                hv=mk(len(hist_slots), hkv, D), max_q=max(new))


def test_glue_matches_engine_call_with_graph_padding():
    gen = torch.Generator().manual_seed(0)
    c = _step_case(gen)
    shape = (c["n_pages"], c["P"], c["hkv"], c["D"])
    hist = torch.tensor(c["hist"], dtype=torch.int64)
    # the engine: separate caches, AttentionContext fields (steps.TikStep.attend)
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    ops.kv_cache_write(c["hk"], c["hv"], kc, vc, hist)
    slots = torch.tensor(c["slots"], dtype=torch.int64)
    cu = torch.tensor(c["cu"], dtype=torch.int32)
    seqk = torch.tensor(c["seqk"], dtype=torch.int32)
    ops.kv_cache_write(c["k"], c["v"], kc, vc, slots)
    ref = ops.attention_paged(c["q"], kc, vc, c["bt"], cu, seqk, c["max_q"], scale=c["D"] ** -0.5)
    # vLLM: one [2, ...] cache, tokens padded by 3 rows (slot -1), requests padded by 2 (no query, seq_len 0)
    kv = torch.zeros((2, *shape), dtype=torch.bfloat16)
    glue.write_kv(c["hk"], c["hv"], kv, hist, OPS)
    pad_t, pad_r = 3, 2
    T = c["q"].shape[0]
    z = lambda x: torch.cat([x, torch.full((pad_t, *x.shape[1:]), 7.0, dtype=x.dtype)])
    meta = glue.metadata_from_common(
        T, c["max_q"], torch.tensor(c["cu"] + [T] * pad_r, dtype=torch.int32),
        torch.tensor(c["seqk"] + [0] * pad_r, dtype=torch.int32),
        torch.cat([c["bt"], torch.zeros(pad_r, c["bt"].shape[1], dtype=torch.int32)]),
        torch.cat([slots, torch.full((pad_t,), -1, dtype=torch.int64)]))
    glue.write_kv(z(c["k"]), z(c["v"]), kv, meta.slot_mapping, OPS)
    out = torch.empty(T + pad_t, c["hq"] * c["D"], dtype=torch.bfloat16)
    got = glue.paged_attention(z(c["q"]), kv, meta, c["D"] ** -0.5, OPS, out)
    assert got is out
    assert torch.equal(kv[0], kc) and torch.equal(kv[1], vc)         # same cache bits, padding stored nowhere
    assert torch.equal(out[:T].view(T, c["hq"], c["D"]), ref)


def test_glue_rejects_wrong_layouts():
    with pytest.raises(ValueError):
        glue.split_kv_cache(torch.zeros(3, 4, 16, 1, 64))
    with pytest.raises(TypeError):
        glue.metadata_from_common(1, 1, torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                                  torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


# ---- the decoder on flattened tokens vs the trainer's forward -------------------------------------------

@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "tiny-llama"])
def test_plugin_model_rollout_equals_trainer_logprobs(name):
    """The plugin's model (stacked projections, vLLM-layout caches): every next-token log-prob of a chunked
    prefill and decode steps in a changing batch equals the trainer's packed_logprobs, torch.equal."""
    torch.manual_seed(0)
    hf = patch_model(build_model(name, device="cpu"), kernels="tik")
    m = load_from(hf, hf.config)
    lens = [(9, 6), (14, 4), (5, 7)]                   # (prompt, generated) per sequence
    seqs = [torch.randint(3, hf.config.vocab_size, (a + b,)).tolist() for a, b in lens]
    got, refs = run_plugin_path(m, hf, lens, seqs)
    for i, (mine, ref) in enumerate(zip(got, refs)):
        assert mine.shape == ref.shape, (i, mine.shape, ref.shape)
        assert torch.equal(mine, ref), (name, i, (mine - ref).abs().max())


def test_check_config_refuses_what_kernels_lack():
    from areal_tik.layers.family import UnsupportedModelError
    from areal_tik.layers.models import preset_config
    with pytest.raises(UnsupportedModelError):
        TikCausalLM(preset_config("tiny-qwen2", hidden_act="gelu"), OPS)
    with pytest.raises(UnsupportedModelError):
        TikCausalLM(preset_config("tiny-qwen2", head_dim=32, hidden_size=64), OPS)


# ---- sampled-token log-probs ----------------------------------------------------------------------

def test_sampled_logprobs_per_row_temperatures():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 4100, generator=gen) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 4100, (5,), generator=gen)
    temps = [1.0, 0.7, 1.0, 0.7, 1.3]
    got = vlp.sampled_logprobs(logits, tokens, temps, OPS)
    for i, t in enumerate(temps):
        assert torch.equal(got[i:i + 1], logprobs_of(logits[i:i + 1], tokens[i:i + 1], t, OPS))
    assert torch.equal(vlp.sampled_logprobs(logits, tokens, [1.0] * 5, OPS), logprobs_of(logits, tokens, 1.0, OPS))


def test_host_temperatures_cached_per_tensor_and_greedy_is_one():
    c = vlp.HostTemperatures()
    t = torch.tensor([0.0, 0.5, 1.0])
    assert c.get(t, 3) == [1.0, 0.5, 1.0]
    t.fill_(2.0)                                  # same tensor object: the cached host values stay
    assert c.get(t, 2) == [1.0, 0.5]
    assert c.get(torch.tensor([2.0]), 1) == [2.0]
    assert c.get(None, 2) == [1.0, 1.0]


def test_load_refuses_unknown_names_and_shapes():
    m = TikCausalLM(build_model("tiny-qwen2", device="cpu").config, OPS)
    with pytest.raises(ValueError, match="does not have"):
        m.load_weights([("model.layers.0.self_attn.x_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="checkpoint shape"):
        m.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])


@pytest.mark.skipif(HAS_VLLM, reason="checks the message of a machine without vLLM")
def test_verify_engine_vllm_without_vllm_is_a_one_line_usage_error():
    r = subprocess.run([sys.executable, "-m", "areal_tik.cli", "verify", "--engine", "vllm", "--model", "tiny-qwen2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "vllm is not installed" in lines[0], r.stderr


def test_first_weight_load_precompiles_the_linear_configs(monkeypatch):
    """The plugin's model compiles every linear tile config on its first weight load (vLLM's worker passes its
    step token budget), not inside a rollout step; later loads (weight updates) and a budget of 0 compile nothing."""
    from areal_tik.vllm_plugin import causal_lm
    calls = []
    monkeypatch.setattr(causal_lm, "precompile_linears", lambda model, max_tokens: calls.append((model, max_tokens)))
    torch.manual_seed(0)
    hf = patch_model(build_model("tiny-qwen2", device="cpu"), kernels="tik")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = TikCausalLM(hf.config, OPS, precompile_tokens=8192)
        none = TikCausalLM(hf.config, OPS)
    finally:
        torch.set_default_dtype(prev)
    m.load_weights(hf.state_dict().items())
    assert calls == [(m, 8192)]
    m.load_weights(hf.state_dict().items())          # a weight update
    none.load_weights(hf.state_dict().items())
    assert calls == [(m, 8192)]
