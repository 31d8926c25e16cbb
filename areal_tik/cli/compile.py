"""``areal-tik compile-check``: compile every kernel for sm_80/sm_90 and syntax-check the torch binding,
with no GPU needed."""
from __future__ import annotations

import os

from areal_tik.dispatch import compile_check
from areal_tik.cli.output import print_json


def run(args) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    rows = [] if args.skip_triton else compile_check.compile_triton()
    cu = [] if args.skip_cuda else compile_check.compile_cuda()
    ok = all(r["ok"] for r in rows + cu)
    if args.json:
        print_json({"ok": ok, "triton": rows, "cuda": cu})
    else:
        for r in rows:
            print(f"{'ok ' if r['ok'] else 'FAIL'} triton {r['module']}.{r['kernel']} {r['arch']} "
                  f"{r.get('error', '')}")
        for r in cu:
            tool = "c++ -fsyntax-only" if r.get("arch") == "host" else "nvcc"
            print(f"{'ok ' if r['ok'] else 'FAIL'} {tool} {r['source']} {r.get('arch', '')} {r.get('error', '')}")
            for name, k in sorted(r.get("kernels", {}).items()):
                spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
                print(f"       {k.get('regs', '?'):>4} regs{f', {spill} B spilled' if spill else ''}  {name}")
            for w in r.get("ptxas_warnings", []):
                print(f"       ptxas: {w}")
        host = sum(r.get("arch") == "host" for r in cu)
        print(f"{len(rows)} triton compiles, {len(cu) - host} nvcc compiles, {host} binding syntax checks: "
              f"{'all ok' if ok else 'FAILURES'}")
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("compile-check", help="compile all Triton kernels and csrc/*.cu for sm_80 and sm_90",
                       description="Compile every Triton kernel and the CUDA sources in csrc/ for sm_80 (A100) and "
                                   "sm_90 (H100/H200) without a GPU, and report each kernel's result: a build check "
                                   "for machines that will run on a GPU later.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument("--skip-triton", action="store_true", help="leave out the Triton kernels")
    p.add_argument("--skip-cuda", action="store_true", help="leave out the CUDA sources (csrc/*.cu; needs nvcc)")
    p.set_defaults(func=run)
