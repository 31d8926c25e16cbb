"""CUDA C++ attention (csrc/) on the GPU (``-m gpu``, run by ``bash bench/gpu_check.sh tests``): the contract within
the cuda backend.

- R1 varlen (two packings, with a padding segment) == R2 paged prefill == R3 chunked prefill == R4 decode (all
  positions, shuffled batch mixes), bit for bit, in every launch mode (fold / split / auto), over lengths around
  block and split boundaries, page sizes 16..256, GQA group 1..8, D 64/128; float64 bound; outputs poisoned before
  every call; cache slots outside the sequences poisoned with NaN.
- Decode-shaped launches (max_seqlen_q * G <= 16) run the single 4-warp decode kernel; checked at batch 1/5/17 and
  contexts up to 3000 and 8K against the varlen rows (the split-KV merge: test_cuda_decode_merge.py).
- On sm_90a the wgmma (TMA-fed) prefill kernel, which auto picks at D = 128, equals the mma.sync prefill kernel and
  the decode kernel bit for bit (varlen packs past 4K, paged prefill over page sizes 16/64/256, chunked prefill, the
  bench's 8K shape); page sizes a TMA box would cross fall back.
- Bad inputs are refused with a message naming the problem.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from areal_tik.kernels.attention import attention_reference
from areal_tik.kernels.cuda import extension as cuda_extension
from areal_tik.verify.contract import check_accuracy, compare_bits, poison_

sys.path.insert(0, os.path.dirname(__file__))
from cuda_helpers import attn, build_cache, seq_data, varlen_rows, wgmma_or_skip, written  # noqa: E402  (tests/kernels/cuda_helpers.py)


def _regimes(lens, Hq, Hkv, D, page_size, seed):
    cu = attn()
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    B = len(lens)
    qs = [torch.randn(L, Hq, D, generator=gen).bfloat16().to(dev) for L in lens]
    ks = [torch.randn(L, Hkv, D, generator=gen).bfloat16().to(dev) for L in lens]
    vs = [torch.randn(L, Hkv, D, generator=gen).bfloat16().to(dev) for L in lens]
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    T = q.shape[0]
    cu_list = [0] + torch.tensor(lens).cumsum(0).tolist()
    cus = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    starts = cu_list[:-1]
    maxlen = max(lens)
    outs = {}

    # R1: varlen, natural packing, every mode
    for mode in ("auto", "fold", "split"):
        outs[f"R1[{mode}]"] = written(
            lambda o: cu.attention_varlen_cuda(q, k, v, cus, maxlen, mode=mode, out=o), q.shape, q.dtype)
    # R1 / R2 on the mma.sync prefill kernel (auto / fold run the sm_90a wgmma kernel at D = 128 on H100/H200)
    outs["R1[mma]"] = written(lambda o: cu.attention_varlen_cuda(q, k, v, cus, maxlen, out=o, prefill_kernel="mma"),
                               q.shape, q.dtype)
    # R1: another packing (reversed order) plus a padding segment, mapped back
    order = list(range(B))[::-1]
    pad = int(torch.randint(1, 70, (1,), generator=gen))
    pq = torch.cat([qs[i] for i in order] + [torch.randn(pad, Hq, D, generator=gen).bfloat16().to(dev)])
    pk = torch.cat([ks[i] for i in order] + [torch.randn(pad, Hkv, D, generator=gen).bfloat16().to(dev)])
    pv = torch.cat([vs[i] for i in order] + [torch.randn(pad, Hkv, D, generator=gen).bfloat16().to(dev)])
    plens = [lens[i] for i in order] + [pad]
    pcu = torch.tensor([0] + torch.tensor(plens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    po = written(lambda o: cu.attention_varlen_cuda(pq, pk, pv, pcu, max(plens), out=o), pq.shape, pq.dtype)
    back = poison_(torch.empty_like(q))     # rows never mapped back stay NaN-poisoned
    at = 0
    for i in order:
        back[cu_list[i]:cu_list[i + 1]] = po[at:at + lens[i]]
        at += lens[i]
    outs["R1[repacked+pad]"] = back

    kc, vc, bt = build_cache(ks, vs, page_size, gen)
    seqk = torch.tensor(lens, dtype=torch.int32, device=dev)
    # R2: paged prefill of whole sequences, every mode
    for mode in ("auto", "fold", "split"):
        outs[f"R2[{mode}]"] = written(
            lambda o: cu.attention_paged_cuda(q, kc, vc, bt, cus, seqk, maxlen, mode=mode, out=o), q.shape, q.dtype)

    outs["R2[mma]"] = written(
        lambda o: cu.attention_paged_cuda(q, kc, vc, bt, cus, seqk, maxlen, out=o, prefill_kernel="mma"),
        q.shape, q.dtype)

    # R3: chunked prefill, random cuts (incl. 1-token and block-aligned chunks), rounds batch the
    # r-th chunk of every sequence together
    cuts = []
    for L in lens:
        c = sorted(set([0, L] + [int(x) for x in torch.randint(1, max(L, 2), (3,), generator=gen) if 0 < x < L]
                       + ([64] if L > 64 else []) + ([L - 1] if L > 1 else [])))
        cuts.append(c)
    r3 = poison_(torch.empty_like(q))
    for r in range(max(len(c) - 1 for c in cuts)):
        idx = [i for i in range(B) if r < len(cuts[i]) - 1]
        qq, nq, sk, rows = [], [], [], []
        for i in idx:
            a, b = cuts[i][r], cuts[i][r + 1]
            qq.append(qs[i][a:b])
            nq.append(b - a)
            sk.append(b)
            rows.append(i)
        qcat = torch.cat(qq)
        cq = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        mode = ("auto", "fold", "split")[r % 3]
        o = written(lambda o: cu.attention_paged_cuda(qcat, kc, vc, bt[rows].contiguous(), cq,
                                                       torch.tensor(sk, dtype=torch.int32, device=dev), max(nq),
                                                       mode=mode, out=o), qcat.shape, qcat.dtype)
        at = 0
        for j, i in enumerate(idx):
            a, b = cuts[i][r], cuts[i][r + 1]
            r3[cu_list[i] + a:cu_list[i] + b] = o[at:at + nq[j]]
            at += nq[j]
    outs["R3"] = r3

    # R4: decode. Every position of every sequence is one decode request (n=1) reading its own
    # block-table row with seqlens_k = p + 1; one launch with all of them (natural order), one in
    # a shuffled order, split across two launches of different batch sizes, and in fold mode.
    owner = torch.repeat_interleave(torch.arange(B), torch.tensor(lens))
    pos = torch.cat([torch.arange(L) for L in lens])

    def decode(perm, mode="auto", merge=None):
        res = poison_(torch.empty_like(q))
        for part in (perm[: len(perm) // 3], perm[len(perm) // 3:]):
            if len(part) == 0:
                continue
            pidx = torch.tensor(part)
            qd = q[pidx.to(dev)]
            bts = bt[owner[pidx].to(dev)].contiguous()
            sk = (pos[pidx] + 1).to(torch.int32).to(dev)
            cq = torch.arange(len(part) + 1, dtype=torch.int32, device=dev)
            o = written(lambda o: cu.attention_paged_cuda(qd, kc, vc, bts, cq, sk, 1, mode=mode, out=o,
                                                           decode_merge=merge), qd.shape, qd.dtype)
            res[pidx.to(dev)] = o
        return res

    ident = list(range(T))
    outs["R4[auto]"] = decode(ident)
    outs["R4[shuffled]"] = decode(torch.randperm(T, generator=gen).tolist())
    outs["R4[fold]"] = decode(ident, "fold")
    outs["R4[merge-kernel]"] = decode(ident, "split", merge="kernel")
    outs["R4[merge-fused]"] = decode(ident, "split", merge="fused")
    ref = attention_reference(q, k, v, cus)
    return outs, ref, starts


CASES = [  # (lens, Hq, Hkv, D, page_size)
    ([1, 63, 64, 65, 300], 8, 8, 128, 16),
    ([255, 256, 257, 2, 17], 32, 8, 128, 256),
    ([511, 513, 129, 1], 8, 1, 64, 64),
    ([700, 3, 128, 191], 4, 2, 64, 32),
    ([1000, 31, 257], 14, 2, 128, 128),
    ([1, 2, 3, 600, 512], 16, 2, 128, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_regimes_bitwise_and_accurate(case, seed_rng):
    lens, Hq, Hkv, D, ps = CASES[case]
    outs, ref, _ = _regimes(lens, Hq, Hkv, D, ps, seed_rng)
    base_name = "R1[auto]"
    base = outs[base_name]
    acc = check_accuracy(base, ref, 1e-2)
    assert acc, acc
    fails = []
    for name, o in outs.items():
        rep = compare_bits(base, o, name=f"{base_name}=={name}")
        if not rep:
            fails.append(str(rep))
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D", [(8, 2, 128), (4, 4, 64)])
def test_attention_random_lengths(hq, hkv, D, seed_rng):
    g = torch.Generator().manual_seed(seed_rng)
    lens = [int(x) for x in torch.randint(1, 900, (5,), generator=g)]
    ps = 2 ** int(torch.randint(4, 9, (1,), generator=g))
    outs, ref, _ = _regimes(lens, hq, hkv, D, ps, seed_rng)
    base = outs["R1[auto]"]
    assert check_accuracy(base, ref, 1e-2)
    for name, o in outs.items():
        rep = compare_bits(base, o, name=name)
        assert rep, f"lens={lens} page_size={ps}: {rep}"


@pytest.mark.gpu
def test_attention_long_context_decode_matches_prefill(seed_rng):
    """Decode at 8K context (32 split chunks) equals the varlen rows at the same positions."""
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    L, Hq, Hkv, D = 8192 + 37, 32, 8, 128
    q = torch.randn(L, Hq, D, generator=g).bfloat16().cuda()
    k = torch.randn(L, Hkv, D, generator=g).bfloat16().cuda()
    v = torch.randn(L, Hkv, D, generator=g).bfloat16().cuda()
    cus = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    full = cu.attention_varlen_cuda(q, k, v, cus, L)
    kc, vc, bt = build_cache([k], [v], 64, g)
    sel = torch.tensor([0, 255, 256, 4095, 4096, 8191, L - 1])
    qd = q[sel.cuda()]
    sk = (sel + 1).to(torch.int32).cuda()
    o = cu.attention_paged_cuda(qd, kc, vc, bt[[0] * len(sel)].contiguous(),
                                torch.arange(len(sel) + 1, dtype=torch.int32, device="cuda"), sk, 1)
    rep = compare_bits(full[sel.cuda()], o, name="decode==varlen@8K")
    assert rep, rep
    ref = attention_reference(q[-64:], k, v, torch.tensor([0, 64]), torch.tensor([0, L]))
    assert check_accuracy(full[-64:], ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D,ps", [(32, 8, 128, 64), (16, 2, 64, 16), (7, 7, 128, 256)])
def test_attention_decode_batches_match_varlen(hq, hkv, D, ps, seed_rng):
    """Decode (one query per sequence, at its last position) in every mode, batch 1/5/17 in
    random orders, contexts across block/split boundaries up to 3000, equals the varlen rows
    at the same positions."""
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    lens = [1, 63, 64, 65, 255, 256, 257, 700, 1024, 3000] + [int(x) for x in torch.randint(1, 3000, (7,), generator=g)]
    qs, ks, vs = seq_data(lens, hq, hkv, D, g)
    kc, vc, bt = build_cache(ks, vs, ps, g)
    qd = torch.stack([qq[-1] for qq in qs])
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    full = torch.stack([r[-1] for r in varlen_rows(cu, qs, ks, vs)])
    for B in (1, 5, len(lens)):
        idx = torch.randperm(len(lens), generator=g)[:B].cuda()
        cq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        args = (qd[idx].contiguous(), kc, vc, bt[idx].contiguous(), cq, sk[idx].contiguous(), 1)
        for mode in ("auto", "fold", "split"):
            o = written(lambda o: cu.attention_paged_cuda(*args, mode=mode, out=o), args[0].shape, args[0].dtype)
            rep = compare_bits(full[idx], o, name=f"decode==varlen B={B} {mode}")
            assert rep, rep


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,ps", [(32, 8, 64), (14, 2, 16), (8, 8, 256)])
def test_wgmma_prefill_equals_mma_sync(hq, hkv, ps, seed_rng):
    """On sm_90a the wgmma prefill kernel (auto's choice at D = 128) equals the mma.sync kernel bit
    for bit: varlen packs of random lengths (one past 4K: 17 split chunks, FOLD merges), paged
    prefill and a chunked-prefill round over the same cache; outputs NaN-poisoned first; a
    forced wgmma launch where it cannot run (D = 64) is refused."""
    cu = attn()
    wgmma_or_skip(cu)
    g = torch.Generator().manual_seed(seed_rng)
    lens = [4096 + int(torch.randint(1, 200, (1,), generator=g)), 1, 64, 65] + \
           [int(x) for x in torch.randint(2, 1500, (4,), generator=g)]
    qs, ks, vs = seq_data(lens, hq, hkv, 128, g)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    cus = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    mx = max(lens)
    outs = {pk: written(lambda o: cu.attention_varlen_cuda(q, k, v, cus, mx, out=o, prefill_kernel=pk),
                         q.shape, q.dtype) for pk in ("mma", "wgmma", "auto")}
    for pk in ("wgmma", "auto"):
        rep = compare_bits(outs["mma"], outs[pk], name=f"varlen mma=={pk}")
        assert rep, rep
    ref = attention_reference(q[:lens[0]], k[:lens[0]], v[:lens[0]], cus[:2].cpu())
    assert check_accuracy(outs["wgmma"][:lens[0]], ref, 1e-2)
    kc, vc, bt = build_cache(ks, vs, ps, g)
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    paged = {pk: written(lambda o: cu.attention_paged_cuda(q, kc, vc, bt, cus, sk, mx, out=o, prefill_kernel=pk),
                          q.shape, q.dtype) for pk in ("mma", "wgmma")}
    for pk, o in paged.items():
        rep = compare_bits(outs["mma"], o, name=f"varlen==paged[{pk}]")
        assert rep, rep
    # chunked prefill: the last 100 (or fewer) queries of every sequence against the full cache
    tail = [min(100, L) for L in lens]
    qt = torch.cat([qq[-n:] for qq, n in zip(qs, tail)])
    ct = torch.tensor([0] + torch.tensor(tail).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    want = torch.cat([outs["mma"][int(cus[i + 1]) - n:int(cus[i + 1])] for i, n in enumerate(tail)])
    for pk in ("mma", "wgmma"):
        o = written(lambda o: cu.attention_paged_cuda(qt, kc, vc, bt, ct, sk, max(tail), out=o, prefill_kernel=pk),
                     qt.shape, qt.dtype)
        rep = compare_bits(want, o, name=f"chunked[{pk}]")
        assert rep, rep
    q64 = torch.randn(300, 4, 64, device="cuda").bfloat16()
    k64 = torch.randn(300, 2, 64, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="not supported"):
        cu.attention_varlen_cuda(q64, k64, k64, torch.tensor([0, 300], dtype=torch.int32, device="cuda"), 300,
                                 prefill_kernel="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("ps", [96, 80, 48])
def test_wgmma_prefill_odd_page_size_falls_back(ps, seed_rng):
    """A page size that neither divides 64 nor is a multiple of it (the binding accepts it; the Python
    entry points do not): a 64-row TMA box would cross a page, so "auto" must run the mma.sync kernel
    (rows equal the varlen rows bit for bit) and a forced wgmma launch must be refused, never read
    the wrong page. Caches are NaN-poisoned outside the written slots."""
    cu = attn()
    wgmma_or_skip(cu)
    g = torch.Generator().manual_seed(seed_rng)
    lens = [300, 130, 64]
    Hq, Hkv, D = 8, 2, 128
    qs, ks, vs = seq_data(lens, Hq, Hkv, D, g)
    q = torch.cat(qs)
    cus = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    want = torch.cat(varlen_rows(cu, qs, ks, vs))
    kc, vc, bt = build_cache(ks, vs, ps, g)  # kv_cache_write takes any page size
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ext = cuda_extension.extension()
    sc = D ** -0.5
    got = written(lambda o: ext.attention_paged_fwd(q, kc, vc, bt, cus, sk, max(lens), sc, 0, out=o,
                                                     decode_merge=0, prefill_kernel=0), q.shape, q.dtype)
    rep = compare_bits(want, got, name=f"paged ps={ps} auto")
    assert rep, rep
    with pytest.raises(RuntimeError, match="not supported"):
        ext.attention_paged_fwd(q, kc, vc, bt, cus, sk, max(lens), sc, 0, out=None, decode_merge=0, prefill_kernel=2)


@pytest.mark.gpu
def test_wgmma_prefill_bench_shape_matches_decode(seed_rng):
    """The bench's prefill shape (32 q / 8 kv heads, D 128, 8K + 5 tokens): wgmma varlen == mma.sync
    varlen, and decode rows (the mma.sync decode kernel) at chunk-boundary positions equal it."""
    cu = attn()
    wgmma_or_skip(cu)
    g = torch.Generator().manual_seed(seed_rng)
    L, Hq, Hkv, D = 8192 + 5, 32, 8, 128
    (q,), (k,), (v,) = seq_data([L], Hq, Hkv, D, g)
    cus = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    a = written(lambda o: cu.attention_varlen_cuda(q, k, v, cus, L, out=o, prefill_kernel="wgmma"), q.shape, q.dtype)
    b = written(lambda o: cu.attention_varlen_cuda(q, k, v, cus, L, out=o, prefill_kernel="mma"), q.shape, q.dtype)
    rep = compare_bits(b, a, name="wgmma==mma @8K")
    assert rep, rep
    kc, vc, bt = build_cache([k], [v], 64, g)
    sel = torch.tensor([0, 63, 64, 255, 256, 4095, 4096, 8191, L - 1])
    o = cu.attention_paged_cuda(q[sel.cuda()], kc, vc, bt[[0] * len(sel)].contiguous(),
                                torch.arange(len(sel) + 1, dtype=torch.int32, device="cuda"),
                                (sel + 1).to(torch.int32).cuda(), 1)
    rep = compare_bits(a[sel.cuda()], o, name="decode==wgmma varlen")
    assert rep, rep


@pytest.mark.gpu
def test_attention_rejects_bad_inputs():
    cu = attn()
    q = torch.randn(4, 4, 96, device="cuda").bfloat16()
    k = torch.randn(4, 2, 96, device="cuda").bfloat16()
    cus = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head dim"):
        cu.attention_varlen_cuda(q, k, k, cus, 4)
    with pytest.raises(TypeError, match="bfloat16"):
        cu.attention_varlen_cuda(q.float()[..., :64], k.float()[..., :64], k.float()[..., :64], cus, 4)
    with pytest.raises(ValueError, match="CUDA"):
        cu.attention_varlen_cuda(q.cpu(), k.cpu(), k.cpu(), cus.cpu(), 4)
    with pytest.raises(ValueError, match="multiple"):
        q3 = torch.randn(4, 3, 64, device="cuda").bfloat16()
        k2 = torch.randn(4, 2, 64, device="cuda").bfloat16()
        cu.attention_varlen_cuda(q3, k2, k2, cus, 4)
    # the decode schedule knobs of the binding (timing only) reject values outside their range
    q1 = torch.randn(1, 4, 64, device="cuda").bfloat16()
    kc = torch.zeros(2, 16, 2, 64, device="cuda").bfloat16()
    bt = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    cq = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    sk = torch.tensor([20], dtype=torch.int32, device="cuda")
    ext = cuda_extension.extension()
    for kw in ({"decode_cpc": -1}, {"decode_cpc": 65}, {"decode_stages": 1}, {"decode_stages": 4}):
        with pytest.raises(RuntimeError, match="decode_(cpc|stages)"):
            ext.attention_paged_fwd(q1, kc, kc, bt, cq, sk, 1, 0.125, 0, **kw)
