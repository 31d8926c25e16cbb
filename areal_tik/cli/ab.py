"""``areal-tik ab``: rollout engines and the recompute skip compared on one recipe; writes a report directory."""
from __future__ import annotations

import json
import os
import sys
import time

from areal_tik.ab.progress import MODES, resolve_mode
from areal_tik.cli.errors import UsageError, need, need_float, need_int
from areal_tik.cli.train import check_recipe
from areal_tik.ab.runner import ArmFailed, arm_overrides, parse_arms, run_ab
from areal_tik.areal.overrides import OverrideError, check_keys


DEFAULT_STEPS = 12   # 11 measured steps per arm: an interval worth reading (fewer than 4: a smoke test)


def add_parser(sub):
    p = sub.add_parser(
        "ab", help="throughput A/B of AReaL runs (same recipe, seed, data): stock vLLM (vllm), our engine "
                   "on default kernels (baseline), tik, tik with shared-buffer weight updates (tik_ipc), vLLM + tik "
                   "(vllm_tik, vllm_tik_ipc), stock vLLM with AReaL's loglinear proximal log-probs (vllm_loglinear)",
        description="Run AReaL's trainer once per arm on the same recipe, seed and data, one arm after the other, "
                    "then write a report folder (summary.md, report.json, steps.csv, step_time.png, reward.png) and "
                    "print the summary: the step-throughput ratio of each arm against the reference (vllm when in "
                    "the set, else baseline) with a 95% interval over the measured steps (step 0 is warm-up). "
                    "Overrides are checked against the recipe before any arm starts.",
        epilog="On a 2-core CPU recipes/tiny.yaml at the default %d steps takes about 1.5 minutes (3 while other "
               "jobs share the cores); --steps 2 is a smoke test (one measured step: no interval)." % DEFAULT_STEPS)
    p.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/tiny.yaml")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help="training steps per arm; step 0 is warm-up, the others are measured")
    p.add_argument("--out", default=None, help="report folder (default: ab_reports/<recipe>-<time>)")
    p.add_argument("--progress", choices=MODES, default="auto",
                   help="progress on stderr: bar (redrawn in place), plain (one line per event), none; auto: bar on a "
                        "terminal, else plain")
    p.add_argument("--no-progress", action="store_true", help="same as --progress none")
    p.add_argument("--timeout", type=float, default=None, help="seconds per arm before giving up (default: no limit)")
    p.add_argument("--partial-ok", action="store_true",
                   help="an arm past --timeout keeps the steps it logged (the tik arm then runs as many steps as "
                        "the baseline logged) and the report is written, marked PARTIAL")
    p.add_argument("--runs-dir", default=None,
                   help="AReaL's cluster.fileroot for the arms (model dirs, checkpoints, name_resolve records); "
                        "default: <out>/runs")
    p.add_argument("--set", dest="arm_set", default="baseline,tik",
                   help="the arms compared, comma-separated from vllm, vllm_loglinear, baseline, tik, tik_ipc, vllm_tik, vllm_tik_ipc "
                        "(vllm,tik,vllm_tik compares with stock vLLM); ratios are taken against vllm when it is in "
                        "the set, else baseline")
    p.add_argument("--arms", default="both",
                   help="which arms of --set to run now: both/all (every arm), a comma-separated subset (the others are "
                        "read from --out, written by earlier calls; the report is written once all are there), or "
                        "none: rebuild the report from the arms in --out")
    p.add_argument("overrides", nargs="*", help="AReaL overrides key=value for every arm, e.g. gconfig.max_new_tokens=8")
    p.set_defaults(func=run)
    return p


def check_args(args) -> None:
    """Refuse bad arguments before either arm starts (``UsageError``)."""
    check_recipe(args.config)
    need_int("--steps", args.steps, lo=1)
    need_float("--timeout", args.timeout, lo=0, lo_open=True, optional=True)
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
    try:
        check_keys(args.config, args.overrides)   # the recipe's YAML only: before AReaL is imported
    except OverrideError as e:
        need(False, str(e))


class _Quiet:
    """stdout and stderr (the file descriptors, so every handler AReaL set up) to /dev/null meanwhile."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        return False


def check_composed(args):
    """Every arm to run loads its config (AReaL's loader: Hydra, OmegaConf's types, our checks) before any
    arm starts; a bad value is a ``UsageError`` naming the arm and the key. The first arm's config."""
    with _Quiet():   # AReaL's loader logs its warnings about recipe choices; the arms' logs keep them
        from areal_tik.areal.config import ConfigError  # lazy: areal is heavy and every CLI command imports this module
        from areal_tik.areal.train import load_config  # lazy: torch is heavy and every CLI command imports this module
        configs, error = [], None
        for arm in args.arm_tuple:
            try:
                configs.append(load_config(["--config", args.config, *arm_overrides(arm, args.config),
                                            *args.overrides]))
            except (OverrideError, ConfigError) as e:
                error = f"the {arm} arm's config: {str(e).splitlines()[0]}"
                break
    if error:
        raise UsageError(error)
    return configs[0]


def _say(text: str) -> None:
    print(f"[ab] {text}", file=sys.stderr, flush=True)


def _warm_start_first(model_path: str, mode: str) -> None:
    """A recipe that names a cached warm start gets it made before the first arm, so no arm pays it."""
    # lazy: torch is heavy and every CLI command imports this module
    from areal_tik.areal.warmstart import WARM_PREFIX, cached_warm_start, warm_cache_root
    if not model_path.startswith(WARM_PREFIX):
        return
    quiet = mode == "none"
    d = cached_warm_start(model_path, warm_cache_root(os.environ), progress=mode == "bar",
                          on_train=None if quiet else lambda d: _say(f"warm start: training the model once, "
                                                                      f"cached in {d}"))
    if not quiet:
        with open(os.path.join(d, "warmstart.json")) as f:
            rec = json.load(f)
        _say(f"warm start ready ({rec['steps']} steps, greedy accuracy {rec['greedy_accuracy_after']:.0%} on "
             f"{rec['eval_items']} held-out prompts): {d}")


def run(args) -> int:
    check_args(args)
    mode = resolve_mode("none" if args.no_progress else args.progress)
    if args.arm_tuple:
        if mode != "none":
            _say(f"checking the config of each arm ({', '.join(args.arm_tuple)}) with AReaL's loader")
        config = check_composed(args)
        _warm_start_first(config.actor.path, mode)

    out = args.out or os.path.join("ab_reports", f"{os.path.splitext(os.path.basename(args.config))[0]}-"
                                                  f"{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        report = run_ab(args.config, args.steps, out, overrides=args.overrides, progress=mode,
                        timeout=args.timeout, runs_dir=args.runs_dir, partial_ok=args.partial_ok,
                        arms=args.arm_tuple, arm_set=args.arm_set_tuple)
    except ArmFailed as e:
        print(f"areal-tik ab: {e}", file=sys.stderr)
        print("  " + "\n  ".join(e.excerpt), file=sys.stderr)
        print(f"  (full log: {e.log})", file=sys.stderr)
        return 1
    if report.get("pending"):
        print(report["summary_md"])
        return 0 if args.arms != "none" else 1
    print(report["summary_md"])
    print(f"report written to {out}: {', '.join(report['files'])}")
    return 0
