"""What any kernel could reach against PyTorch SDPA on this GPU: decode >= 1.2x SDPA, prefill >= 1.05x SDPA?

    python bench/bench_ceiling.py --out DIR [--quick]      # writes DIR/bench_ceiling.json (+ .png), DIR/rows.csv

Decode (the cells of bench_cuda.py: batch {1,4,8,16} x context {128,1K,4K,8K}, 32/8 heads, d=128, bf16,
pages of 64), measured in one run:
  * SDPA on contiguous K/V, the csrc decode and the Triton decode, each replayed from a CUDA graph
    back to back (bench_cuda's method and inputs);
  * the HBM read ceiling: the fastest of several read-only kernels over a buffer of --read-gib GiB
    (far above L2): torch.sum with a float32 accumulator, torch.amax, and a Triton streaming read
    (persistent grids of 2-16 programs per SM, 16-byte loads); the copy rate (read + write) beside it;
  * the launch floor: trivial kernels (a one-element fill, an empty Triton program) replayed from a CUDA
    graph, timed the same way (a description of the launch-bound cells: a real decode kernel replayed
    faster than the fill on one H200 host, so this floor backs no claim).
Per cell, a lower bound on any decode kernel's time: where the K/V bytes exceed twice the L2 size (so no
replay finds them cached), K/V bytes / read ceiling (at least the launch floor); elsewhere the launch floor.
The bound on the speed-up against SDPA is SDPA's time over that; ``bound_at_spec_*`` uses the vendor's HBM
peak instead of a measured rate (4.8 TB/s on the H200), a rate no kernel here has reached.
``decode_cells_goal_unreachable`` lists the HBM cells whose bound is below 1.2x SDPA.
Prefill (batch 1, causal, 32/8 heads): cuBLAS bf16 GEMM 8192^3 as the tensor-core rate in practice,
SDPA and the csrc prefill at L 4K/16K, and the rate 1.05x SDPA would be, as a share of that GEMM.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_cuda import D, HKV, HQ, _median_ms, decode_case, sdpa_layout  # noqa: E402
from harness import Recorder, graphed as _graphed, warm_up_clocks  # noqa: E402

# Vendor HBM peaks (bytes/s) by device-name substring: an upper bound, never a measurement.
SPEC_HBM = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "A100-SXM4-80GB": 2.039e12}


def _spec_hbm(name: str):
    return next((v for k, v in SPEC_HBM.items() if k in name), None)


def cell_bound_us(kv_bytes: int, floor_us: float, read_Bps: float, l2_bytes: int) -> float:
    """A lower bound on any decode kernel's time for one cell: the launch floor, and where the K/V bytes exceed
    twice the L2 (no replay can find them cached) also the time to read them once at ``read_Bps``."""
    if kv_bytes > 2 * l2_bytes:
        return max(floor_us, kv_bytes / read_Bps * 1e6)
    return floor_us


def _triton_read():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        tl.store(out_ptr + pid, tl.sum(acc, 0))

    return read_kernel


def read_ceiling(gib: float) -> dict:
    """Read-only and copy rates over a buffer of ``gib`` GiB (bytes/s), and the best read rate."""
    n = int(gib * (1 << 30)) // 4
    x = torch.rand(n, device="cuda", dtype=torch.float32)  # positive: a kernel that skipped reads would sum low
    nbytes = x.numel() * 4
    rates = {}
    rates["torch_sum_fp32"] = nbytes / (_median_ms(lambda: torch.sum(x), iters=10) * 1e-3)
    xb = x.view(torch.bfloat16)
    rates["torch_sum_bf16_to_fp32"] = nbytes / (_median_ms(lambda: torch.sum(xb, dtype=torch.float32), iters=10) * 1e-3)
    rates["torch_amax_fp32"] = nbytes / (_median_ms(lambda: torch.amax(x), iters=10) * 1e-3)
    try:
        kern = _triton_read()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for per_sm in (2, 4, 8, 16):
            grid = sms * per_sm
            out = torch.empty(grid, device="cuda", dtype=torch.float32)
            for block, warps in ((4096, 8), (8192, 8)):
                f = lambda: kern[(grid,)](x, out, n, BLOCK=block, num_warps=warps)  # noqa: E731
                f()
                torch.cuda.synchronize()
                if not torch.allclose(out.sum().double(), x.sum().double(), rtol=1e-3):
                    raise RuntimeError("triton read kernel summed wrongly")  # it must really read every element
                rates[f"triton_read_{per_sm}perSM_b{block}"] = nbytes / (_median_ms(f, iters=10) * 1e-3)
    except Exception as e:  # report: the torch reads still bound the rate
        rates["triton_read_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    y = torch.empty_like(x)
    copy = 2 * nbytes / (_median_ms(lambda: y.copy_(x), iters=10) * 1e-3)
    best = max((k for k, v in rates.items() if isinstance(v, float)), key=lambda k: rates[k])
    del x, y
    torch.cuda.empty_cache()
    return {"buffer_bytes": nbytes, "read_rates_Bps": rates, "copy_rate_Bps": copy,
            "read_ceiling_Bps": rates[best], "read_ceiling_by": best}


def launch_floors_us() -> dict:
    """Graph-replay time of trivial kernels (a one-element fill, an empty Triton program), timed as the decode
    cells are. The least of them is the launch floor; on some hosts a real decode kernel replays faster still,
    so the floor only describes the launch-bound cells and never backs a claim (see decode_cells)."""
    import triton

    @triton.jit
    def empty_kernel(x_ptr):
        pass

    z = torch.zeros(1, device="cuda")
    out = {}
    for name, f in (("fill", lambda: z.fill_(1.0)), ("empty_triton", lambda: empty_kernel[(1,)](z))):
        fn, how = _graphed(f)
        if how == "graph":
            out[name] = round(_median_ms(fn, iters=50) * 1e3, 2)
    if not out:
        raise RuntimeError("could not capture a trivial kernel")
    return out


def decode_cells(quick: bool, floor_ms: float, ceil: dict, spec, l2_bytes: int) -> list[dict]:
    F = torch.nn.functional
    try:
        from areal_tik.kernels.cuda import attention as cuda_attention, extension as cuda_extension
        cuda_extension.extension()
        cuda_paged = cuda_attention.attention_paged_cuda
    except Exception as e:
        print(f"csrc decode unavailable ({type(e).__name__}: {e}); timing SDPA and Triton only")
        cuda_paged = None
    from areal_tik.kernels import attention as ta
    rows = []
    for B in ((1, 16) if quick else (1, 4, 8, 16)):
        for ctx in ((1024, 8192) if quick else (128, 1024, 4096, 8192)):
            q, kc, vc, bt, cq, sk = decode_case(B, ctx)
            qq, kk, vv = sdpa_layout(q, kc, vc, bt, ctx)
            kv_bytes = 2 * B * ctx * HKV * D * 2
            row = {"batch": B, "ctx": ctx, "kv_bytes": kv_bytes, "hbm_bound_cell": kv_bytes > 2 * l2_bytes}
            with torch.no_grad():
                provs = {"sdpa": lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True),
                         "triton": lambda: ta.attention_paged_triton(q, kc, vc, bt, cq, sk, 1)}
                if cuda_paged is not None:
                    provs["cuda"] = lambda: cuda_paged(q, kc, vc, bt, cq, sk, 1)
                for name, f in provs.items():
                    fn, how = _graphed(f)
                    row[f"{name}_us"] = round(_median_ms(fn) * 1e3, 2)
                    row[f"{name}_timing"] = how
            floor_us = floor_ms * 1e3
            bound_us = cell_bound_us(kv_bytes, floor_us, ceil["read_ceiling_Bps"], l2_bytes)
            row["kv_read_us_at_ceiling"] = round(kv_bytes / ceil["read_ceiling_Bps"] * 1e6, 2)
            row["bound_us"] = round(bound_us, 2)
            row["bound_speedup_vs_sdpa"] = round(row["sdpa_us"] / bound_us, 3)
            if spec is not None:
                spec_us = cell_bound_us(kv_bytes, floor_us, spec, l2_bytes)
                row["bound_at_spec_us"] = round(spec_us, 2)
                row["bound_at_spec_speedup_vs_sdpa"] = round(row["sdpa_us"] / spec_us, 3)
            row["sdpa_read_Bps"] = kv_bytes / (row["sdpa_us"] * 1e-6)
            for name in ("cuda", "triton"):
                if f"{name}_us" in row:
                    row[f"{name}_speedup_vs_sdpa"] = round(row["sdpa_us"] / row[f"{name}_us"], 3)
            row["goal_1.2x_reachable"] = row["bound_speedup_vs_sdpa"] >= 1.2  # meaningful in HBM cells only
            rows.append(row)
            spec_note = "" if spec is None else f"; at the spec peak {row['bound_at_spec_speedup_vs_sdpa']}x"
            print(f"decode {B:2d}x{ctx:5d}: sdpa {row['sdpa_us']:7.1f} us  cuda {row.get('cuda_us', float('nan')):7.1f}"
                  f"  triton {row['triton_us']:7.1f}  bound {bound_us:7.2f} us -> at most "
                  f"{row['bound_speedup_vs_sdpa']}x SDPA ({'K/V from HBM' if row['hbm_bound_cell'] else 'launch'})"
                  f"{spec_note}")
            del q, kc, vc, kk, vv, qq
            torch.cuda.empty_cache()
    return rows


def prefill_cells(quick: bool) -> dict:
    F = torch.nn.functional
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = 2 * 8192 ** 3 / (_median_ms(lambda: a @ b, iters=10) * 1e-3)
    del a, b
    out = {"gemm_8192_bf16_flops": gemm, "cells": []}
    try:
        from areal_tik.kernels.cuda import attention as cuda_attention, extension as cuda_extension
        cuda_extension.extension()
        cuda_varlen = cuda_attention.attention_varlen_cuda
    except Exception:
        cuda_varlen = None
    for L in ((4096,) if quick else (4096, 16384)):
        q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
        flops = 2.0 * L * L * D * HQ
        row = {"L": L}
        with torch.no_grad():
            row["sdpa_flops"] = flops / (_median_ms(lambda: F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True)) * 1e-3)
            if cuda_varlen is not None:
                row["cuda_flops"] = flops / (_median_ms(lambda: cuda_varlen(q, k, v, cu, L)) * 1e-3)
        row["goal_flops"] = 1.05 * row["sdpa_flops"]
        row["sdpa_share_of_gemm"] = round(row["sdpa_flops"] / gemm, 3)
        row["goal_share_of_gemm"] = round(row["goal_flops"] / gemm, 3)
        if "cuda_flops" in row:
            row["cuda_share_of_gemm"] = round(row["cuda_flops"] / gemm, 3)
        out["cells"].append(row)
        print(f"prefill L={L}: sdpa {row['sdpa_flops'] / 1e12:.0f} TF/s ({row['sdpa_share_of_gemm']} of GEMM), "
              f"cuda {row.get('cuda_flops', float('nan')) / 1e12:.0f}, goal {row['goal_flops'] / 1e12:.0f} TF/s "
              f"({row['goal_share_of_gemm']} of the GEMM's {gemm / 1e12:.0f})")
        del q, k, v, qs, ks, vs
        torch.cuda.empty_cache()
    return out


def _record(res: dict, rec: Recorder) -> None:
    """The JSON's measured figures as harness rows (medians: the derived rates carry no quantiles)."""
    read = res.get("read", {})
    for k, v in read.get("read_rates_Bps", {}).items():
        rec.add(f"read {read['buffer_bytes'] >> 20} MiB", k, "read rate", v / 1e12, "TB/s")
    if "copy_rate_Bps" in read:
        rec.add(f"read {read['buffer_bytes'] >> 20} MiB", "copy", "copy rate", read["copy_rate_Bps"] / 1e12, "TB/s")
    for k, v in res.get("launch_floors_us", {}).items():
        rec.add("launch floor", k, "time", v / 1e3, "ms")
    for r in res.get("decode", []):
        case = f"decode B={r['batch']} ctx={r['ctx']}"
        for p in ("sdpa", "cuda", "triton"):
            if f"{p}_us" in r:
                rec.add(case, p, "time", r[f"{p}_us"] / 1e3, "ms")
        rec.add(case, "any kernel", "lower bound", r["bound_us"] / 1e3, "ms")
    pre = res.get("prefill", {})
    if "gemm_8192_bf16_flops" in pre:
        rec.add("gemm 8192^3 bf16", "cublas", "throughput", pre["gemm_8192_bf16_flops"] / 1e12, "TFLOP/s")
    for r in pre.get("cells", []):
        for p in ("sdpa", "cuda"):
            if f"{p}_flops" in r:
                rec.add(f"prefill L={r['L']}", p, "throughput", r[f"{p}_flops"] / 1e12, "TFLOP/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--read-gib", type=float, default=4.0, help="size of the read-ceiling buffer")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ceiling needs a CUDA GPU")
        return 2
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name()
    rec = Recorder("bench_ceiling", args.out)
    res = {"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda, "l2_bytes": props.L2_cache_size,
           "spec_hbm_Bps": _spec_hbm(name), "commit": rec.env["commit"], "command": rec.env["command"]}
    warm_up_clocks(0.1)  # ~50 GEMMs of 8192^3
    res["read"] = read_ceiling(args.read_gib)
    print(f"read ceiling {res['read']['read_ceiling_Bps'] / 1e12:.2f} TB/s ({res['read']['read_ceiling_by']}); "
          f"copy {res['read']['copy_rate_Bps'] / 1e12:.2f} TB/s")
    res["launch_floors_us"] = launch_floors_us()
    res["launch_floor_us"] = min(res["launch_floors_us"].values())
    print(f"launch floor (graph replay of a trivial kernel): {res['launch_floors_us']} us")
    try:
        res["decode"] = decode_cells(args.quick, res["launch_floor_us"] / 1e3, res["read"], res["spec_hbm_Bps"],
                                     props.L2_cache_size)
        # Claims rest on the HBM cells only: their bound is bytes / a measured read rate. A launch-bound cell's
        # floor is a trivial kernel's replay time, which a real kernel may beat on some hosts (measured).
        res["decode_cells_goal_unreachable"] = [f"{r['batch']}x{r['ctx']}" for r in res["decode"]
                                                if r["hbm_bound_cell"] and not r["goal_1.2x_reachable"]]
        res["decode_cells_goal_unreachable_at_spec"] = [
            f"{r['batch']}x{r['ctx']}" for r in res["decode"]
            if r["hbm_bound_cell"] and r.get("bound_at_spec_speedup_vs_sdpa", 9.0) < 1.2]
        res["launch_cells_fastest_kernel_us"] = min(
            min(r[k] for k in ("sdpa_us", "cuda_us", "triton_us") if k in r) for r in res["decode"] if not r["hbm_bound_cell"])
        res["prefill"] = prefill_cells(args.quick)
    finally:
        path = os.path.join(args.out, "bench_ceiling.json")
        json.dump(res, open(path, "w"), indent=1)
        _record(res, rec)
        print(f"wrote {path} and {rec.write()}")
    print(f"HBM-bound decode cells where no kernel can reach 1.2x SDPA: at the measured read ceiling "
          f"{res['decode_cells_goal_unreachable'] or 'none'}; at the vendor peak "
          f"{res['decode_cells_goal_unreachable_at_spec'] or 'none'}")
    try:
        from plot_results import plot_ceiling
        print(plot_ceiling(path))
    except Exception as e:  # the JSON is the result; the figure can be drawn later by plot_results.py
        print(f"no figure: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
