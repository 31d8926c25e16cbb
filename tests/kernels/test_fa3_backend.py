"""The ``fa3`` backend of the attention pair (vLLM's FlashAttention-3, one walk over the keys).

CPU: the spec (``attention=fa3``, a split pair refused, unknown ops named), availability and its reason, the
fingerprint, and the wrappers' plumbing against a stand-in with FA3's calling convention (bottom-right causal
mask, ``seqused_k`` with a block table, natural-log lse ``[Hq, T]``) whose maths is our torch_ref pair: the keywords
reach FA3 as its interface names them, the split count is pinned, the key bound covers the table, the backward
gets the lse it expects, and a whole engine-vs-trainer parity run on a patched model stays bitwise.
GPU (FA3 importable, sm_90): every row's bits across prefill, decode, chunks, page sizes and batch mixes, the
float64 accuracy bound, the backward, graph replays, and R1-R5 parity on a tiny model with CUDA graphs.
"""
from __future__ import annotations

import math

import pytest
import torch

from areal_tik.dispatch import availability, fingerprint, registry
from areal_tik.dispatch.bound import bind
from areal_tik.kernels.attention.reference import attention_reference, paged_case
from areal_tik.kernels.attention.torch_ref import attention_paged_torch, attention_varlen_torch
from areal_tik.kernels.fa3 import attention as fa3
from areal_tik.settings import Settings, SettingsError, parse_backend_spec

HQ, HKV = 4, 2
# the tiny presets (head dim 64) widened to the head dim the fa3 backend accepts
HEAD_DIM_128 = {"tiny-qwen2": {"hidden_size": 256, "head_dim": 128}, "tiny-qwen3": {"head_dim": 128}}


class StandInFA3:
    """CPU stand-in for vLLM's ``flash_attn_varlen_func`` with FA3's calling convention, computed by the
    torch_ref pair (itself row-invariant); records every call's keywords."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                 softmax_scale=None, causal=False, block_table=None, return_softmax_lse=False, out=None,
                 num_splits=0, fa_version=2, **other):
        assert not other, f"keywords FA3 was not meant to get: {sorted(other)}"
        assert (cu_seqlens_k is None) != (seqused_k is None), "FA3 takes cu_seqlens_k or seqused_k, not both"
        self.calls.append(dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, paged=block_table is not None, num_splits=num_splits,
                               fa_version=fa_version, lse=return_softmax_lse, out=out is not None))
        if block_table is not None:
            assert int(seqused_k.max()) <= max_seqlen_k, "FA3 sizes its launch by max_seqlen_k"
            o = attention_paged_torch(q, k, v, block_table, cu_seqlens_q, seqused_k, max_seqlen_q,
                                      scale=softmax_scale)
        else:
            assert torch.equal(cu_seqlens_k, cu_seqlens_q)
            o = attention_varlen_torch(q, k, v, cu_seqlens_q, max_seqlen_q, scale=softmax_scale)
        if out is not None:
            out.copy_(o)
            o = out
        if not return_softmax_lse:
            return o
        return o, _lse(q, k, cu_seqlens_q, softmax_scale)


def _lse(q, k, cu, scale):
    """Natural-log log-sum-exp of each (head, token) row's scaled causal scores, ``[Hq, T]`` float32."""
    g = q.shape[1] // k.shape[1]
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    b = cu.tolist()
    for s0, s1 in zip(b[:-1], b[1:]):
        qd = q[s0:s1].double().transpose(0, 1)
        kd = k[s0:s1].double().repeat_interleave(g, 1).transpose(0, 1)
        s = (qd @ kd.transpose(1, 2)) * scale
        n = s1 - s0
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        lse[:, s0:s1] = torch.logsumexp(s, -1).float()
    return lse


@pytest.fixture
def stand_in(monkeypatch):
    """FA3 "available" on this machine with the stand-in as its kernel."""
    fake = StandInFA3()
    monkeypatch.setattr(fa3, "flash_fn", lambda: fake)
    monkeypatch.setattr(availability, "fa3_status", lambda: (True, "stand-in"))
    return fake


def _paged_inputs(lens, page, seed, D=128, hq=HQ, hkv=HKV, device="cpu"):
    """Sequences of ``lens`` tokens: q/k/v packed, and k/v on shuffled pages of a cache (unused slots NaN) with its
    block table (one spare column), all on ``device``."""
    return paged_case(lens, page, seed, d=D, hq=hq, hkv=hkv, device=device)


# ---------------------------------------------------------------- the spec, availability, the fingerprint

def test_attention_group_names_both_ops_and_a_split_pair_is_refused():
    assert parse_backend_spec("attention=fa3") == {"attention_varlen": "fa3", "attention_paged": "fa3"}
    assert parse_backend_spec("triton,attention=cuda")["attention_paged"] == "cuda"
    for bad in ("attention_paged=fa3", "attention_varlen=triton", "triton,attention_paged=cuda"):
        with pytest.raises(SettingsError, match="splits the attention pair"):
            parse_backend_spec(bad)
    with pytest.raises(SettingsError, match="splits the attention pair"):
        Settings(backend="attention_paged=fa3")
    with pytest.raises(SettingsError, match="unknown backend 'fa4'.*fa3"):
        parse_backend_spec("attention=fa4")


def test_unknown_op_in_a_spec_is_named():
    with pytest.raises(registry.BackendUnavailable, match="unknown op.*atention_paged"):
        registry.select_impl("linear", "atention_paged=triton,attention=triton")


def test_fa3_is_never_a_default_and_says_why_it_cannot_run(monkeypatch):
    assert all(registry.select_impl(op).backend != "fa3" for op in ("attention_varlen", "attention_paged"))
    monkeypatch.setattr(availability, "fa3_status", lambda: (False, "no CUDA GPU"))
    with pytest.raises(registry.BackendUnavailable, match="'fa3' requested but unavailable: no CUDA GPU"):
        registry.select_impl("attention_paged", "attention=fa3")
    with pytest.raises(registry.BackendUnavailable, match="has no 'fa3' implementation"):
        registry.select_impl("linear", "fa3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU reason")
def test_fa3_status_on_a_machine_without_gpu():
    ok, why = availability.fa3_status()
    assert not ok and why == "no CUDA GPU"


def test_selection_and_fingerprint_follow_the_fa3_spec(stand_in):
    spec = "attention=fa3"
    assert registry.select_impl("attention_varlen", spec).fn is fa3.attention_varlen_fa3
    assert registry.select_impl("attention_paged", spec).fn is fa3.attention_paged_fa3
    fp = fingerprint.compute(bind(spec))
    assert fp["selection"]["attention_paged"] == "fa3" and fp["selection"]["attention_varlen"] == "fa3"
    assert fp["fingerprint"] != fingerprint.compute(bind(None))["fingerprint"]
    info = registry.implementations()["attention_paged"]["fa3"]
    assert dict(info.meta)["fa3_num_splits"] == 1 and "vllm" in dict(info.meta)
    assert info.sources == (fa3.__file__,)


# ---------------------------------------------------------------- the wrappers' plumbing (stand-in)

@pytest.mark.parametrize("page", [16, 64])
def test_paged_prefill_decode_and_chunk_reach_fa3_as_its_interface_names_them(stand_in, seed_rng, page):
    lens = [37, 5, 70]
    q, k, v, kc, vc, table, cu, sk = _paged_inputs(lens, page, seed_rng)
    ref = attention_reference(q, k, v, cu)
    full = fa3.attention_paged_fa3(q, kc, vc, table, cu, sk, max(lens))
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(full, fa3.attention_varlen_fa3(q, k, v, cu, max(lens)))
    # one decode query per sequence (its last position) and a chunk over a cached prefix, into a given buffer
    last = cu[1:] - 1
    dec = fa3.attention_paged_fa3(q[last.long()], kc, vc, table, torch.arange(len(lens) + 1, dtype=torch.int32),
                                  sk, 1)
    assert torch.equal(dec, full[last.long()])
    at = 20
    buf = torch.full((lens[0] - at, HQ, q.shape[-1]), float("nan")).bfloat16()
    chunk = fa3.attention_paged_fa3(q[at:lens[0]], kc, vc, table[:1], torch.tensor([0, lens[0] - at]).int(),
                                    sk[:1], lens[0] - at, out=buf)
    assert chunk is buf and torch.equal(buf, full[at:lens[0]])
    for c in stand_in.calls:
        assert c["num_splits"] == fa3.NUM_SPLITS == 1 and c["fa_version"] == 3 and c["causal"]
        assert c["softmax_scale"] == pytest.approx(1 / math.sqrt(q.shape[-1]))
    paged = [c for c in stand_in.calls if c["paged"]]
    assert [c["max_seqlen_q"] for c in paged] == [max(lens), 1, lens[0] - at]
    assert {c["max_seqlen_k"] for c in paged} == {table.shape[1] * page}   # the table's width: no host sync
    assert paged[-1]["out"]


def test_scale_is_passed_through(stand_in, seed_rng):
    q, k, v, *_, cu, _ = _paged_inputs([9, 4], 16, seed_rng)
    a = fa3.attention_varlen_fa3(q, k, v, cu, 9, scale=0.3)
    assert stand_in.calls[-1]["softmax_scale"] == pytest.approx(0.3)
    assert not torch.equal(a, fa3.attention_varlen_fa3(q, k, v, cu, 9))


def test_bad_input_fails_before_fa3_is_called(stand_in):
    q = torch.zeros(4, HQ, 64).bfloat16()
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="bfloat16"):
        fa3.attention_varlen_fa3(q.float(), q.float()[:, :HKV], q.float()[:, :HKV], cu, 4)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        fa3.attention_varlen_fa3(q, q[:, :HKV], q[:, :HKV], cu, 4, window_size=(8, 0))
    kc = torch.zeros(2, 24, HKV, 64).bfloat16()
    with pytest.raises(ValueError, match="page size 24"):
        fa3.attention_paged_fa3(q, kc, kc, torch.zeros(1, 2, dtype=torch.int32), cu, cu[1:], 4)
    assert not stand_in.calls


def test_shapes_fa3_is_not_invariant_on_are_refused_before_fa3_is_called(stand_in, seed_rng):
    """Head dim 64 (decode rows differ from prefill rows) and pages of 128+ (reads past a sequence's keys) are
    refused with one line each (measured on the H200: the module docstring; the GPU tests below keep both facts)."""
    q, k, v, kc, vc, table, cu, sk = _paged_inputs([9, 4], 16, seed_rng, D=64)
    with pytest.raises(ValueError, match="head dim 64 is not supported.*default attention backend"):
        fa3.attention_varlen_fa3(q, k, v, cu, 9)
    with pytest.raises(ValueError, match="head dim 64 is not supported"):
        fa3.attention_paged_fa3(q, kc, vc, table, cu, sk, 9)
    q, k, v, kc, vc, table, cu, sk = _paged_inputs([9, 4], 128, seed_rng)
    with pytest.raises(ValueError, match="page size 128 is not supported.*16, 32, 64"):
        fa3.attention_paged_fa3(q, kc, vc, table, cu, sk, 9)
    assert not stand_in.calls
    fa3.attention_varlen_fa3(q, k, v, cu, 9)   # the same head dim 128 inputs pass the packed entry
    assert len(stand_in.calls) == 1


def test_patch_model_and_engine_refuse_those_shapes_up_front(stand_in):
    """A model of head dim 64 is refused when patched with ``attention=fa3``, an engine with pages of 128 when built:
    one line each, before a layer is swapped or a cache allocated (not per request at the first forward)."""
    from areal_tik.engine.config import EngineConfig
    from areal_tik.engine.llm_engine import LLMEngine
    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import kernels_of, patch_model
    m = build_model("tiny-qwen2", device="cpu")
    with pytest.raises(ValueError, match=r"attention \(fa3\): head dim 64 is not supported"):
        patch_model(m, backend="attention=fa3")
    assert kernels_of(m) is None                                    # nothing was swapped
    m = patch_model(build_model("tiny-qwen2", device="cpu", **HEAD_DIM_128["tiny-qwen2"]), backend="attention=fa3")
    with pytest.raises(ValueError, match=r"page size 128 is not supported.*16, 32, 64"):
        LLMEngine(m, EngineConfig(page_size=128, num_pages=8))
    out = LLMEngine(m, EngineConfig(page_size=64, num_pages=8)).generate([[1, 2, 3]])
    assert out[0].finish_reason != "error" and out[0].output_ids and stand_in.calls


def test_varlen_backward_runs_on_the_lse_fa3_returns(stand_in, seed_rng):
    """The autograd path converts FA3's natural-log lse [Hq, T] to the shared backward's base-2 [T, Hq]; a wrong
    conversion gives wrong gradients (the float64 autograd reference is the judge)."""
    q, k, v, *_, cu, _ = _paged_inputs([11, 6], 16, seed_rng)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa3.attention_varlen_fa3(*leaves, cu, 11)
    assert stand_in.calls[-1]["lse"]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed_rng)).bfloat16()
    out.backward(dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref_leaves, cu).backward(dout.double())
    for got, want in zip(leaves, ref_leaves):
        err = ((got.grad.double() - want.grad).norm() / want.grad.norm()).item()
        assert err < 2e-2, err


def test_engine_and_trainer_stay_bitwise_on_the_fa3_wrappers(stand_in, seed_rng):
    """R1-R4 through the engine (paged prefill, chunks, decode) and the trainer (varlen) of a model patched with
    ``attention=fa3``: every attention call goes through the wrappers, the stand-in being row-invariant."""
    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import patch_model
    from areal_tik.verify.parity import ParityConfig, run_parity
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=seed_rng % 1000, **HEAD_DIM_128["tiny-qwen2"]),
                    backend="attention=fa3")
    rep = run_parity(m, ParityConfig(n_prompts=4, max_prompt_len=20, max_new_tokens=6, pad_to=32, seed=seed_rng,
                                     regimes=("R1", "R2", "R3", "R4")))
    assert rep["passed"], rep["regimes"]
    assert {c["paged"] for c in stand_in.calls} == {True, False}


# ---------------------------------------------------------------- on the GPU (FA3 itself)

def _need_fa3():
    ok, why = availability.fa3_status()
    if not ok:
        pytest.skip(f"fa3 backend unavailable: {why}")


def _gpu_inputs(lens, page, seed):
    """The 1.5B attention shape (12 q / 2 kv heads, D 128) on the GPU."""
    return _paged_inputs(lens, page, seed, D=128, hq=12, hkv=2, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("page", fa3.PAGE_SIZES)
def test_gpu_every_row_equal_across_prefill_decode_chunks_and_batches(page, seed_rng):
    _need_fa3()
    lens = [1000, 37, 300, 129]
    q, k, v, kc, vc, table, cu, sk = _gpu_inputs(lens, page, seed_rng)
    full = fa3.attention_varlen_fa3(q, k, v, cu, max(lens))
    ref = attention_reference(q, k, v, cu)
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(fa3.attention_paged_fa3(q, kc, vc, table, cu, sk, max(lens)), full)
    # each sequence alone (batch mix), and sequence 0 decoded at every 7th position plus its last 16
    for i, n in enumerate(lens):
        s0 = int(cu[i])
        alone = fa3.attention_varlen_fa3(q[s0:s0 + n], k[s0:s0 + n], v[s0:s0 + n],
                                         torch.tensor([0, n], dtype=torch.int32, device="cuda"), n)
        assert torch.equal(alone, full[s0:s0 + n]), i
    one = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    positions = sorted(set(range(0, lens[0], 7)) | set(range(lens[0] - 16, lens[0])))
    for p in positions:
        row = fa3.attention_paged_fa3(q[p:p + 1], kc, vc, table[:1], one,
                                      torch.tensor([p + 1], dtype=torch.int32, device="cuda"), 1)
        assert torch.equal(row[0], full[p]), p
    # sequence 0 prefilled in chunks of 96 over its cached prefix
    for a in range(0, lens[0], 96):
        b = min(a + 96, lens[0])
        ch = fa3.attention_paged_fa3(q[a:b], kc, vc, table[:1], torch.tensor([0, b - a], dtype=torch.int32,
                                     device="cuda"), torch.tensor([b], dtype=torch.int32, device="cuda"), b - a)
        assert torch.equal(ch, full[a:b]), a


@pytest.mark.gpu
def test_gpu_backward_close_to_float64(seed_rng):
    _need_fa3()
    q, k, v, *_, cu, _ = _gpu_inputs([300, 77], 64, seed_rng)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa3.attention_varlen_fa3(*leaves, cu, 300)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref, cu).backward(dout.double())
    for got, want in zip(leaves, ref):
        assert ((got.grad.double() - want.grad).norm() / want.grad.norm()).item() < 1e-2


@pytest.mark.gpu
def test_gpu_decode_graph_replays_equal_eager(seed_rng):
    _need_fa3()
    lens = [500, 64, 1200]
    q, _, _, kc, vc, table, cu, sk = _gpu_inputs(lens, 64, seed_rng)
    last = (cu[1:] - 1).long()
    qd = q[last].contiguous()
    cq = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    eager = fa3.attention_paged_fa3(qd, kc, vc, table, cq, sk, 1)
    out = torch.full_like(qd, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fa3.attention_paged_fa3(qd, kc, vc, table, cq, sk, 1, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fa3.attention_paged_fa3(qd, kc, vc, table, cq, sk, 1, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_gpu_parity_all_regimes_with_graphs_on_fa3(name):
    _need_fa3()
    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import patch_model
    from areal_tik.verify.parity import ParityConfig, run_parity
    m = patch_model(build_model(name, device="cuda", **HEAD_DIM_128[name]), backend="attention=fa3")
    assert m.model.layers[0].self_attn.head_dim == 128
    rep = run_parity(m, ParityConfig(n_prompts=16, max_prompt_len=300, max_new_tokens=64, seed=5))
    assert rep["passed"], {r: (v["n_mismatch"], v["max_abs_diff"]) for r, v in rep["regimes"].items()}
    assert rep["regimes"]["R2"]["engine"]["graph_steps"] > 0


# ---------------------------------------------------------------- why the refused shapes are refused (raw FA3)

def _raw_paged(q, kc, vc, table, cu, sk, max_q):
    return fa3.flash_fn()(q, kc, vc, max_seqlen_q=max_q, cu_seqlens_q=cu, max_seqlen_k=table.shape[1] * kc.shape[1],
                          seqused_k=sk, block_table=table, causal=True, num_splits=1, fa_version=3)


@pytest.mark.gpu
def test_gpu_fa3_decode_rows_differ_from_prefill_rows_at_head_dim_64(seed_rng):
    """Negative control for the head-dim limit: at head dim 64 FA3's decode launch changes some row's bits (at 128
    it does not: test_gpu_every_row_equal_...). If a vLLM build fixes this, this test fails and HEAD_DIMS can grow."""
    _need_fa3()
    lens = [1000, 37, 300, 129]
    for d, must_differ in ((64, True), (128, False)):
        q, _, _, kc, vc, table, cu, sk = _paged_inputs(lens, 64, seed_rng, D=d, hq=12, hkv=2, device="cuda")
        full = _raw_paged(q, kc, vc, table, cu, sk, max(lens))
        last = (cu[1:] - 1).long()
        dec = _raw_paged(q[last].contiguous(), kc, vc, table, torch.arange(len(lens) + 1, dtype=torch.int32,
                                                                          device="cuda"), sk, 1)
        assert torch.equal(dec, full[last]) != must_differ, d


@pytest.mark.gpu
def test_gpu_fa3_pages_of_128_read_past_the_keys(seed_rng):
    """Negative control for the page-size limit: with pages of 128, NaN in the unused slots of a sequence's last page
    reaches its rows (pages of 64 with the same poison: none; the same pages zero-filled: bitwise equal)."""
    _need_fa3()
    lens = [1000, 37, 300, 129]
    for page, leaks in ((128, True), (64, False)):
        q, k, v, kc, vc, table, cu, sk = _gpu_inputs(lens, page, seed_rng)   # unused slots NaN
        out = _raw_paged(q, kc, vc, table, cu, sk, max(lens))
        assert bool(out.isnan().any()) == leaks, page
        if leaks:
            zc, zv = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
            assert torch.equal(_raw_paged(q, zc, zv, table, cu, sk, max(lens)),
                               fa3.attention_varlen_fa3(q, k, v, cu, max(lens)))
