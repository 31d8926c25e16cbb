"""CUDA C++ decode's split-KV merge on the GPU (``-m gpu``): the merge in the same launch (default) equals the
two-launch merge kernel and the varlen rows bit for bit (batches 1/5/17, contexts across 256-position chunk ends,
wide block tables, multi-query tails, every chunks-per-CTA count and ring depth), the counters are zero after every
launch, CUDA-graph replays with fresh inputs and lengths give the eager bits, the fused launch is one kernel and no
memset, and a launch captured before the counter buffer is large enough falls back to the merge kernel."""
from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

from areal_tik.kernels.cuda import extension as cuda_extension
from areal_tik.verify.contract import compare_bits, poison_

sys.path.insert(0, os.path.dirname(__file__))
from cuda_helpers import attn, both_merges, build_cache, counters_zero, seq_data, varlen_rows, written  # noqa: E402  (tests/kernels/cuda_helpers.py)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D,ps", [(32, 8, 128, 64), (16, 2, 64, 16), (8, 8, 128, 256), (64, 8, 128, 32)])
def test_decode_fused_merge_equals_merge_kernel(hq, hkv, D, ps, seed_rng):
    """One query per sequence: the one-launch merge equals the decode + merge-kernel pair and
    the varlen rows, bit for bit, at batch 1/5/17, contexts around chunk ends (255..258,
    511..513), 1000, 3000 and random, with the exact and with a wider block table (more
    grid chunks than any sequence uses), in auto and split mode; counters zero afterwards."""
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    lens = [1, 2, 255, 256, 257, 258, 511, 512, 513, 1000, 3000] + \
        [int(x) for x in torch.randint(1, 4000, (6,), generator=g)]
    qs, ks, vs = seq_data(lens, hq, hkv, D, g)
    kc, vc, bt = build_cache(ks, vs, ps, g)
    full = torch.stack([r[-1] for r in varlen_rows(cu, qs, ks, vs)])
    qd = torch.stack([qq[-1] for qq in qs])
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    wide = torch.cat([bt, torch.full((bt.shape[0], 37), -1, dtype=torch.int32, device="cuda")], 1)
    for B in (1, 5, len(lens)):
        idx = torch.randperm(len(lens), generator=g)[:B].cuda()
        cq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        for table in (bt, wide):
            args = (qd[idx].contiguous(), kc, vc, table[idx].contiguous(), cq, sk[idx].contiguous(), 1)
            for mode in ("auto", "split"):
                a, b = both_merges(cu, args, mode)
                rep = compare_bits(b, a, name=f"fused==merge-kernel B={B} width={table.shape[1]} {mode}")
                assert rep, rep
                rep = compare_bits(full[idx], a, name=f"fused==varlen B={B} width={table.shape[1]} {mode}")
                assert rep, rep
                counters_zero(cu)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D,ps", [(8, 2, 128, 64), (16, 8, 64, 32), (4, 4, 128, 16)])
def test_decode_fused_merge_multi_query_tails(hq, hkv, D, ps, seed_rng):
    """Decode-shaped launches with several queries per sequence (n_i * G <= 16: speculative /
    short chunked-prefill tails), whose 16-row tile spans positions on both sides of a chunk
    end: fused == merge kernel == varlen rows."""
    cu = attn()
    G = hq // hkv
    nmax = 16 // G
    g = torch.Generator().manual_seed(seed_rng)
    lens = [nmax, 256, 257, 258, 256 + nmax - 1, 512 + nmax // 2, 1000, 2999] + \
        [int(x) for x in torch.randint(nmax, 3000, (5,), generator=g)]
    qs, ks, vs = seq_data(lens, hq, hkv, D, g)
    kc, vc, bt = build_cache(ks, vs, ps, g)
    rows = varlen_rows(cu, qs, ks, vs)
    nq = [int(x) for x in torch.randint(1, nmax + 1, (len(lens),), generator=g)]
    nq[0] = nmax
    qd = torch.cat([qs[i][-nq[i]:] for i in range(len(lens))])
    expect = torch.cat([rows[i][-nq[i]:] for i in range(len(lens))])
    cq = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    args = (qd, kc, vc, bt, cq, sk, max(nq))
    for mode in ("auto", "split"):
        a, b = both_merges(cu, args, mode)
        rep = compare_bits(b, a, name=f"multi-query fused==merge-kernel {mode} nq={nq}")
        assert rep, rep
        rep = compare_bits(expect, a, name=f"multi-query fused==varlen {mode} nq={nq}")
        assert rep, rep
    counters_zero(cu)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D,ps", [(32, 8, 128, 64), (16, 2, 64, 16), (8, 2, 128, 32)])
def test_decode_chunks_per_cta_same_bits(hq, hkv, D, ps, seed_rng):
    """A decode CTA may walk several split chunks one after another (decode_cpc; the launcher picks
    it from the grid size), through a 2- or 3-stage ring (decode_stages): every forced chunk count 1..5
    and auto, with every ring depth, with the fused and the two-launch merge,
    one and several queries per sequence, exact and wide block tables, equals the varlen rows bit for
    bit; counters zero afterwards."""
    cu = attn()
    ext = cuda_extension.extension()
    G = hq // hkv
    nmax = 16 // G
    g = torch.Generator().manual_seed(seed_rng)
    lens = [nmax, 255, 256, 257, 511, 513, 1023, 1025, 2049, 3000] + \
        [int(x) for x in torch.randint(nmax, 4000, (5,), generator=g)]
    qs, ks, vs = seq_data(lens, hq, hkv, D, g)
    kc, vc, bt = build_cache(ks, vs, ps, g)
    rows = varlen_rows(cu, qs, ks, vs)
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    wide = torch.cat([bt, torch.full((bt.shape[0], 41), -1, dtype=torch.int32, device="cuda")], 1)
    for nq in ([1] * len(lens), [int(x) for x in torch.randint(1, nmax + 1, (len(lens),), generator=g)]):
        qd = torch.cat([qs[i][-nq[i]:] for i in range(len(lens))])
        expect = torch.cat([rows[i][-nq[i]:] for i in range(len(lens))])
        cq = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        for table in (bt, wide):
            for cpc, st in itertools.product((0, 1, 2, 3, 4, 5), (0, 2, 3)):
                for merge in (0, 1):
                    o = written(lambda o: ext.attention_paged_fwd(qd, kc, vc, table, cq, sk, max(nq), D ** -0.5, 2,
                                                                   out=o, decode_merge=merge, decode_cpc=cpc,
                                                                   decode_stages=st),
                                 qd.shape, qd.dtype)
                    rep = compare_bits(expect, o, name=f"decode_cpc={cpc} stages={st} merge={merge} "
                                                       f"width={table.shape[1]} max_nq={max(nq)}")
                    assert rep, rep
            counters_zero(cu)


@pytest.mark.gpu
def test_decode_fused_merge_graph_replay_and_repeats(seed_rng):
    """The counter reset: 20 eager fused launches give one set of bits; a CUDA graph of the
    fused decode replayed 8 times with fresh queries and fresh context lengths (so a tile's
    chunk count changes between replays, 1 chunk .. 12) into a NaN-poisoned output equals the
    eager merge-kernel launch on the same inputs each time; counters zero after each."""
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    hq, hkv, D, ps, B, L = 32, 8, 128, 64, 5, 3000
    qs, ks, vs = seq_data([L] * B, hq, hkv, D, g)
    kc, vc, bt = build_cache(ks, vs, ps, g)
    q = torch.randn(B, hq, D, generator=g).bfloat16().cuda()
    sk = torch.tensor([257, 1, 3000, 256, 1000], dtype=torch.int32, device="cuda")
    cq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(B, hq, D, dtype=torch.bfloat16, device="cuda")

    def run(merge="fused", o=out):
        return cu.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1, out=o, decode_merge=merge)

    first = written(lambda o: run("fused", o), out.shape, out.dtype).clone()
    for _ in range(20):
        poison_(out)
        run()
        rep = compare_bits(first, out, name="repeated fused launch")
        assert rep, rep
    counters_zero(cu)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lens_seq = [[1, 2, 3, 4, 5], [255, 256, 257, 258, 3000], [3000, 2999, 1024, 1025, 767],
                [17, 3000, 257, 1, 512], [256] * 5, [2048, 2049, 2050, 2051, 2052], [3000] * 5, [1, 1, 1, 1, 300]]
    for r, lens in enumerate(lens_seq):
        q.copy_(torch.randn(B, hq, D, generator=g).bfloat16())
        sk.copy_(torch.tensor(lens, dtype=torch.int32))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        counters_zero(cu)
        expect = written(lambda o: run("kernel", o), out.shape, out.dtype)
        rep = compare_bits(expect, got, name=f"graph replay {r} lens={lens}")
        assert rep, rep
        assert not torch.isnan(got.float()).any(), f"replay {r}: unwritten (NaN-poisoned) output"
        full = torch.stack([cu.attention_varlen_cuda(qq[:n], kk[:n], vv[:n],
                                                     torch.tensor([0, n], dtype=torch.int32, device="cuda"), n)[-1]
                            for qq, kk, vv, n in zip([q[i:i + 1].expand(L, hq, D) for i in range(B)], ks, vs, lens)])
        rep = compare_bits(full, got, name=f"graph replay {r} == varlen rows")
        assert rep, rep


def _gpu_kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if "sync" not in n.lower()]  # CUDA sync activities are not launches


@pytest.mark.gpu
def test_decode_fused_merge_is_one_launch(seed_rng):
    """The default decode launch with several chunks per sequence is one kernel (no merge
    kernel, no memset); decode_merge="kernel" is the decode kernel + the merge kernel."""
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    qs, ks, vs = seq_data([1000, 3000], 32, 8, 128, g)
    kc, vc, bt = build_cache(ks, vs, 64, g)
    q = torch.stack([qq[-1] for qq in qs])
    args = (q, kc, vc, bt, torch.arange(3, dtype=torch.int32, device="cuda"),
            torch.tensor([1000, 3000], dtype=torch.int32, device="cuda"), 1)
    out = torch.empty_like(q)
    cu.attention_paged_cuda(*args, out=out)  # counters exist before profiling
    fused = _gpu_kernel_names(lambda: cu.attention_paged_cuda(*args, out=out, decode_merge="fused"))
    two = _gpu_kernel_names(lambda: cu.attention_paged_cuda(*args, out=out, decode_merge="kernel"))
    if not any("attn" in n for n in fused) or not any("attn" in n for n in two):
        pytest.skip(f"the profiler recorded no attention kernels (fused={fused}, kernel={two})")
    assert len(fused) == 1 and "attn_decode_kernel" in fused[0], fused  # one kernel, no memset/merge
    assert len(two) == 2 and any("attn_decode_merge_kernel" in n for n in two), two


@pytest.mark.gpu
def test_decode_fused_counter_growth_and_capture_fallback(seed_rng):
    """More tiles than counters: an eager launch grows the buffer (the old one is kept alive);
    a launch captured while the buffer is too small takes the merge-kernel path inside the
    graph (no allocation during capture) and still gives the eager bits; counters stay zero."""
    cu = attn()
    ext = cuda_extension.extension()
    g = torch.Generator().manual_seed(seed_rng)
    hq = hkv = 16
    D, ps, L = 64, 256, 300
    (q1,), (k1,), (v1,) = seq_data([L], hq, hkv, D, g)
    kc, vc, bt1 = build_cache([k1], [v1], ps, g)
    cu.attention_paged_cuda(q1[-1:], kc, vc, bt1, torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                            torch.tensor([L], dtype=torch.int32, device="cuda"), 1)
    cap0 = ext.decode_counters(torch.cuda.current_device()).numel()

    def batch(B):  # B sequences sharing the same pages, own queries and lengths
        q = torch.randn(B, hq, D, generator=g).bfloat16().cuda()
        sk = torch.randint(1, L + 1, (B,), generator=g).to(torch.int32).cuda()
        return (q, kc, vc, bt1.expand(B, -1).contiguous(), torch.arange(B + 1, dtype=torch.int32, device="cuda"),
                sk, 1)

    B1 = cap0 // hkv + 3  # needs more counters than exist: eager growth
    args = batch(B1)
    a, b = both_merges(cu, args)
    rep = compare_bits(b, a, name="fused==merge-kernel after growth")
    assert rep, rep
    cap1 = counters_zero(cu).numel()
    assert cap1 >= B1 * hkv > cap0
    B2 = cap1 // hkv + 3  # too many for the buffer while capturing: merge-kernel fallback
    args = batch(B2)
    # eager reference first (decode_merge="kernel" never touches the counters; also loads the
    # merge kernel before the capture)
    expect = written(lambda o: cu.attention_paged_cuda(*args, out=o, decode_merge="kernel"),
                      args[0].shape, args[0].dtype)
    assert ext.decode_counters(torch.cuda.current_device()).numel() == cap1
    out = torch.empty_like(args[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cu.attention_paged_cuda(*args, out=out)
    assert ext.decode_counters(torch.cuda.current_device()).numel() == cap1, "allocated during capture"
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    rep = compare_bits(expect, out, name="captured fallback == eager merge kernel")
    assert rep, rep
    a, _ = both_merges(cu, args)  # eager again: grows, fused, same bits
    rep = compare_bits(expect, a, name="fused after second growth")
    assert rep, rep
    counters_zero(cu)
