"""Time several csrc trees side by side in one process on one GPU (the wgmma prefill), bits checked first.

    python bench/probes/bisect_csrc.py --dir scratch/bisect --variants H A B [--ref H] --out $OUT

Each variant is a directory DIR/NAME holding a full csrc copy (e.g. `git archive BRANCH csrc | tar -x -C
DIR/NAME --strip-components=1`), built in parallel as its own torch extension (tikv_NAME, sm_90a).
Correctness first: a varlen pack of lengths 4100/1/64/65/777/1500 (32 q / 8 kv heads, D 128) and the same
sequences as paged prefill over NaN-poisoned caches (page sizes 16/64/128), every variant's wgmma output
(NaN-poisoned before) torch.equal to the reference variant's mma.sync varlen output, and its max |out - float64|
beside it (a probe whose bits differ by design must still be attention: compare with the reference's). Then prefill
TFLOP/s at L 4K/8K/16K (batch 1, causal), two interleaved repetitions, with SDPA beside them.
Writes OUT/bisect.json: [checks, rows...]. Exit 1 if any bit check fails.

    python bench/probes/bisect_csrc.py --decode --dir DIR --variants H MC [--cpc 0 1 2 4] --out $OUT

Decode mode: the decode kernel instead (one query per sequence, page size 64). Bits first: a ragged batch
(KV lengths 1..8192 around chunk and block edges, NaN-poisoned caches, page sizes 16 and 64), fused and
two-launch merge, every variant (and every --cpc value of a build that takes `decode_cpc`) torch.equal to
the reference variant's fused output. Then CUDA-graph times per (batch, context) cell, SDPA beside them.
Writes OUT/bisect_decode.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import sys
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/

HQ, HKV, D = 32, 8, 128


def _load(args):
    """Build (or load the cached build of) variant NAME from DIR/NAME; returns (name, seconds, module)."""
    vdir, name = args
    from torch.utils.cpp_extension import load
    bd = f"/tmp/bisect_build_{name}"
    os.makedirs(bd, exist_ok=True)
    srcs = sorted(glob.glob(os.path.join(vdir, name, "*.cu")) + glob.glob(os.path.join(vdir, name, "*.cpp")))
    t = time.time()
    mod = load(name=f"tikv_{name}", sources=srcs, build_directory=bd, extra_cflags=["-O3"], verbose=False,
               extra_cuda_cflags=["-O3", "-DNO_FAST_MATH", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"])
    return name, round(time.time() - t, 1), mod


def _build_seconds(args):
    name, sec, _ = _load(args)
    return name, sec


def _paged_cache(k, v, lens, cu, ps, g):
    npg = [-(-L // ps) for L in lens]
    num = sum(npg) + 3
    perm = torch.randperm(num, generator=g).tolist()
    kc = torch.full((num, ps, HKV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    bt = torch.full((len(lens), max(npg) + 1), -1, dtype=torch.int32)
    at = 0
    for i, L in enumerate(lens):
        pages = perm[at:at + npg[i]]
        at += npg[i]
        bt[i, :npg[i]] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(L)
        slot = (torch.tensor(pages)[pos // ps] * ps + pos % ps).cuda()
        start = int(cu[i])
        kc.view(-1, HKV, D)[slot] = k[start:start + L]
        vc.view(-1, HKV, D)[slot] = v[start:start + L]
    return kc, vc, bt.cuda()


def check_bits(mods, ref_name):
    """Every variant's wgmma output (varlen and paged 16/64/128 over NaN-poisoned caches) torch.equal to the
    reference variant's mma.sync output ({name}_{case}: bool), and its max |out - float64| beside it
    ({name}_{case}_vs_f64: float), so that a variant whose bits differ by design (a probe) still shows it
    computes attention, not less work."""
    from areal_tik.kernels.attention import attention_reference
    g = torch.Generator().manual_seed(1)
    lens = [4100, 1, 64, 65, 777, 1500]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g).bfloat16().cuda() for h in (HQ, HKV, HKV))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sc = D ** -0.5
    ref = mods[ref_name].attention_varlen_fwd(q, k, v, cu, max(lens), sc, 0, out=None, prefill_kernel=1)
    f64 = attention_reference(q, k, v, cu, scale=sc)  # float64, causal GQA per sequence
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    checks = {f"{ref_name}_mma_vs_f64": (ref.double() - f64).abs().max().item()}
    for name, m in mods.items():
        out = torch.full_like(q, float("nan"))
        m.attention_varlen_fwd(q, k, v, cu, max(lens), sc, 0, out=out, prefill_kernel=2)
        checks[f"{name}_varlen"] = bool(torch.equal(out, ref))
        checks[f"{name}_varlen_vs_f64"] = (out.double() - f64).abs().max().item()  # NaN if any row was left unwritten
        for ps in (16, 64, 128):
            kc, vc, bt = _paged_cache(k, v, lens, cu, ps, g)
            out = torch.full_like(q, float("nan"))
            m.attention_paged_fwd(q, kc, vc, bt, cu, sk, max(lens), sc, 0, out=out, decode_merge=0, prefill_kernel=2)
            checks[f"{name}_paged{ps}"] = bool(torch.equal(out, ref))
            checks[f"{name}_paged{ps}_vs_f64"] = (out.double() - f64).abs().max().item()
    return checks


def time_prefill(mods, ref_name, L, batch=1, page_size=0, triton=False):
    """Causal prefill of `batch` sequences of L tokens: contiguous varlen (page_size 0) or over a paged
    cache of that page size (the engine's prompt prefill); TFLOP/s of SDPA, each variant and Triton."""
    from bench_cuda import _median_ms
    g = torch.Generator().manual_seed(L * 7 + batch)
    T = batch * L
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    sc = D ** -0.5
    tflop = 2.0 * L * L * D * HQ * batch / 1e9  # causal; TFLOP/s = tflop / ms
    ref = mods[ref_name].attention_varlen_fwd(q, k, v, cu, L, sc, 0, out=None, prefill_kernel=1)
    qs, ks, vs = (t.view(batch, L, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
    row = {"L": L, "batch": batch, "heads": f"{HQ}/{HKV}", "page_size": page_size, "sdpa": round(tflop / _median_ms(sdpa), 1)}
    if page_size:
        kc, vc, bt = _paged_cache(k, v, [L] * batch, cu.cpu(), page_size, g)
        sk = torch.full((batch,), L, dtype=torch.int32, device="cuda")
        call = lambda m: m.attention_paged_fwd(q, kc, vc, bt, cu, sk, L, sc, 0, out=None, decode_merge=0,  # noqa: E731
                                               prefill_kernel=2)
    else:
        call = lambda m: m.attention_varlen_fwd(q, k, v, cu, L, sc, 0, out=None, prefill_kernel=2)  # noqa: E731
    if triton:
        from areal_tik.kernels.attention import attention_paged_triton, attention_varlen_triton
        tf = ((lambda: attention_paged_triton(q, kc, vc, bt, cu, sk, L, sc)) if page_size  # noqa: E731
              else (lambda: attention_varlen_triton(q, k, v, cu, L, sc)))
        row["triton"] = round(tflop / _median_ms(tf), 1)
    for _ in range(2):
        for name, m in mods.items():
            fn = lambda: call(m)  # noqa: E731
            row[name + "_eq"] = bool(torch.equal(fn(), ref))
            row.setdefault(name, []).append(round(tflop / _median_ms(fn), 1))
    return row


def _decode_calls(mods, cpcs, stages=(0,)):
    """(label, module, extra kwargs) per variant and (chunks per CTA, ring stages) the build accepts."""
    calls = []
    for name, m in mods.items():
        doc = m.attention_paged_fwd.__doc__ or ""
        for c in (cpcs if "decode_cpc" in doc else [None]):
            for st in (stages if "decode_stages" in doc else [None]):
                kw, label = {}, name
                if c is not None:
                    kw["decode_cpc"] = c
                    label += f"_cpc{c}"
                if st is not None and st != 0:
                    kw["decode_stages"] = st
                    label += f"_st{st}"
                calls.append((label, m, kw))
    return calls


def _decode_inputs(lens, ps, g, poison=True, shuffle=True):
    """Ragged decode inputs over a paged cache; pages in random order (shuffle) or in sequence order."""
    B = len(lens)
    npg = [-(-L // ps) for L in lens]
    num = sum(npg) + 3
    kc = torch.randn(num, ps, HKV, D, generator=g).bfloat16().cuda()
    vc = torch.randn(num, ps, HKV, D, generator=g).bfloat16().cuda()
    perm = torch.randperm(num, generator=g).tolist() if shuffle else list(range(num))
    bt = torch.full((B, max(npg) + 2), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(npg):
        bt[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    if poison:  # slots past each sequence's length, in its last page and the spare pages
        for i, L in enumerate(lens):
            last = int(bt[i, npg[i] - 1])
            kc[last, L - (npg[i] - 1) * ps:] = float("nan")
            vc[last, L - (npg[i] - 1) * ps:] = float("nan")
        for pg in perm[at:]:
            kc[pg] = float("nan")
            vc[pg] = float("nan")
    q = torch.randn(B, HQ, D, generator=g).bfloat16().cuda()
    cq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    sk = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, kc, vc, bt.cuda(), cq, sk


def check_decode_bits(mods, ref_name, cpcs, stages=(0,)):
    g = torch.Generator().manual_seed(2)
    sc = D ** -0.5
    checks = {}
    lens = [1, 63, 64, 65, 255, 256, 257, 511, 1000, 1024, 1025, 4100, 8192, 3]
    for ps in (16, 64):
        q, kc, vc, bt, cq, sk = _decode_inputs(lens, ps, g)
        ref = mods[ref_name].attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, sc, 0, out=None, decode_merge=0)
        assert not torch.isnan(ref).any(), "reference decode output has NaN"
        for label, m, kw in _decode_calls(mods, cpcs, stages):
            for merge in (0, 1):
                out = torch.full_like(q, float("nan"))
                m.attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, sc, 0, out=out, decode_merge=merge, **kw)
                checks[f"{label}_ps{ps}_{'fused' if merge == 0 else '2launch'}"] = bool(torch.equal(out, ref))
    return checks


def _triton_paged():
    from areal_tik.kernels.attention import attention_paged_triton
    return attention_paged_triton


def time_decode(mods, ref_name, cpcs, B, ctx, stages=(0,), page_size=64, table_pages=None, triton=False,
                shuffle=True):
    """One decode cell: B sequences of ctx positions, pages of page_size, block tables table_pages wide
    (default: just wide enough, + 2); CUDA-graph times of SDPA (contiguous gather), each call and Triton."""
    from bench_cuda import _graphed, _median_ms, sdpa_layout
    g = torch.Generator().manual_seed(B * 100003 + ctx)
    q, kc, vc, bt, cq, sk = _decode_inputs([ctx] * B, page_size, g, poison=False, shuffle=shuffle)
    if table_pages is not None and table_pages > bt.shape[1]:  # engine-shaped: the table sized for max_model_len
        bt = torch.cat([bt, torch.full((B, table_pages - bt.shape[1]), -1, dtype=torch.int32, device="cuda")], 1)
    sc = D ** -0.5
    qq, kk, vv = sdpa_layout(q, kc, vc, bt, ctx)
    F = torch.nn.functional
    fn, _ = _graphed(lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True))
    row = {"batch": B, "ctx": ctx, "heads": f"{HQ}/{HKV}", "page_size": page_size, "table_pages": bt.shape[1],
           "pages": "shuffled" if shuffle else "in order",
           "sdpa_us": round(_median_ms(fn) * 1e3, 2)}
    ref = mods[ref_name].attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, sc, 0, out=None, decode_merge=0)
    del kk, vv
    if triton:
        tp = _triton_paged()
        fn, _ = _graphed(lambda: tp(q, kc, vc, bt, cq, sk, 1, sc))
        row["triton_us"] = round(_median_ms(fn) * 1e3, 2)
    for _ in range(2):
        for label, m, kw in _decode_calls(mods, cpcs, stages):
            call = lambda: m.attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, sc, 0, out=None, decode_merge=0, **kw)  # noqa: E731
            row[label + "_eq"] = bool(torch.equal(call(), ref))
            fn, how = _graphed(call)
            row.setdefault(label, []).append(round(_median_ms(fn) * 1e3, 2))
    return row


def _write(res: list, out: str, name: str) -> int:
    """res = [bit checks, timing rows...] -> OUT/name; 0 if every check and every row's *_eq holds, else 1."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(res, f, indent=1)
    ok = all(v for v in res[0].values() if isinstance(v, bool)) and all(r[k] for r in res[1:] for k in r if k.endswith("_eq"))
    return 0 if ok else 1


def main(argv=None):
    global HQ, HKV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="directory holding one csrc copy per variant")
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--ref", help="variant whose mma.sync kernel gives the reference bits (default: the first)")
    ap.add_argument("--lens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decode", action="store_true", help="bisect the decode kernel instead of the prefill")
    ap.add_argument("--cpc", type=int, nargs="+", default=[0], help="decode_cpc values for builds that take it")
    ap.add_argument("--stages", type=int, nargs="+", default=[0],
                    help="decode_stages values (0 = auto, 2..4) for builds that take it")
    ap.add_argument("--cells", default="1x128,1x1024,1x4096,4x1024,4x8192,8x4096,16x1024,16x8192,64x1024,128x512",
                    help="decode cells BATCHxCONTEXT, comma-separated")
    ap.add_argument("--heads", default=f"{HQ}/{HKV}", help="query/KV heads, e.g. 12/2 (Qwen2.5-1.5B)")
    ap.add_argument("--page-size", type=int, default=64, help="decode timing: KV page size")
    ap.add_argument("--table-pages", type=int, default=None,
                    help="decode timing: block-table width in pages (engine: max_model_len / page size)")
    ap.add_argument("--triton", action="store_true", help="time the Triton kernel beside the variants")
    ap.add_argument("--pages-in-order", action="store_true",
                    help="decode timing: each sequence's pages consecutive in the cache (default: shuffled)")
    ap.add_argument("--prefill-paged", type=int, default=0, metavar="PAGE_SIZE",
                    help="prefill timing over a paged cache of this page size (0: contiguous varlen)")
    ap.add_argument("--prefill-batch", type=int, default=1, help="prefill timing: sequences of each --lens length")
    args = ap.parse_args(argv)
    HQ, HKV = (int(x) for x in args.heads.split("/"))
    ref_name = args.ref or args.variants[0]
    if ref_name not in args.variants:
        ap.error(f"--ref {ref_name} is not among --variants")
    jobs = [(os.path.abspath(args.dir), v) for v in args.variants]
    with mp.get_context("spawn").Pool(len(jobs)) as pool:  # builds in parallel; the loads below hit the cache
        print("build seconds:", pool.map(_build_seconds, jobs), flush=True)
    mods = {name: mod for name, _, mod in map(_load, jobs)}
    if args.decode:
        res = [check_decode_bits(mods, ref_name, args.cpc, args.stages)]
        print(res[0], flush=True)
        for cell in args.cells.split(","):
            B, ctx = (int(x) for x in cell.split("x"))
            res.append(time_decode(mods, ref_name, args.cpc, B, ctx, args.stages, args.page_size, args.table_pages,
                                   args.triton, shuffle=not args.pages_in_order))
            print(res[-1], flush=True)
        return _write(res, args.out, "bisect_decode.json")
    res = [check_bits(mods, ref_name)]
    print(res[0], flush=True)
    for L in args.lens:
        res.append(time_prefill(mods, ref_name, L, args.prefill_batch, args.prefill_paged, args.triton))
        print(res[-1], flush=True)
    return _write(res, args.out, "bisect.json")


if __name__ == "__main__":
    sys.exit(main())
