"""``areal-tik train --config recipes/<x>.yaml [overrides]``: ``python -m areal_tik.areal.train``."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("train", help="run an AReaL recipe with the areal-tik plugin (actor.kernel_backend=tik|default)")
    p.add_argument("--config", required=True)
    p.add_argument("--step-log", default=None, help="append one JSON line of stats per step")
    p.add_argument("overrides", nargs="*", help="AReaL/Hydra overrides, e.g. actor.kernel_backend=tik")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from areal_tik.cli.errors import need_file
    need_file("--config", args.config)
    from areal_tik.areal.train import main

    argv = ["--config", args.config, *args.overrides]
    if args.step_log:
        argv += ["--step-log", args.step_log]
    return main(argv)
