"""``areal-tik env``: versions, GPU, available backends and the kernel fingerprint."""
from __future__ import annotations

import importlib.metadata as md

from areal_tik.dispatch import fingerprint, registry
from areal_tik.dispatch.bound import bind
from areal_tik.settings import Settings
from areal_tik import vllm_plugin
from areal_tik.cli.output import print_json


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def collect() -> dict:
    env = fingerprint.environment()
    env["transformers"] = _version("transformers")
    env["areal"] = _version("areal")
    env["areal_tik"] = _version("areal-tik")
    spec = Settings.from_env().backend
    try:   # the ops a process started with this environment would bind
        fp = fingerprint.compute(bind(spec), env=env)
    except registry.BackendUnavailable as e:
        fp = {"fingerprint": f"unavailable: {e}", "selection": {}}
    status = registry.backend_status()
    # lazy: torch is heavy and every CLI command imports this module
    from areal_tik.kernels.attention import flash_backward as attention_backward
    vllm_ok, vllm_why = vllm_plugin.available()
    return {
        "versions": {k: env[k] for k in ("python", "torch", "triton", "cuda", "transformers", "areal", "areal_tik")},
        "gpu": env["gpu"] or "no GPU",
        "backends": {k: {"available": ok, "reason": why} for k, (ok, why) in status.items()},
        "selection": fp["selection"],
        "attention_backward": attention_backward.describe(),
        "fingerprint": fp["fingerprint"],
        "vllm_plugin": {"available": vllm_ok, "reason": vllm_why},
    }


def run(args) -> int:
    info = collect()
    if args.json:
        print_json(info)
        return 0
    # lazy: rich is heavy and every CLI command imports this module
    from rich.console import Console
    from rich.table import Table
    c = Console()
    t = Table(title="areal-tik environment", show_header=False)
    for k, v in info["versions"].items():
        missing = "none (CPU build of torch)" if k == "cuda" else "not installed"
        t.add_row(k, str(v) if v else f"[dim]{missing}[/dim]")
    gpu = info["gpu"]
    t.add_row("gpu", gpu if isinstance(gpu, str) else f"{gpu['name']} ({gpu['arch']}, {gpu['sms']} SMs)")
    for k, b in info["backends"].items():
        t.add_row(f"backend {k}", ("[green]available[/green] " if b["available"] else "[red]unavailable[/red] ") + b["reason"])
    t.add_row("op selection", ", ".join(f"{o}={b}" for o, b in info["selection"].items()) or "[dim]no ops[/dim]")
    t.add_row("attention backward", info["attention_backward"] + " [dim](actor.tik.attention_backward)[/dim]")
    t.add_row("kernel fingerprint", info["fingerprint"])
    vp = info["vllm_plugin"]
    from rich.markup import escape  # lazy: rich is heavy and every CLI command imports this module
    t.add_row("vLLM plugin", ("[green]available[/green] " if vp["available"] else "[red]unavailable[/red] ")
              + escape(vp["reason"]))
    c.print(t)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="versions, GPU, backends and kernel fingerprint",
                       description="Print what this machine runs: Python, torch, Triton and CUDA versions, the GPU, "
                                   "the kernel backend each op selects (triton, cuda or torch_ref) and the kernel "
                                   "fingerprint a trainer and a rollout server must share to skip the recompute.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(func=run)
