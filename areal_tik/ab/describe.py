"""Plain-words labels for an A/B report, shared by the summary and the figures: the workload (recipe,
model, data, batch), the machine (GPU, or CPU model and cores), the arms and numbers as printed."""
from __future__ import annotations

import math
import os
import platform

import yaml

from areal_tik.ab.analysis import ARMS

__all__ = ["workload_label", "machine_label", "on_cpu", "fmt", "arms_of", "has_critic"]


def fmt(x, nd: int = 3) -> str:
    """``x`` with ``nd`` decimals; ``nan`` for a missing or undefined number."""
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def arms_of(report: dict) -> list[str]:
    """The report's arms in report order."""
    return list(report.get("arms") or [a for a in ARMS if a in report["rows"]])


def has_critic(report: dict) -> bool:
    """Some arm spent time in a critic (PPO)."""
    return any(r.get("critic", 0.0) > 0 for a in arms_of(report) for r in report["rows"][a])


def _recipe_values(meta: dict) -> dict:
    """The few recipe values a label shows, with the run's ``key=value`` overrides applied."""
    keys = {"experiment_name": None, "actor.path": None, "train_dataset.path": None, "train_dataset.batch_size": None,
            "gconfig.n_samples": None, "gconfig.max_new_tokens": None}
    try:
        with open(meta.get("config") or "") as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, ValueError):
        doc = {}
    for k in keys:
        node = doc
        for part in k.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        keys[k] = node
    for o in meta.get("overrides") or []:
        k, _, v = o.lstrip("+").partition("=")
        if k in keys:
            keys[k] = v.strip("'\"")
    return keys


def workload_label(meta: dict) -> str:
    """E.g. ``tiny-arith (recipes/tiny.yaml): tiny-qwen2, builtin:arith/add1?n=64, 4 prompts x 4 samples``."""
    v = _recipe_values(meta)
    model = str(v["actor.path"] or "?")
    if model.startswith("warmstart:"):
        from areal_tik.areal.warmstart import parse_warm_spec   # lazy: it imports torch
        w = parse_warm_spec(model)
        model = f"{w['model']} warm-started on {w.get('task', 'mix')}"
    elif model.startswith("preset:"):
        model = model.split(":", 1)[1] + " (random init)"
    else:
        model = os.path.basename(model.rstrip("/")) or model
    parts = [model]
    if v["train_dataset.path"]:
        parts.append(str(v["train_dataset.path"]))
    if v["train_dataset.batch_size"] and v["gconfig.n_samples"]:
        parts.append(f"{v['train_dataset.batch_size']} prompts x {v['gconfig.n_samples']} samples")
    name = v["experiment_name"] or os.path.splitext(os.path.basename(meta.get("config") or "?"))[0]
    return f"{name} ({meta.get('config')}): " + ", ".join(parts)


def on_cpu(meta: dict) -> bool:
    """The arms ran without a GPU (as recorded in the report's environment)."""
    env = meta.get("environment")
    return isinstance(env, dict) and not env.get("gpu")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_label(meta: dict) -> str:
    """``NVIDIA H200 (sm_90)`` or ``CPU only (AMD EPYC, 2 cores)``; the machine this runs on when the
    report does not record one."""
    env = meta.get("environment") or {}
    gpu = env.get("gpu")
    if gpu:
        return f"{gpu.get('name', 'GPU')} ({gpu.get('arch', '?')})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU only ({_cpu_model()}, {cores} cores)"
