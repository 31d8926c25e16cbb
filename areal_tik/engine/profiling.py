"""Summaries of ``torch.profiler`` runs (a leaf module: the bench scripts and the trainer's
profiled step both use it)."""
from __future__ import annotations

__all__ = ["profiler_activities", "summarize_profile", "profile_tables"]


def profiler_activities() -> list:
    """``torch.profiler`` activities for this machine: CPU, plus CUDA when a GPU is there."""
    import torch  # lazy: keeps torch out of this module's import
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def summarize_profile(prof, steps: int, top: int = 15) -> dict:
    """Device-busy ms per step and the top device / host ops of a ``torch.profiler`` run over
    ``steps`` steps. Device time = the device-side (kernel/memcpy) events only, as torch's own
    table sums it: a CPU op's self device time repeats its kernels' time, summing both would
    double-count."""
    from torch.autograd import DeviceType  # lazy: keeps torch out of this module's import

    def on_device(e):
        return getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU and not getattr(e, "is_user_annotation",
                                                                                             False)
    kernels_total = sum(e.self_device_time_total for e in prof.events() if on_device(e))
    ev = prof.key_averages()
    dev_rows = sorted((e for e in ev if on_device(e)), key=lambda e: e.self_device_time_total, reverse=True)[:top]
    cpu_rows = sorted((e for e in ev if not on_device(e)), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"device_busy_ms_per_step": kernels_total / 1e3 / steps,
            "top_device_ops": [{"name": e.key, "ms_per_step": e.self_device_time_total / 1e3 / steps,
                                "calls_per_step": e.count / steps} for e in dev_rows],
            "top_host_ops": [{"name": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                              "calls_per_step": e.count / steps} for e in cpu_rows]}


def profile_tables(prof, title: str, top: int = 30) -> str:
    """Plain-text tables of one profiled interval: device busy time, top device ops, top host ops."""
    s = summarize_profile(prof, 1, top)
    lines = [f"# {title}", f"device busy {s['device_busy_ms_per_step']:.1f} ms", "", "## top device ops (self ms, calls)"]
    lines += [f"{r['ms_per_step']:10.2f} ms  x{r['calls_per_step']:<6.0f} {r['name'][:120]}" for r in s["top_device_ops"]]
    lines += ["", "## top host ops (self ms, calls)"]
    lines += [f"{r['self_ms_per_step']:10.2f} ms  x{r['calls_per_step']:<6.0f} {r['name'][:120]}" for r in s["top_host_ops"]]
    return "\n".join(lines) + "\n"
