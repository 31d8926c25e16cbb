"""``BoundOps``: every op's implementation chosen once, for one backend spec.

``patch_model`` binds one ``BoundOps`` to a model; its layers, its log-prob head and the
engine's sampler call ``model_ops.linear(...)`` etc., so nothing re-selects an implementation
per call, and the model's selection is exactly what :func:`fingerprint.compute` hashes for the
same spec.
"""
from __future__ import annotations

from typing import Callable

from areal_tik.dispatch import registry

__all__ = ["BoundOps", "bind"]


class BoundOps:
    """Attribute access gives each op's selected callable (``ops.linear(x, w, b)``).

    Every registered op is selected when the object is built, under ``backend`` (a
    ``Settings.backend`` spec or None); an op the spec makes unavailable raises
    ``BackendUnavailable`` at that point, never at a forward."""

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self.impls: dict[str, registry.ImplInfo] = {op: registry.select_impl(op, backend)
                                                    for op in sorted(registry.implementations())}
        for op, info in self.impls.items():
            setattr(self, op, info.fn)

    def __getattr__(self, name: str) -> Callable:   # only reached for names not bound above
        raise AttributeError(f"no op {name!r}; bound ops: {sorted(self.impls)}")

    def check_shapes(self, head_dim: int, page_size: int | None = None) -> None:
        """Raise ``ValueError`` (one line) if a bound implementation cannot keep its contract at this head dim
        (and KV page size): ``patch_model`` and the engine call it before touching a layer or allocating a cache."""
        for check in dict.fromkeys(i.check_shapes for i in self.impls.values() if i.check_shapes is not None):
            check(head_dim, page_size)

    @property
    def selection(self) -> dict[str, str]:
        """op -> backend name."""
        return {op: info.backend for op, info in self.impls.items()}

    def __repr__(self) -> str:
        return f"BoundOps(backend={self.backend!r}, {self.selection})"


def bind(backend: str | None = None) -> BoundOps:
    return BoundOps(backend)
