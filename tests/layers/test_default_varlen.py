"""The default (baseline) packed attention: torch's FlashAttention varlen when available,
else the per-sequence SDPA loop -- same values either way (no bitwise promise)."""
import inspect

import pytest
import torch

from areal_tik.layers import default_varlen as DV


def _problem(lens, hq, hkv, D, device="cpu", dtype=torch.float32):
    T = sum(lens)
    q = torch.randn(T, hq, D, device=device, dtype=dtype)
    k = torch.randn(T, hkv, D, device=device, dtype=dtype)
    v = torch.randn(T, hkv, D, device=device, dtype=dtype)
    cu_host = [0]
    for n in lens:
        cu_host.append(cu_host[-1] + n)
    return q, k, v, cu_host, torch.tensor(cu_host, dtype=torch.int32, device=device)


def _reference(q, k, v, cu_host, scale):
    """float64 causal attention per segment, GQA by head groups."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for a, b in zip(cu_host[:-1], cu_host[1:]):
        qq, kk, vv = (x[a:b].double() for x in (q, k, v))
        kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return out


def _fake_varlen(style, calls):
    """A CPU stand-in for torch's varlen_attn with the keyword set of a given torch release;
    it computes with the float64 reference (so the adapter's choices decide the result)."""
    def compute(q, k, v, cu_q, max_q, scale):
        assert q.shape[1] == k.shape[1], "this release has no enable_gqa: heads must be repeated"
        calls.append(style)
        return _reference(q, k, v, [int(x) for x in cu_q.tolist()], scale).to(q.dtype)

    if style == "2.10":
        def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            assert is_causal
            return compute(query, key, value, cu_seq_q, max_q, query.shape[-1] ** -0.5)
    elif style == "2.12":
        def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            assert window_size == (-1, 0)
            if enable_gqa:
                g = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
            return compute(query, key, value, cu_seq_q, max_q, scale)
    else:
        def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
            raise RuntimeError("no kernel image for this device")
    return f


def test_call_plan_per_release():
    assert DV.varlen_call_plan(_fake_varlen("2.10", [])) == {"causal": ("is_causal", True), "scale": False,
                                                            "gqa": False}
    assert DV.varlen_call_plan(_fake_varlen("2.12", [])) == {"causal": ("window_size", (-1, 0)), "scale": True,
                                                            "gqa": True}
    assert DV.varlen_call_plan(lambda q, k, v, cq, ck, mq, mk: None) is None


@pytest.mark.parametrize("style", ["2.10", "2.12"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_varlen_path_matches_reference(style, hq, hkv, monkeypatch):
    calls = []
    monkeypatch.setattr(DV, "_on_gpu", lambda t: True)
    monkeypatch.setattr(DV, "_torch_varlen", lambda: (f := _fake_varlen(style, calls), DV.varlen_call_plan(f)))
    monkeypatch.setattr(DV, "_STATE", {"path": None, "why": "", "disabled": {}})
    q, k, v, cu_host, cu = _problem([5, 1, 9, 3], hq, hkv, 8)
    scale = 8 ** -0.5
    out = DV.packed_causal_attention(q, k, v, cu_host, cu, 9, scale)
    assert calls == [style] and DV.status()["path"] == "torch varlen_attn"
    assert (out.double() - _reference(q, k, v, cu_host, scale)).abs().max() < 1e-5
    # 2.10 takes no scale: a non-default scale must not silently use the default one
    out2 = DV.packed_causal_attention(q, k, v, cu_host, cu, 9, 0.3)
    assert (out2.double() - _reference(q, k, v, cu_host, 0.3)).abs().max() < 1e-5
    assert calls == [style] * (2 if style == "2.12" else 1)


def test_failing_varlen_falls_back_once(monkeypatch):
    calls, warned = [], []
    monkeypatch.setattr(DV.log, "warning", lambda msg, *a: warned.append(msg % a))
    monkeypatch.setattr(DV, "_on_gpu", lambda t: True)
    monkeypatch.setattr(DV, "_torch_varlen", lambda: (f := _fake_varlen("broken", calls), DV.varlen_call_plan(f)))
    monkeypatch.setattr(DV, "_STATE", {"path": None, "why": "", "disabled": {}})
    q, k, v, cu_host, cu = _problem([4, 7], 4, 2, 8)
    for _ in range(2):
        out = DV.packed_causal_attention(q, k, v, cu_host, cu, 7, 8 ** -0.5)
        assert (out.double() - _reference(q, k, v, cu_host, 8 ** -0.5)).abs().max() < 1e-5
    st = DV.status()
    assert st["path"] == "per-sequence SDPA loop" and "RuntimeError" in st["why"]
    assert len(warned) == 1 and "varlen_attn raised RuntimeError" in warned[0]
    assert calls == [] and list(st["disabled"]) == [(torch.float32, 8)]
    # another (dtype, head dim) still tries varlen (the failure may be specific to the first)
    q2, k2, v2, cu_host2, cu2 = _problem([4, 7], 4, 2, 16)
    DV.packed_causal_attention(q2, k2, v2, cu_host2, cu2, 7, 16 ** -0.5)
    assert len(warned) == 2 and set(DV.status()["disabled"]) == {(torch.float32, 8), (torch.float32, 16)}


def test_loop_forced_by_env(monkeypatch):
    calls = []
    monkeypatch.setattr(DV, "_on_gpu", lambda t: True)
    monkeypatch.setattr(DV, "_torch_varlen", lambda: (f := _fake_varlen("2.12", calls), DV.varlen_call_plan(f)))
    monkeypatch.setattr(DV, "FORCE_LOOP", True)
    q, k, v, cu_host, cu = _problem([3, 6], 4, 2, 8)
    out = DV.packed_causal_attention(q, k, v, cu_host, cu, 6, 8 ** -0.5)
    assert calls == [] and DV.status()["why"] == "FORCE_LOOP set"
    assert (out.double() - _reference(q, k, v, cu_host, 8 ** -0.5)).abs().max() < 1e-5


def test_cpu_uses_loop():
    q, k, v, cu_host, cu = _problem([3, 6], 4, 4, 8)
    out = DV.packed_causal_attention(q, k, v, cu_host, cu, 6, 0.25)
    assert (out.double() - _reference(q, k, v, cu_host, 0.25)).abs().max() < 1e-5
    assert DV.status()["path"] == "per-sequence SDPA loop"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,D", [(12, 2, 128), (16, 16, 64)])
def test_gpu_torch_varlen_forward_backward(hq, hkv, D):
    """On the GPU the baseline uses torch's FlashAttention varlen (this torch must have it),
    forward and gradients within bf16 tolerance of the per-sequence loop."""
    assert DV._torch_varlen()[1] is not None, inspect.signature(DV._torch_varlen()[0])
    q, k, v, cu_host, cu = _problem([300, 1, 77, 1024, 5], hq, hkv, D, "cuda", torch.bfloat16)
    scale = D ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = DV.packed_causal_attention(*leaves, cu_host, cu, 1024, scale)
    assert DV.status()["path"] == "torch varlen_attn", DV.status()
    g = torch.randn_like(out)
    out.backward(g)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = DV._loop(*ref_leaves, cu_host, scale)
    ref.backward(g)
    assert (out.float() - ref.float()).abs().max() < 2e-2
    for a, b in zip(leaves, ref_leaves):
        assert torch.isfinite(a.grad.float()).all()
        assert (a.grad.float() - b.grad.float()).abs().max() < 5e-2 * max(1.0, b.grad.float().abs().max().item())


@pytest.mark.parametrize("chunked", [False, True])
def test_default_engine_prefill_paths_agree_with_hf(chunked, seed_rng, monkeypatch):
    """Default-kernel engine: a fresh prompt prefill (packed attention over the new K/V) and a
    chunked prefill (later chunks read the paged cache) both give HF's log-probs within bf16 noise."""
    from areal_tik.layers.patch import patch_model
    from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
    from areal_tik.layers.models import build_model

    from areal_tik.layers import steps as M
    seen = {"packed": 0, "paged": 0}
    for name, key in (("packed_causal_attention", "packed"), ("default_paged_attention", "paged")):
        real = getattr(M, name)
        monkeypatch.setattr(M, name, lambda *a, _r=real, _k=key, **k: (seen.__setitem__(_k, seen[_k] + 1), _r(*a, **k))[1])
    ref = build_model("tiny-qwen2", device="cpu")
    eng = LLMEngine(patch_model(build_model("tiny-qwen2", device="cpu"), kernels="default"),
                    EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16 if chunked else 256,
                                 chunked_prefill=chunked))
    prompts = [torch.randint(3, 400, (n,)).tolist() for n in (9, 30, 17)]
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=5))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
        want = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(o.output_ids)]
        assert max(abs(a - b) for a, b in zip(o.output_logprobs, want)) < 5e-2, (o.output_logprobs, want)
    assert seen["packed"] > 0 and seen["paged"] > 0, seen  # fresh prefill packed; decode (+ later chunks) paged
