"""Public ops: ``areal_tik.dispatch.ops.<op>(...)`` dispatches to the selected implementation.

Every op registered by a kernel module (``areal_tik/kernels/<op>.py``, table ``OPS``)
is reachable here by name; the backend chosen is the one ``select_impl`` returns
(triton on a GPU, or the architecture's preferred backend, ``registry.ARCH_PREFERRED``: the
csrc attention pair on sm90; torch_ref on a CPU). Pass
``backend="triton"`` (or ``"cuda"``, ``"torch_ref"``, or a ``Settings.backend`` spec) to any op to demand one
implementation; an unavailable demand raises ``BackendUnavailable``.
"""
from __future__ import annotations

import functools

from areal_tik.dispatch import registry


@functools.lru_cache(maxsize=None)
def _dispatcher(op: str):
    impls = registry.implementations()
    if op not in impls:
        raise AttributeError(f"areal_tik.dispatch.ops has no op {op!r}; registered ops: {sorted(impls)}")

    def call(*args, backend: str | None = None, **kwargs):
        return registry.select_impl(op, backend).fn(*args, **kwargs)

    first = next(iter(impls[op].values()))
    call.__name__ = op
    call.__qualname__ = op
    call.__doc__ = first.doc
    return call


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _dispatcher(name)


def __dir__():
    return sorted(registry.implementations())
