"""Count Triton JIT compilations in this process.

A Triton kernel compiles (or loads from the on-disk cache) the first time it is launched with
a new specialization: new constexprs (a tile config picked for a new M bucket), an integer
argument that became 1 or a multiple of 16, a pointer that lost 16-byte alignment. A compile
inside an RL step costs 0.1-3 s and shows up as a sporadic slow step; the A/B logs these counts
per step (trainer) and per rollout (server) so slow kernels and compiles can be told apart. The last
:data:`RECENT` compiles keep Triton's description of what was specialised (constexprs, argument types,
16-divisibility), so a compile that a precompile should have covered names its own cause.

:func:`install` sets Triton's ``jit_cache_hook`` / ``jit_post_compile_hook`` (only when nobody
else has, and only on a Triton that has them); :func:`snapshot` returns the running totals.
Launches that hit the in-memory kernel cache never reach the hooks: zero cost when nothing
compiles. The interpreter (``TRITON_INTERPRET=1``) never compiles, so counts stay 0 there.
"""
from __future__ import annotations

import collections
import threading
import time

__all__ = ["install", "snapshot", "delta"]

_lock = threading.Lock()
RECENT = 16
_state = {"compiles": 0, "seconds": 0.0, "by_kernel": collections.Counter(), "installed": False,
          "recent": collections.deque(maxlen=RECENT)}
_started = threading.local()


def _on_cache_miss(*_args, **_kw):
    _started.t0 = time.perf_counter()
    return False  # never skip the compile


def _on_compiled(*_args, **kw):
    dt = time.perf_counter() - getattr(_started, "t0", time.perf_counter())
    fn = kw.get("fn")
    name = str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or "?")
    spec = kw.get("repr")
    with _lock:
        _state["compiles"] += 1
        _state["seconds"] += dt
        _state["by_kernel"][name.rsplit(".", 1)[-1]] += 1
        _state["recent"].append((_state["compiles"], str(spec) if spec else name.rsplit(".", 1)[-1]))
    return None


def install() -> bool:
    """Start counting; True when the hooks are (now or already) ours."""
    if _state["installed"]:
        return True
    try:
        from triton import knobs  # lazy: keeps triton out of this module's import
        rt = knobs.runtime
        if not (hasattr(rt, "jit_cache_hook") and hasattr(rt, "jit_post_compile_hook")):
            return False
        if rt.jit_cache_hook is not None or rt.jit_post_compile_hook is not None:
            return False  # someone else's hooks: leave them alone
        rt.jit_cache_hook = _on_cache_miss
        rt.jit_post_compile_hook = _on_compiled
    except Exception:  # noqa: BLE001 - an old or odd Triton: no counts, nothing broken
        return False
    _state["installed"] = True
    return True


def snapshot() -> dict:
    """Totals so far: ``{"compiles": int, "seconds": float, "by_kernel": {name: n}, "installed": bool,
    "recent": [(ordinal, Triton's description of the specialisation)]}`` (the last :data:`RECENT` compiles;
    ``installed`` False: the hooks were taken or missing, the counts mean nothing)."""
    with _lock:
        return {"compiles": _state["compiles"], "seconds": round(_state["seconds"], 4),
                "by_kernel": dict(_state["by_kernel"]), "installed": _state["installed"],
                "recent": list(_state["recent"])}


def delta(before: dict, after: dict | None = None) -> dict:
    """What compiled between two snapshots (``after`` defaults to now); ``specs``: the descriptions of those
    compiles still among the last :data:`RECENT`."""
    after = snapshot() if after is None else after
    kern = {k: n - before["by_kernel"].get(k, 0) for k, n in after["by_kernel"].items()}
    return {"compiles": after["compiles"] - before["compiles"],
            "seconds": round(after["seconds"] - before["seconds"], 4),
            "by_kernel": {k: n for k, n in kern.items() if n}, "installed": after["installed"],
            "specs": [spec for i, spec in after.get("recent", []) if i > before["compiles"]]}
