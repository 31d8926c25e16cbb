"""The attention pair under two contracts, at the shapes an RL run at the 1.5B shape (12 q / 2 kv heads, d 128,
pages of 64) spends its attention time on, and what each would cost over a whole run.

    python bench/probes/probe_attention_pair.py --out $OUT     # H100/H200 with vLLM 0.24 importable

- ``split``: ours, the default selection on sm_90 (csrc ``attention_paged`` / ``attention_varlen``): K/V cut into
  partitions of 256 positions at fixed offsets, merged in a fixed order; decode runs the partitions in parallel.
- ``walk``: FlashAttention-3 as vLLM 0.24 bundles it, ``num_splits=1``: one sequential walk over the keys per
  query tile. vLLM's batch-invariant mode relies on this setting; ``walk_auto`` (``num_splits=0``, FA3's own
  split heuristic, not batch-invariant) is timed beside it for reference.

Measured, all CUDA-graph replays (``harness.time_ms(..., "cudagraph")``):
1. decode (one query per sequence over the paged cache) at batch x context cells;
2. the packed causal forward (prefill, recompute and training forward) at sequences x length cells;
3. whether ``walk`` keeps one row's bits across the three ways a row is computed (the prefill of the whole
   sequence, one decode query over the paged cache, a chunk over a cached prefix), and the same for ``split``
   (its contract: it must);
4. ``whole_run``: the attention seconds of two RL workloads under each contract, from the cells above: the long
   rollout (64 sequences, 1,024 -> 4,096 tokens: decode at every context, trapezoid over the measured contexts)
   and its training forward (64 x 5,120 tokens); the backward is the same flash-attention-2 kernel under both
   contracts, so it is left out.

Writes ``attention_pair.json``; prints the cells and the whole-run table. Without FA3 (no vLLM, not sm_90) the
``walk`` columns say why and only ``split`` is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

HQ, HKV, D, PAGE, LAYERS = 12, 2, 128, 64, 28
DECODE_CELLS = [(1, 1024), (1, 4096), (8, 4096), (64, 1024), (64, 2048), (64, 3072), (64, 4096), (64, 5120),
                (128, 1024), (256, 512)]
FORWARD_CELLS = [(64, 512), (16, 1024), (4, 4096), (64, 5120)]
LONG_ROLLOUT = dict(batch=64, prompt=1024, new=4096)


def whole_run(decode_ms: dict, forward_ms: dict, layers: int = LAYERS, rollout: dict = LONG_ROLLOUT) -> dict:
    """Attention seconds of the long rollout's decode and of its training forward, from per-layer cell times.

    ``decode_ms[(B, ctx)]`` and ``forward_ms[(n, L)]``: ms of one layer's attention call. The decode integral runs
    the trapezoid rule over the measured contexts of batch ``rollout['batch']`` between the prompt and prompt + new
    tokens (one step per generated token); the forward is the ``(batch, prompt + new)`` cell. Missing cells give
    None."""
    B, p, n = rollout["batch"], rollout["prompt"], rollout["new"]
    pts = sorted((c, ms) for (b, c), ms in decode_ms.items() if b == B and p <= c <= p + n and ms is not None)
    dec = None
    if len(pts) >= 2 and pts[0][0] == p and pts[-1][0] == p + n:
        area = sum((c1 - c0) * (m0 + m1) / 2 for (c0, m0), (c1, m1) in zip(pts, pts[1:]))  # ms x positions
        dec = area * layers / 1e3                                   # one step per position: seconds
    fwd = forward_ms.get((B, p + n))
    return dict(decode_s=dec, forward_s=None if fwd is None else fwd * layers / 1e3,
                steps=n, layers=layers, batch=B, contexts=[c for c, _ in pts])


def _fa3():
    """vLLM's bundled FA3 ``flash_attn_varlen_func``, or the reason it is unavailable."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fi
    except Exception as e:  # noqa: BLE001
        return None, f"vllm.vllm_flash_attn not importable: {type(e).__name__}: {e}"
    if not fi.is_fa_version_supported(3):
        return None, f"FA3 unsupported here: {fi.fa_version_unsupported_reason(3)}"
    return fi.flash_attn_varlen_func, None


def _walk_paged(fa, splits):
    def f(q, kc, vc, bt, cq, sk, max_q, max_k):
        return fa(q, kc, vc, max_seqlen_q=max_q, cu_seqlens_q=cq, max_seqlen_k=max_k, seqused_k=sk,
                  block_table=bt, causal=True, num_splits=splits, fa_version=3)
    return f


def _walk_varlen(fa, splits):
    def f(q, k, v, cu, max_len):
        return fa(q, k, v, max_seqlen_q=max_len, cu_seqlens_q=cu, max_seqlen_k=max_len, cu_seqlens_k=cu,
                  causal=True, num_splits=splits, fa_version=3)
    return f


def _time(fn) -> float:
    from harness import time_ms
    return time_ms(fn, "cudagraph", rep_ms=30).p50


def _timed(row: dict, name: str, op, args: tuple) -> None:
    """``row[name]``: ms of ``op(*args)``; None and ``row[name + "_error"]`` when it raises (one arm's failure is a
    finding, not the end of the probe)."""
    try:
        op(*args)
        row[name] = _time(lambda: op(*args))
    except Exception as e:  # noqa: BLE001
        row[name], row[f"{name}_error"] = None, f"{type(e).__name__}: {e}"[:300]


def _decode_cells(impls, rows):
    import torch
    from bench_cuda import decode_case
    for B, ctx in DECODE_CELLS:
        q, kc, vc, bt, cq, sk = decode_case(B, ctx, hq=HQ, hkv=HKV, page=PAGE)
        row = dict(kind="decode", B=B, ctx=ctx, kv_bytes=2 * B * ctx * HKV * D * 2)
        for name, (paged, _) in impls.items():
            _timed(row, name, paged, (q, kc, vc, bt, cq, sk, 1, ctx))
        rows.append(row)
        torch.cuda.empty_cache()


def _forward_cells(impls, rows):
    import torch
    for n, L in FORWARD_CELLS:
        T = n * L
        q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
        row = dict(kind="forward", n=n, L=L, tflop=2.0 * HQ * D * L * L * n / 1e12)
        for name, (_, varlen) in impls.items():
            _timed(row, name, varlen, (q, k, v, cu, L))
        rows.append(row)
        torch.cuda.empty_cache()


def _row_bits(impls, L=1000, chunk_at=700, seed=0) -> dict:
    """One sequence of L tokens: the last query's output row from the prefill of the whole sequence, from one
    decode query over the paged cache, and from a chunk (queries chunk_at..L-1) over the cached prefix, compared
    with torch.equal, per contract."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    npg = -(-L // PAGE)
    order = torch.randperm(npg, device="cuda", generator=g)
    kc = torch.zeros(npg, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(L, device="cuda")
    kc.view(-1, HKV, D)[order[pos // PAGE] * PAGE + pos % PAGE] = k
    vc.view(-1, HKV, D)[order[pos // PAGE] * PAGE + pos % PAGE] = v
    bt = order.to(torch.int32).view(1, -1)
    sk = torch.tensor([L], dtype=torch.int32, device="cuda")
    out = {}
    for name, (paged, varlen) in impls.items():
        try:
            full = varlen(q, k, v, torch.tensor([0, L], dtype=torch.int32, device="cuda"), L)[-1]
            dec = paged(q[-1:], kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32, device="cuda"), sk, 1, L)[-1]
            nq = L - chunk_at
            chk = paged(q[chunk_at:], kc, vc, bt, torch.tensor([0, nq], dtype=torch.int32, device="cuda"), sk, nq,
                        L)[-1]
            out[name] = dict(prefill_eq_decode=bool(torch.equal(full, dec)),
                             prefill_eq_chunk=bool(torch.equal(full, chk)),
                             max_abs_diff=float(max((full.float() - dec.float()).abs().max(),
                                                    (full.float() - chk.float()).abs().max())))
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("probe_attention_pair: needs a CUDA GPU", file=sys.stderr)
        return 2
    from areal_tik.kernels.cuda import attention as cuda_attention
    from areal_tik.kernels.cuda import loader as cuda_ext
    ok, why = cuda_ext.status()
    if not ok:
        print(f"probe_attention_pair: the csrc extension is unavailable: {why}", file=sys.stderr)
        return 2
    impls = {"split": (lambda q, kc, vc, bt, cq, sk, mq, mk: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq,
                                                                                                 sk, mq),
                       lambda q, k, v, cu, L: cuda_attention.attention_varlen_cuda(q, k, v, cu, L))}
    fa, fa_why = _fa3()
    if fa is not None:
        impls["walk"] = (_walk_paged(fa, 1), _walk_varlen(fa, 1))
        impls["walk_auto"] = (_walk_paged(fa, 0), _walk_varlen(fa, 0))
    t0 = time.time()
    rows: list[dict] = []
    bits = _row_bits(impls)
    _decode_cells(impls, rows)
    _forward_cells(impls, rows)
    dec = {n: {(r["B"], r["ctx"]): r.get(n) for r in rows if r["kind"] == "decode"} for n in impls}
    fwd = {n: {(r["n"], r["L"]): r.get(n) for r in rows if r["kind"] == "forward"} for n in impls}
    runs = {n: whole_run(dec[n], fwd[n]) for n in impls}
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, fa3=fa_why or "vllm.vllm_flash_attn FA3",
               shape=dict(hq=HQ, hkv=HKV, d=D, page=PAGE, layers=LAYERS), row_bits=bits, rows=rows, whole_run=runs,
               seconds=round(time.time() - t0, 1))
    try:
        import vllm
        res["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        res["vllm"] = None
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention_pair.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    names = list(impls)
    print("row bits:", json.dumps(bits))
    print(f"{'cell':22s}" + "".join(f"{n + ' ms':>14s}" for n in names) + "   walk / split")
    for r in rows:
        cell = f"decode B{r['B']} ctx{r['ctx']}" if r["kind"] == "decode" else f"forward {r['n']}x{r['L']}"
        ms = [r.get(n) for n in names]
        ratio = f"{r['walk'] / r['split']:.2f}" if r.get("walk") and r.get("split") else "-"
        print(f"{cell:22s}" + "".join(f"{m:14.4f}" if m is not None else f"{'-':>14s}" for m in ms) + f"   {ratio}")
    print("whole run (long rollout 64 x 1,024 -> 4,096, 28 layers), attention seconds:")
    for n, w in runs.items():
        print(f"  {n:10s} decode {w['decode_s']}  training forward {w['forward_s']}")
    print(f"({res['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
