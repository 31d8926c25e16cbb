"""``areal-tik ab``: rollout engines and the recompute skip compared on one recipe; writes a report directory."""
from __future__ import annotations

import os


def add_parser(sub):
    p = sub.add_parser("ab", help="throughput A/B of AReaL runs (same recipe, seed, data): stock vLLM (vllm), our engine "
                                  "on default kernels (baseline), tik, vLLM + tik (vllm_tik), stock vLLM with AReaL's "
                                  "loglinear proximal log-probs (vllm_loglinear)")
    p.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/tiny.yaml")
    p.add_argument("--steps", type=int, default=2, help="training steps per arm")
    p.add_argument("--out", default=None, help="report directory (default ab_reports/<recipe>-<time>)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="seconds per arm before giving up")
    p.add_argument("--partial-ok", action="store_true",
                   help="an arm past --timeout keeps the steps it logged (the tik arm then runs as many steps as "
                        "the baseline logged) and the report is written, marked PARTIAL")
    p.add_argument("--runs-dir", default=None,
                   help="AReaL cluster.fileroot for both arms (model dirs, checkpoints); default <out>/runs")
    p.add_argument("--set", dest="arm_set", default="baseline,tik",
                   help="the arms compared, comma-separated from vllm, vllm_loglinear, baseline, tik, vllm_tik "
                        "(default baseline,tik; vllm,tik,vllm_tik compares with stock vLLM); ratios are taken against "
                        "vllm when it is in the set, else baseline")
    p.add_argument("--arms", default="both",
                   help="which arms of --set to run now: both/all (every arm), a comma-separated subset (the others are "
                        "read from --out, written by earlier calls; the report is written once all are there), or "
                        "none: rebuild the report from the arms in --out")
    p.add_argument("overrides", nargs="*", help="extra AReaL overrides for both arms, e.g. gconfig.max_new_tokens=8")
    p.set_defaults(func=run)
    return p


def check_args(args) -> None:
    """Refuse bad arguments before either arm starts (``UsageError``)."""
    from areal_tik.cli.errors import need, need_file, need_float, need_int
    need_file("--config", args.config)
    need_int("--steps", args.steps, lo=1)
    need_float("--timeout", args.timeout, lo=0, lo_open=True, optional=True)
    from areal_tik.ab.runner import parse_arms
    try:
        arm_set = parse_arms(args.arm_set)
        arms = arm_set if args.arms in ("both", "all") else () if args.arms == "none" else parse_arms(args.arms)
    except ValueError as e:
        need(False, f"{e} (--set / --arms)")
    need(bool(arm_set), "--set names no arm")
    need(all(a in arm_set for a in arms), f"--arms {args.arms} names arms outside --set {args.arm_set}")
    need(args.arms in ("both", "all") or bool(args.out), "--arms <subset>|none needs --out (the directory the other "
                                                          "arms were or will be written to)")
    args.arm_tuple, args.arm_set_tuple = arms, arm_set
    need(not args.out or not os.path.exists(args.out) or os.path.isdir(args.out),
         f"--out {args.out!r} exists and is not a directory; give a report directory")
    bad = [o for o in args.overrides if "=" not in o]
    need(not bad, f"overrides must be key=value, got {', '.join(map(repr, bad))}")


def run(args) -> int:
    import time

    check_args(args)
    from areal_tik.ab.runner import run_ab

    out = args.out or os.path.join("ab_reports", f"{os.path.splitext(os.path.basename(args.config))[0]}-"
                                                  f"{time.strftime('%Y%m%d-%H%M%S')}")
    report = run_ab(args.config, args.steps, out, overrides=args.overrides, progress=not args.no_progress,
                    timeout=args.timeout, runs_dir=args.runs_dir, partial_ok=args.partial_ok,
                    arms=args.arm_tuple, arm_set=args.arm_set_tuple)
    if report.get("pending"):
        print(report["summary_md"])
        return 0 if args.arms != "none" else 1
    print(report["summary_md"])
    print(f"report written to {out}: {', '.join(report['files'])}")
    return 0
