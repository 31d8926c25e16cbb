"""``areal-tik verify``: rollout log-probs vs training log-probs, bit for bit, per regime.

Runs the ``verify`` entry of the rollout engine named by ``--engine`` (``areal_tik.areal.engines``): ours
(``tik``: R2 prefill batch mix, R3 chunked prefill, R4 continuous batching, R5 abort/resume + weight update +
preemption, R1 training packings with autograd), or vLLM's scheduler regimes with the tik plugin (``vllm``).
Reports mismatching tokens per regime with max |diff|. Exit status 1 on any mismatch, so ``--kernels default`` is
expected to fail: each engine's negative control (HF's kernels in ours, stock vLLM in vLLM).
"""
from __future__ import annotations

import os

from areal_tik.areal import engines
from areal_tik.cli.errors import UsageError, need, need_choices, need_device, need_int, need_model
from areal_tik.settings import Settings
from areal_tik.cli.output import print_json


def _verifiable() -> list[str]:
    return [e.name for e in engines.all_engines() if e.verify is not None]


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="generate under R2-R5 regimes, recompute with the training forward (R1), "
                                      "compare log-probs bitwise",
                       description="The parity report: generate tokens in the rollout engine under each regime (R2 "
                                   "prefill, R3 chunked prefill, R4 decode at several batch sizes, R5 resume after a "
                                   "weight update), recompute their log-probs with the training forward (R1) and count "
                                   "the tokens whose log-probs differ in any bit. tik kernels: 0 expected.")
    p.add_argument("--model", default="tiny-qwen2", help="preset name (see areal_tik.layers.models.PRESETS) or HF directory")
    p.add_argument("--kernels", choices=("tik", "default"), default="tik",
                   help="the rollout's kernels. tik: our kernels on both sides; default: HF's (the negative control: "
                        "tokens must differ)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", help="weight and activation dtype")
    p.add_argument("--prompts", type=int, default=8, help="number of random prompts")
    p.add_argument("--min-prompt-len", type=int, default=3, help="shortest prompt, tokens")
    p.add_argument("--max-prompt-len", type=int, default=40, help="longest prompt, tokens")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--pad-to", type=int, default=256, help="R1 micro-batch padding multiple")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of a preset's weights")
    p.add_argument("--regimes", default="R1,R2,R3,R4,R5", help="our engine's regimes (tik) to check, comma-separated")
    p.add_argument("--no-backward", action="store_true", help="R1 forward with autograd but no backward pass")
    p.add_argument("--engine", choices=_verifiable(), default="tik",
                   help="the rollout engine: " + "; ".join(f"{e.name}: {e.summary}" for e in engines.all_engines()
                                                         if e.verify is not None))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(func=run)


def check_args(args) -> tuple:
    """Refuse bad arguments before the model is built (``UsageError``); the regimes asked for."""
    # lazy: torch is heavy and every CLI command imports this module
    from areal_tik.verify.parity import REGIMES
    from areal_tik.layers.models import PRESETS
    need_model("--model", args.model)
    need_device("--device", args.device)
    need(args.dtype in ("bfloat16", "float16", "float32"), f"--dtype {args.dtype!r}: use bfloat16, float16 or float32")
    need_int("--prompts", args.prompts, lo=1)
    need_int("--min-prompt-len", args.min_prompt_len, lo=1)
    need(args.max_prompt_len >= args.min_prompt_len,
         f"--max-prompt-len {args.max_prompt_len} is below --min-prompt-len {args.min_prompt_len}")
    need_int("--max-new-tokens", args.max_new_tokens, lo=1)
    need_int("--pad-to", args.pad_to, lo=1)
    regimes = tuple(r.strip() for r in args.regimes.split(",") if r.strip())
    need_choices("--regimes", list(regimes), REGIMES)
    max_pos = PRESETS.get(args.model, {}).get("max_position_embeddings")
    need(max_pos is None or args.max_prompt_len + args.max_new_tokens < max_pos,
         f"--max-prompt-len + --max-new-tokens must stay below {args.model}'s {max_pos} positions")
    return regimes


def run(args) -> int:
    from areal_tik.verify.request import VerifyRequest  # lazy: torch is heavy and every CLI command imports this module
    regimes = check_args(args)
    engine = engines.get(getattr(args, "engine", "tik"))
    if args.json:   # an engine that logs to stdout (vLLM) must leave stdout the JSON document alone
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    ok, why = engine.runs_here()
    if not ok:
        raise UsageError(f"--engine {engine.name}: {why}")
    settings = Settings.from_env(kernels=args.kernels)
    req = VerifyRequest(model=args.model, kernels=settings.kernels, backend=settings.backend, device=args.device,
                        dtype=args.dtype, prompts=args.prompts, min_prompt_len=args.min_prompt_len,
                        max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens, pad_to=args.pad_to,
                        seed=args.seed, regimes=regimes, backward=not args.no_backward)
    verify = engine.need("verify")
    if args.json:
        rep = verify(req, None)
    else:
        from rich.progress import Progress  # lazy: rich is heavy and every CLI command imports this module
        with Progress(transient=True) as prog:
            task = prog.add_task("verify", total=1.0)
            rep = verify(req, lambda name, frac: prog.update(task, completed=frac, description=name))
    rep.setdefault("engine", engine.name)
    if args.json:
        print_json(rep)
    else:
        _print(rep, engine.name)
    return 0 if rep["passed"] else 1


# the per-regime counts an engine's report may carry beyond tokens, mismatches and max |diff|
_DETAIL = ("n_sequences", "divergent_sequences", "short_sequences", "steps", "preemptions", "aborted")


def _print(rep: dict, engine: str) -> None:
    # lazy: rich is heavy and every CLI command imports this module
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"areal-tik verify --engine {engine}: {rep.get('model')} kernels={rep.get('kernels')}"
                    + (f" on {rep['device']}" if rep.get("device") else ""))
    for col in ("regime", "tokens", "mismatching", "max |diff|", "detail", "result"):
        t.add_column(col)
    for r, v in rep["regimes"].items():
        counts = {**v, **(v.get("engine") or {})}
        detail = ", ".join(f"{k.replace('_', ' ')} {counts[k]}" for k in _DETAIL if counts.get(k) is not None)
        t.add_row(r, str(v["n_tokens"]), str(v["n_mismatch"]), f"{v['max_abs_diff']:.3g}", detail,
                  "[green]PASS" if v["passed"] else "[red]FAIL")
    Console().print(t)
