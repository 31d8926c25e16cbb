"""``areal-tik warmstart --model <preset|dir> --out DIR``: supervised warm start on the built-in
arithmetic task, so that an A/B on a preset (no pretrained weights) has a reward to compare."""
from __future__ import annotations

import os

from areal_tik.areal.arith import TASKS
from areal_tik.cli.errors import need, need_choices, need_device, need_float, need_int, need_model
from areal_tik.cli.output import print_json


def add_parser(sub):
    p = sub.add_parser("warmstart", help="train a preset on the built-in arithmetic task (next-token loss) and "
                                         "save an HF dir a recipe can load (actor.path=DIR tokenizer_path=DIR)",
                       description="Supervised warm start: train a model preset on the built-in arithmetic task "
                                   "(next-token loss on the answer) so it earns reward, check its greedy accuracy on "
                                   "held-out prompts and save an HF directory a recipe loads with actor.path=DIR "
                                   "tokenizer_path=DIR. A recipe can also name a cached one: actor.path="
                                   "'warmstart:tiny-qwen2?task=add1&steps=120' (recipes/tiny.yaml does).")
    p.add_argument("--model", required=True, help="preset name (e.g. tiny-qwen2, qwen2.5-1.5b) or HF dir")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--task", default="mix", help="add1 (single digits) | add2 (two digits) | mix (+ - * up to 19)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch", type=int, default=256, help="prompts per step")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def check_args(args) -> None:
    """Refuse bad arguments before training starts (``UsageError``)."""
    need_model("--model", args.model)
    need(not os.path.exists(args.out) or os.path.isdir(args.out), f"--out {args.out!r} exists and is not a directory")
    need_choices("--task", [args.task], TASKS)
    need_int("--steps", args.steps, lo=1)
    need_int("--batch", args.batch, lo=1)
    need_float("--lr", args.lr, lo=0, lo_open=True)
    need_device("--device", args.device)


def run(args) -> int:
    check_args(args)
    from areal_tik.areal.warmstart import warm_start  # lazy: torch is heavy and every CLI command imports this module

    rec = warm_start(args.model, args.out, task=args.task, steps=args.steps, batch=args.batch, lr=args.lr,
                     seed=args.seed, device=args.device, progress=not args.no_progress)
    print_json({k: v for k, v in rec.items() if k != "losses_every_10"})
    return 0
