"""``areal-tik train --config recipes/<x>.yaml [overrides]``: ``python -m areal_tik.areal.train``."""
from __future__ import annotations

import yaml

from areal_tik.cli.errors import UsageError, need, need_file
from areal_tik.areal.overrides import OverrideError, check_keys


DESCRIPTION = ("Run AReaL's PPOTrainer on a recipe with the areal-tik plugin. actor.kernel_backend=tik puts rollout "
               "and training on the tik kernels and skips the old-policy recompute when the skip rule holds; default "
               "keeps AReaL's kernels. Overrides are checked against the recipe before anything starts (a bad key: "
               "exit 2, naming the closest valid key). Each run works in a folder of its own (printed at start).")


def add_parser(sub):
    p = sub.add_parser("train", help="run an AReaL recipe with the areal-tik plugin (actor.kernel_backend=tik|default)",
                       description=DESCRIPTION)
    p.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/tiny.yaml")
    p.add_argument("--step-log", default=None, help="append one JSON line of stats per step to this file")
    p.add_argument("overrides", nargs="*", help="AReaL/Hydra overrides key=value, e.g. actor.kernel_backend=tik")
    p.set_defaults(func=run)
    return p


def check_recipe(path: str) -> None:
    """``path`` is a YAML file named ``*.yaml`` holding a mapping (AReaL's loader finds nothing else
    and says "Cannot find primary config"); else ``UsageError`` naming the line of a YAML error."""
    need_file("--config", path)
    need(path.endswith(".yaml"), f"--config {path!r} is not a .yaml file; give a recipe such as recipes/tiny.yaml")
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UsageError(f"--config {path!r} is not valid YAML{where}: {why}") from None
    need(isinstance(doc, dict), f"--config {path!r} holds no mapping of settings; see recipes/tiny.yaml")


def run(args) -> int:
    check_recipe(args.config)
    try:
        check_keys(args.config, args.overrides)   # the recipe's YAML only: before AReaL is imported
    except OverrideError as e:
        raise UsageError(str(e)) from None
    from areal_tik.areal.train import main  # lazy: torch is heavy and every CLI command imports this module

    argv = ["--config", args.config, *args.overrides]
    if args.step_log:
        argv += ["--step-log", args.step_log]
    return main(argv)   # a ConfigError while loading the recipe: exit 2 (cli.errors.run_command)
