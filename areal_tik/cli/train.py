"""``areal-tik train --config recipes/<x>.yaml [overrides]``: ``python -m areal_tik.areal.train``."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("train", help="run an AReaL recipe with the areal-tik plugin (actor.kernel_backend=tik|default)")
    p.add_argument("--config", required=True)
    p.add_argument("--step-log", default=None, help="append one JSON line of stats per step")
    p.add_argument("overrides", nargs="*", help="AReaL/Hydra overrides, e.g. actor.kernel_backend=tik")
    p.set_defaults(func=run)
    return p


def check_recipe(path: str) -> None:
    """``path`` is a YAML file named ``*.yaml`` holding a mapping (AReaL's loader finds nothing else
    and says "Cannot find primary config"); else ``UsageError`` naming the line of a YAML error."""
    import yaml

    from areal_tik.cli.errors import UsageError, need, need_file
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
    from areal_tik.areal.train import main

    argv = ["--config", args.config, *args.overrides]
    if args.step_log:
        argv += ["--step-log", args.step_log]
    return main(argv)
