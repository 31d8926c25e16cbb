"""The MLP's stacked gate/up GEMM and SiLU-and-multiply at decode batch M: the two launches apart (the linear op's
pick for ``[M, 2I]``, then ``silu_mul_packed``) against the fused ``linear_silu_mul`` (the pick with half its N
tile, and every decode tile the table holds, forced), bit-checked against the apart result, timed in CUDA graphs on
weights that are not L2-resident (rotating buffers), beside cuBLAS's GEMM with torch's SiLU-and-multiply.

    python bench/probes/probe_gate_up_silu.py --out $OUT [--model 1.5b,7b] [--ms 64,128,256]

On a machine without a GPU it runs under the Triton interpreter as a smoke run (``--shape HxI`` for tiny widths;
wall-clock times of one call, not kernel times). Writes ``gate_up_silu.json``. The engine-level A/B is
``AREAL_TIK_BACKEND=linear_silu_mul=torch_ref`` (the fusion off: its backend differs from the linear op's,
``layers/modules.fuses``) against the default (``bench/gpu_check.sh fused_ab``).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

#: hidden size and MLP width (I) per model shape
MLP_SHAPES = {"1.5b": (1536, 8960), "7b": (3584, 18944)}


def _wall_ms(call, args_list):
    """The CPU smoke run's timing: one pass over the argument sets, wall clock per call (ms)."""
    t0 = time.perf_counter()
    for args in args_list:
        call(*args)
    return 1e3 * (time.perf_counter() - t0) / len(args_list)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="1.5b,7b")
    ap.add_argument("--shape", help="HIDDENxINTER instead of --model's shapes (e.g. 64x48 for a CPU smoke run)")
    ap.add_argument("--ms", default="64,128,256")
    ap.add_argument("--budget-s", type=float, default=120.0)
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as Fn

    from areal_tik.kernels import linear as L, linear_silu_mul as F, swiglu as S
    from bench.bench_dense import bench_graphed, rotating
    from bench.harness import gemm_probe_start

    if torch.cuda.is_available():
        dev, arch, deadline, res = gemm_probe_start(a.out, a.budget_s)
        timer = bench_graphed
    else:                                     # the interpreter's smoke run
        os.makedirs(a.out, exist_ok=True)
        dev, arch, deadline, res = torch.device("cpu"), "sm_90", time.time() + a.budget_s, {"device": "cpu"}
        timer = _wall_ms
    res["cells"] = []
    shapes = ({"custom": tuple(int(v) for v in a.shape.split("x"))} if a.shape
              else {m: MLP_SHAPES[m] for m in a.model.split(",")})

    def us(call, bufs):
        """Microseconds per call, or None where the graphed timing failed (bench_graphed says why)."""
        ms = timer(call, bufs)
        return None if ms is None else 1e3 * ms

    def apart(x, w):
        return S.silu_mul_packed_triton(L.linear_fwd(x, w))

    def cublas(x, w):
        gu = Fn.linear(x, w)
        return Fn.silu(gu[:, : w.shape[0] // 2]) * gu[:, w.shape[0] // 2:]

    for model, (H, I) in shapes.items():
        for M in (int(m) for m in a.ms.split(",")):
            nxt = rotating(lambda: (torch.randn(M, H, device=dev).to(torch.bfloat16),
                                    (torch.randn(2 * I, H, device=dev) * H ** -0.5).to(torch.bfloat16)),
                           2 * I * H * 2)
            x, w = nxt.bufs[0]
            ref = apart(x, w)
            picked = L.pick_config(M, 2 * I, H, arch)
            cell = dict(model=model, M=M, H=H, I=I, picked=picked,
                        apart_us=us(apart, nxt.bufs), cublas_torch_us=us(cublas, nxt.bufs), fused={})
            # the pick, then every decode-sized config forced (the fused launch halves its N tile), and each again
            # with its N tile doubled first ("/x2": the fused tile then has the config's own N tile)
            cands = [(f"pick:{picked}", None)]
            for n, c in L.CONFIGS.items():
                if c["BLOCK_M"] <= max(16, 1 << (M - 1).bit_length()) and c["kernel"] in ("tma", "ptr"):
                    cands.append((n, c))
                    if c["BLOCK_N"] <= 128:
                        cands.append((n + "/x2", dict(c, BLOCK_N=2 * c["BLOCK_N"])))
            for name, c in cands:
                if cell["fused"] and time.time() > deadline:
                    cell["cut_by_budget"] = True
                    break
                r = cell["fused"][name] = {"fused_block_n": F.fused_config(M, I, H, x, w, c)[1]["BLOCK_N"]}
                try:
                    fn = functools.partial(F.linear_silu_mul_fwd, config=c)
                    r["bits_equal"] = bool(torch.equal(fn(x, w), ref))
                    if r["bits_equal"]:
                        r["us"] = us(fn, nxt.bufs)
                except Exception as e:  # compile/launch failure: recorded, excluded
                    r.update(bits_equal=False, error=f"{type(e).__name__}: {str(e)[:200]}")
                    if "illegal" in str(e).lower():
                        raise
            timed = {k: v["us"] for k, v in cell["fused"].items() if v.get("us")}
            best = min(timed, key=timed.get) if timed else None
            cell.update(best=best, best_us=timed.get(best), pick_us=timed.get(f"pick:{picked}"),
                        invalid=[k for k, v in cell["fused"].items() if not v.get("bits_equal")])
            res["cells"].append(cell)
            nan = float("nan")
            print(f"{model} M={M:4d}: apart {cell['apart_us'] or nan:7.1f} us, fused (pick {picked}) "
                  f"{cell['pick_us'] or nan:7.1f} us, best fused {best} {cell['best_us'] or nan:7.1f}"
                  f" us, cuBLAS+torch {cell['cublas_torch_us'] or nan:7.1f} us"
                  + (f"  INVALID {cell['invalid']}" if cell["invalid"] else ""), flush=True)
            del nxt, x, w, ref
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    json.dump(res, open(os.path.join(a.out, "gate_up_silu.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
