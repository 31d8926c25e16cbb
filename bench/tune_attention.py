"""Tune the unified attention's meta-parameters on one GPU, checking the contract for each.

    python bench/tune_attention.py --out DIR [--budget-s 190]

For each global (bit-defining) candidate ``(BLOCK_N, KV_PARTITION)`` it
  1. checks the contract at real shapes (32q/8kv heads, d=128, page 16, lengths around
     the block/partition boundaries): R1 varlen == R2 paged prefill == R3 chunked prefill
     == R4 decode of every position, bit for bit (torch.equal), and R1 against the float64
     reference (relative Frobenius error < 1e-2);
  2. times prefill launch variants (BLOCK_M, warps, stages, FLAT loop) at 1K/4K/8K/16K and
     decode variants (warps, stages, HSPLIT) at a set of (batch, context) cells, each
     variant first checked to give the same bits as the candidate's reference run;
then times backward tile sets at 4K (accuracy-checked against float64 at a small shape).
Baseline: the best PyTorch SDPA backend (flash / cuDNN) per cell, as bench_attention.py.

Writes DIR/tune_attention.json (every number) and DIR/attention_tuned.json: the best
valid choice as ``{"sm90": {...}}``, ready to commit as
areal_tik/kernels/attention_tuned.json (applied at import on that GPU arch and
fingerprinted through attention.META). Prints a short table last. Stops exploring when
the time budget is spent (the results so far are still written).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HQ, HKV, D = 32, 8, 128
COPY_TBPS = 4.1
GLOBALS = [(64, 256), (128, 256), (128, 512), (64, 512), (128, 1024)]
FWD_VARIANTS = {
    64: [dict(BLOCK_M=128, num_warps=8, num_stages=3, FLAT=1), dict(BLOCK_M=128, num_warps=8, num_stages=3, FLAT=0),
         dict(BLOCK_M=128, num_warps=8, num_stages=2, FLAT=1), dict(BLOCK_M=64, num_warps=4, num_stages=3, FLAT=1)],
    128: [dict(BLOCK_M=128, num_warps=8, num_stages=2, FLAT=1), dict(BLOCK_M=128, num_warps=8, num_stages=2, FLAT=0),
          dict(BLOCK_M=128, num_warps=8, num_stages=3, FLAT=1), dict(BLOCK_M=64, num_warps=4, num_stages=2, FLAT=1)],
}
DEC_VARIANTS = {
    64: [dict(num_warps=4, num_stages=3, HSPLIT=1), dict(num_warps=4, num_stages=2, HSPLIT=1),
         dict(num_warps=4, num_stages=3, HSPLIT=2), dict(num_warps=8, num_stages=3, HSPLIT=1)],
    128: [dict(num_warps=4, num_stages=2, HSPLIT=1), dict(num_warps=8, num_stages=2, HSPLIT=1),
          dict(num_warps=4, num_stages=2, HSPLIT=2), dict(num_warps=4, num_stages=3, HSPLIT=1)],
}
BWD_VARIANTS = [
    dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3),
    dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=2),
    dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=3),
    dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, num_warps=4, num_stages=2),
]
PREFILL_L = [1024, 4096, 8192, 16384]
DEC_CELLS = [(1, 128), (1, 1024), (1, 8192), (4, 4096), (8, 8192), (16, 1024), (16, 8192)]
PAGE = 16


def _bench(fn, graph=False):
    """Median ms (bench/harness.py): do_bench_cudagraph for decode cells, else do_bench."""
    from harness import time_ms
    if graph:
        return time_ms(fn, "cudagraph", rep_ms=20).p50
    return time_ms(fn, "do_bench", warmup_ms=5, rep_ms=25).p50


def geomean(xs):
    xs = [x for x in xs if x and x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# ---- SDPA baselines ----------------------------------------------------------------------

def sdpa_best(q, k, v, causal, graph=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best = None
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            def fn(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            fn()
            ms = _bench(fn, graph)
            best = ms if best is None else min(best, ms)
        except Exception:
            pass
    return best


# ---- inputs ------------------------------------------------------------------------------

def paged_cache(lens, k_list, v_list, page, gen):
    """Random page order; unused slots NaN. Returns (kc, vc, block_table[B, w])."""
    npg = [math.ceil(L / page) for L in lens]
    total = sum(npg) + 2
    order = torch.randperm(total, generator=gen).tolist()
    kc = torch.full((total, page, HKV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    bt = torch.zeros(len(lens), max(npg) + 1, dtype=torch.int32)
    it = iter(order)
    for i, n in enumerate(npg):
        for j in range(n):
            bt[i, j] = next(it)
    bt = bt.cuda()
    for i, L in enumerate(lens):
        pos = torch.arange(L, device="cuda")
        slots = bt[i].long()[pos // page] * page + pos % page
        kc.view(-1, HKV, D)[slots] = k_list[i]
        vc.view(-1, HKV, D)[slots] = v_list[i]
    return kc, vc, bt


def contract_inputs(bn, part, seed):
    rng = random.Random(seed)
    lens = sorted({1, bn - 1, part + 1, 2 * part + bn - 1, rng.randint(part, 3 * part), 1500})
    gen = torch.Generator().manual_seed(seed)
    seqs = [tuple(torch.randn(L, h, D, generator=gen).bfloat16().cuda() for h in (HQ, HKV, HKV)) for L in lens]
    kc, vc, bt = paged_cache(lens, [s[1] for s in seqs], [s[2] for s in seqs], PAGE, gen)
    return lens, seqs, kc, vc, bt


def run_r1(A, lens, seqs):
    order = list(range(len(lens)))[::-1]
    cu = torch.tensor([0] + torch.tensor([lens[i] for i in order]).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.cat([seqs[i][j] for i in order]) for j in range(3))
    out = A.attention_varlen_triton(q, k, v, cu, max(lens))
    res = [None] * len(lens)
    for j, i in enumerate(order):
        res[i] = out[int(cu[j]):int(cu[j + 1])]
    return res


def run_r2(A, lens, seqs, kc, vc, bt):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = A.attention_paged_triton(torch.cat([s[0] for s in seqs]), kc, vc, bt, cu,
                                   torch.tensor(lens, dtype=torch.int32, device="cuda"), max(lens))
    return [out[int(cu[i]):int(cu[i + 1])] for i in range(len(lens))]


def run_r3(A, lens, seqs, kc, vc, bt):
    """Each sequence's second part (from a non-aligned cut) against its cached prefix."""
    cuts = [L // 2 + 3 if L > 8 else 0 for L in lens]
    nq = [L - c for L, c in zip(lens, cuts)]
    cu = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.cat([s[0][c:] for s, c in zip(seqs, cuts)])
    out = A.attention_paged_triton(q, kc, vc, bt, cu, torch.tensor(lens, dtype=torch.int32, device="cuda"), max(nq))
    return [out[int(cu[i]):int(cu[i + 1])] for i in range(len(lens))], cuts


def run_r4(A, lens, seqs, kc, vc, bt):
    entries = [(i, p) for i in range(len(lens)) for p in range(lens[i])]
    random.Random(1).shuffle(entries)
    q = torch.stack([seqs[i][0][p] for i, p in entries])
    btm = bt[torch.tensor([i for i, _ in entries], device="cuda")]
    sk = torch.tensor([p + 1 for _, p in entries], dtype=torch.int32, device="cuda")
    out = A.attention_paged_triton(q, kc, vc, btm, torch.arange(len(entries) + 1, dtype=torch.int32, device="cuda"),
                                   sk, 1)
    res = [torch.empty_like(s[0]) for s in seqs]
    idx = [[] for _ in lens]
    for j, (i, p) in enumerate(entries):
        idx[i].append((p, j))
    for i in range(len(lens)):
        ps, js = zip(*idx[i])
        res[i][torch.tensor(ps, device="cuda")] = out[torch.tensor(js, device="cuda")]
    return res


def bits_equal(a_list, b_list, offsets=None):
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        if offsets is not None:
            a = a[offsets[i]:]
        if not torch.equal(a, b):
            return False
    return True


def contract_check(A, bn, part, seed=0):
    lens, seqs, kc, vc, bt = contract_inputs(bn, part, seed)
    r1 = run_r1(A, lens, seqs)
    r2 = run_r2(A, lens, seqs, kc, vc, bt)
    r3, cuts = run_r3(A, lens, seqs, kc, vc, bt)
    r4 = run_r4(A, lens, seqs, kc, vc, bt)
    errs = []
    for i, (q, k, v) in enumerate(seqs):
        cu = torch.tensor([0, lens[i]], dtype=torch.int32, device="cuda")
        ref = A.attention_reference(q, k, v, cu)
        errs.append(float((r1[i].double() - ref).norm() / ref.norm()))
    res = dict(lens=lens, r1_eq_r2=bits_equal(r1, r2), r1_eq_r3=bits_equal(r1, r3, cuts), r1_eq_r4=bits_equal(r1, r4),
               max_rel_err_f64=max(errs))
    res["valid"] = bool(res["r1_eq_r2"] and res["r1_eq_r3"] and res["r1_eq_r4"] and res["max_rel_err_f64"] < 1e-2
                        and all(bool(torch.isfinite(x).all()) for x in r1))
    return res, (lens, seqs, kc, vc, bt, r1)


# ---- timing ------------------------------------------------------------------------------

_PREFILL_IN = {}
_DEC_IN = {}


def prefill_inputs(L):
    if L not in _PREFILL_IN:
        g = torch.Generator(device="cuda").manual_seed(L)
        q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        _PREFILL_IN[L] = (q, k, v, torch.tensor([0, L], dtype=torch.int32, device="cuda"))
    return _PREFILL_IN[L]


def decode_inputs(B, ctx):
    if (B, ctx) not in _DEC_IN:
        npg = math.ceil(ctx / PAGE)
        kc = torch.randn(B * npg, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(B * npg, device="cuda").int().view(B, npg)
        q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        cuq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        sk = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        _DEC_IN[(B, ctx)] = (q, kc, vc, bt, cuq, sk)
    return _DEC_IN[(B, ctx)]


def time_prefill(A, L):
    q, k, v, cu = prefill_inputs(L)
    return _bench(lambda: A.attention_varlen_triton(q, k, v, cu, L))


def time_decode(A, B, ctx):
    q, kc, vc, bt, cuq, sk = decode_inputs(B, ctx)
    fn = lambda: A.attention_paged_triton(q, kc, vc, bt, cuq, sk, 1)  # noqa: E731
    fn()
    return _bench(fn, graph=True)


def sdpa_baselines():
    base = {"prefill": {}, "decode": {}}
    for L in PREFILL_L:
        q, k, v, _ = prefill_inputs(L)
        base["prefill"][L] = sdpa_best(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), True)
    for B, ctx in DEC_CELLS:
        q, kc, vc, bt, _, _ = decode_inputs(B, ctx)
        slots = (bt.long()[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).view(B, -1)[:, :ctx]
        kk = kc.view(-1, HKV, D)[slots].permute(0, 2, 1, 3).contiguous()
        vv = vc.view(-1, HKV, D)[slots].permute(0, 2, 1, 3).contiguous()
        base["decode"][f"{B}x{ctx}"] = sdpa_best(q.unsqueeze(2), kk, vv, False, graph=True)
    return base


# ---- backward ----------------------------------------------------------------------------

def tune_backward(A, out_rows, deadline):
    L = 4096
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    g = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    # SDPA baseline (K/V repeated: GQA backward support varies by backend)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sd = None
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            qs = q.detach().transpose(0, 1).unsqueeze(0).requires_grad_()
            ks = k.detach().transpose(0, 1).unsqueeze(0).repeat_interleave(HQ // HKV, 1).requires_grad_()
            vs = v.detach().transpose(0, 1).unsqueeze(0).repeat_interleave(HQ // HKV, 1).requires_grad_()
            with sdpa_kernel([be]):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            gs = g.transpose(0, 1).unsqueeze(0)
            ms = _bench(lambda: o.backward(gs, retain_graph=True))
            sd = ms if sd is None else min(sd, ms)
        except Exception:
            pass
    # accuracy shape
    lens = [300, 1, 129]
    gq = torch.Generator(device="cuda").manual_seed(8)
    sq, sk_, sv = (torch.randn(sum(lens), h, D, device="cuda", dtype=torch.bfloat16, generator=gq)
                   for h in (HQ, HKV, HKV))
    sg = torch.randn(sum(lens), HQ, D, device="cuda", dtype=torch.bfloat16, generator=gq)
    scu = torch.tensor([0, 300, 301, 430], dtype=torch.int32, device="cuda")
    qd, kd, vd = (t.double().requires_grad_() for t in (sq, sk_, sv))
    A.attention_reference(qd, kd, vd, scu).backward(sg.double())
    best = None
    for var in BWD_VARIANTS:
        if time.time() > deadline:
            break
        row = dict(bwd=var)
        try:
            A.configure({**A.current_config(), "bwd": {"128": var}})
            qq, kk, vv = (t.clone().requires_grad_() for t in (sq, sk_, sv))
            A.attention_varlen_triton(qq, kk, vv, scu, 300).backward(sg)
            errs = {n: float((a.grad.double() - b.grad).norm() / b.grad.norm())
                    for n, a, b in (("dq", qq, qd), ("dk", kk, kd), ("dv", vv, vd))}
            row["rel_err"] = errs
            row["valid"] = all(e < 2e-2 for e in errs.values())
            q.grad = k.grad = v.grad = None
            out = A.attention_varlen_triton(q, k, v, cu, L)
            row["ms"] = _bench(lambda: out.backward(g, retain_graph=True))
            row["sdpa_ms"] = sd
            row["speedup"] = sd / row["ms"] if sd else None
            if row["valid"] and (best is None or row["ms"] < best["ms"]):
                best = row
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["valid"] = False
        out_rows.append(row)
    return best


# ---- main --------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=190.0)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if not torch.cuda.is_available():
        print("tune_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    deadline = t0 + a.budget_s
    from areal_tik.kernels import attention as A
    start_cfg = A.current_config()
    A.configure(None)   # search from the defaults, not from the committed table (restored at the end)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm{major}{minor}"
    torch.manual_seed(0)
    base = sdpa_baselines()
    results = []
    for bn, part in GLOBALS:
        if time.time() > deadline:
            results.append(dict(BLOCK_N=bn, KV_PARTITION=part, skipped="time budget"))
            continue
        entry = dict(BLOCK_N=bn, KV_PARTITION=part, fwd=[], decode=[])
        results.append(entry)
        fv, dv = FWD_VARIANTS[bn], DEC_VARIANTS[bn]
        try:
            A.configure(dict(BLOCK_N=bn, KV_PARTITION=part, fwd={"128": fv[0]}, decode=dv[0]))
            chk, (lens, seqs, kc, vc, bt, r1_ref) = contract_check(A, bn, part)
            entry["contract"] = chk
            if not chk["valid"]:
                continue
            for var in fv:
                if time.time() > deadline:
                    break
                row = dict(fwd=var)
                try:
                    A.configure(dict(BLOCK_N=bn, KV_PARTITION=part, fwd={"128": var}, decode=dv[0]))
                    row["same_bits"] = bits_equal(run_r1(A, lens, seqs), r1_ref) and \
                        bits_equal(run_r2(A, lens, seqs, kc, vc, bt), r1_ref)
                    row["ms"] = {L: time_prefill(A, L) for L in PREFILL_L}
                    row["speedup"] = {L: base["prefill"][L] / row["ms"][L] for L in PREFILL_L if base["prefill"][L]}
                    row["geomean"] = geomean(list(row["speedup"].values()))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                entry["fwd"].append(row)
            for var in dv:
                if time.time() > deadline:
                    break
                row = dict(decode=var)
                try:
                    A.configure(dict(BLOCK_N=bn, KV_PARTITION=part, fwd={"128": fv[0]}, decode=var))
                    row["same_bits"] = bits_equal(run_r4(A, lens, seqs, kc, vc, bt), r1_ref)
                    row["ms"] = {f"{B}x{c}": time_decode(A, B, c) for B, c in DEC_CELLS}
                    row["speedup"] = {k: base["decode"][k] / v for k, v in row["ms"].items() if base["decode"][k]}
                    row["pct_copy"] = {f"{B}x{c}": 100 * (4.0 * B * c * HKV * D) / (row["ms"][f"{B}x{c}"] * 1e-3)
                                       / (COPY_TBPS * 1e12) for B, c in DEC_CELLS}
                    row["geomean"] = geomean(list(row["speedup"].values()))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                entry["decode"].append(row)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            continue
        ok_f = [r for r in entry["fwd"] if r.get("same_bits") and r.get("geomean")]
        ok_d = [r for r in entry["decode"] if r.get("same_bits") and r.get("geomean")]
        if ok_f and ok_d:
            bf = max(ok_f, key=lambda r: r["geomean"])
            bd = max(ok_d, key=lambda r: r["geomean"])
            entry["best_fwd"], entry["best_decode"] = bf["fwd"], bd["decode"]
            entry["prefill_geomean"], entry["decode_geomean"] = bf["geomean"], bd["geomean"]
            entry["score"] = math.sqrt(bf["geomean"] * bd["geomean"])
        torch.cuda.empty_cache()
    scored = [r for r in results if r.get("score")]
    best = max(scored, key=lambda r: r["score"]) if scored else None
    bwd_rows = []
    best_bwd = None
    if best is not None:
        A.configure(dict(BLOCK_N=best["BLOCK_N"], KV_PARTITION=best["KV_PARTITION"], fwd={"128": best["best_fwd"]},
                         decode=best["best_decode"]))
        try:
            best_bwd = tune_backward(A, bwd_rows, deadline + 40)
        except Exception as e:
            bwd_rows.append(dict(error=f"{type(e).__name__}: {str(e)[:300]}"))
    A.configure(start_cfg)
    import triton
    info = dict(gpu=torch.cuda.get_device_name(), arch=arch, torch=torch.__version__, triton=triton.__version__,
                shape=dict(HQ=HQ, HKV=HKV, D=D, page=PAGE), seconds=round(time.time() - t0, 1))
    tuned = None
    if best is not None:
        tuned = {arch: dict(BLOCK_N=best["BLOCK_N"], KV_PARTITION=best["KV_PARTITION"],
                            fwd={"128": best["best_fwd"]}, decode=best["best_decode"],
                            **({"bwd": {"128": best_bwd["bwd"]}} if best_bwd else {}),
                            _source=f"bench/tune_attention.py on {info['gpu']}, triton {info['triton']}, "
                                    f"torch {info['torch']}")}
        with open(os.path.join(a.out, "attention_tuned.json"), "w") as f:
            json.dump(tuned, f, indent=1)
    with open(os.path.join(a.out, "tune_attention.json"), "w") as f:
        json.dump(dict(info=info, sdpa=base, results=results, backward=bwd_rows, best=tuned), f, indent=1, default=str)
    # ---- short table
    print(f"{'BN':>4s} {'PART':>5s} {'valid':>5s} {'prefill':>8s} {'decode':>8s}  best fwd / best decode")
    for r in results:
        c = r.get("contract", {})
        print(f"{r['BLOCK_N']:4d} {r['KV_PARTITION']:5d} {str(c.get('valid', r.get('skipped') or r.get('error', '?')))[:5]:>5s} "
              f"{(r.get('prefill_geomean') or 0):8.3f} {(r.get('decode_geomean') or 0):8.3f}  "
              f"{r.get('best_fwd')} / {r.get('best_decode')}")
    if best is not None:
        bf = next(x for x in best["fwd"] if x["fwd"] == best["best_fwd"])
        bd = next(x for x in best["decode"] if x["decode"] == best["best_decode"])
        print("best prefill cells (speedup vs SDPA):", {k: round(v, 2) for k, v in bf["speedup"].items()})
        print("best decode cells (speedup vs SDPA):", {k: round(v, 2) for k, v in bd["speedup"].items()})
        print("best decode % copy:", {k: round(v) for k, v in bd["pct_copy"].items()})
    for r in bwd_rows:
        print("bwd", r.get("bwd"), "ms", r.get("ms"), "speedup", r.get("speedup"), "valid", r.get("valid"),
              r.get("error", ""))
    print("tuned:", json.dumps(tuned))
    print(f"tune_attention: {info['seconds']} s; copy DIR/attention_tuned.json to areal_tik/kernels/attention_tuned.json")
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
