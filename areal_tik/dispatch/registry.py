"""Registry of op implementations: triton, cuda (csrc/), torch_ref, and fa3 (the attention pair on vLLM's
FlashAttention-3, selectable only).

Every op the model uses (``linear``, ``rms_norm``, ``attention``, ...) has one or more
implementations, each registered with an :class:`ImplInfo`. :func:`select_impl` picks
one per op; the same choice must hold on the rollout side and the trainer side, and the
fingerprint (``dispatch/fingerprint.py``) records it.

Selection: an explicit request (``Settings.backend``, e.g. ``triton`` or
``attention_paged=triton``, which the entry point takes from ``AREAL_TIK_BACKEND``)
that cannot be met raises :class:`BackendUnavailable` — never a silent fallback to a
different numerical path. Without a request, ops take their architecture's preferred
backend (``ARCH_PREFERRED``, where measured faster) when it is available, else the first
available backend of ``DEFAULT_ORDER`` (GPU) or ``torch_ref`` (no GPU). ``fa3`` is in neither: it runs only
when a spec names it (``attention=fa3``; docs/design.md says why it is not a default). Ops whose bits must
agree across rollout and training (the attention pair) are listed together, so they move
together; availability is per backend, so they fall back together too.

Agent exports (``areal_tik/kernels/exported/<op>_<arch>.py``, see :func:`_load_exported`)
replace an op's implementation on a GPU of that architecture; the fingerprint covers them.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import pkgutil
from typing import Callable

from areal_tik.dispatch import availability
from areal_tik.kernels import module_sources, op_modules
from areal_tik.kernels._device import gpu_arch_name
from areal_tik.settings import BACKEND_ENV, BACKENDS, SettingsError
from areal_tik.settings import parse_backend_spec as _parse

__all__ = [
    "ImplInfo", "BackendUnavailable", "register", "select_impl", "implementations",
    "backend_status", "BACKENDS", "parse_backend_spec",
]

DEFAULT_ORDER = ("triton", "cuda", "torch_ref")
# Per GPU architecture (``gpu_arch_name()``), ops whose default is another backend than DEFAULT_ORDER's first,
# because it measured faster there (docs/results.md). sm90 (H100/H200), the csrc attention pair: the wgmma
# prefill 1.23-1.31x Triton at L 4K-16K, decode faster in 14 of 16 bench cells, training forward 1.02-1.04x;
# at the engine's shapes (12/2 heads) a wash (decode 0.90-1.03x per kernel, 0.514 vs 0.521 ms of attention
# per B=64 decode step). Not sm80: its csrc prefill is the mma.sync kernel. The two ops move together (their
# bits must agree between rollout and training) and fall back together (cuda availability is one extension).
ARCH_PREFERRED: dict[str, dict[str, str]] = {
    "sm90": {"attention_varlen": "cuda", "attention_paged": "cuda"},
}


class BackendUnavailable(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ImplInfo:
    """One implementation of one op.

    ``sources`` are files whose text defines the numerics (hashed into the fingerprint);
    ``meta`` holds meta-parameters that change bits (block sizes of reductions);
    ``available`` returns ``(ok, reason)``; ``check_shapes(head_dim, page_size=None)``, when the
    implementation has shape limits beyond its call-time checks, raises ``ValueError`` (one line) for a
    model or cache it cannot keep its contract on (``BoundOps.check_shapes`` runs it up front);
    ``tile_configs(n, k, dtype, m_min, m_max, device) -> [name]``, for an implementation that compiles one kernel
    per tile config and takes ``config=name``, lists the configs calls in that row range can compile (what
    ``layers/precompile.py`` launches the bound op with); ``moe_experts``' is
    ``tile_configs(num_experts, top_k, t_min, t_max) -> [token count]``, one token count per tile it can compile.
    """

    op: str
    backend: str
    fn: Callable
    sources: tuple[str, ...] = ()
    meta: tuple[tuple[str, object], ...] = ()
    available: Callable[[], tuple[bool, str]] = lambda: (True, "")
    doc: str = ""
    check_shapes: Callable | None = None
    tile_configs: Callable | None = None


_REGISTRY: dict[str, dict[str, ImplInfo]] = {}


def register(info: ImplInfo) -> ImplInfo:
    if info.backend not in BACKENDS:
        raise ValueError(f"unknown backend {info.backend!r}; expected one of {BACKENDS}")
    _REGISTRY.setdefault(info.op, {})[info.backend] = info
    return info


_LOADED = False


def _ensure_loaded() -> None:
    """Discover every kernel module's ``OPS`` table (kernels never import the backend).

    A kernel module declares ``OPS = {op_name: {backend_name: callable}}`` and optionally
    ``META`` (bit-defining meta-parameters), ``CUDA_SOURCES`` (csrc files its cuda
    implementation is built from), ``CHECK_SHAPES`` (its implementations' shape limits,
    :attr:`ImplInfo.check_shapes`), ``TILE_CONFIGS`` (``{op: {backend: fn}}``, :attr:`ImplInfo.tile_configs`)
    and ``USES`` (the other op modules its implementations call: their sources join this op's, so the
    fingerprint follows them whatever is bound for their own ops).
    """
    global _LOADED
    if _LOADED:
        return

    avail = {be: functools.partial(availability.status, be) for be in BACKENDS}
    for name in op_modules():
        mod = importlib.import_module(name)
        for op, impls in getattr(mod, "OPS", {}).items():
            for be, fn in impls.items():
                srcs = module_sources(mod)
                for used in getattr(mod, "USES", ()):
                    srcs += module_sources(importlib.import_module(used))
                if be == "cuda":
                    srcs += list(getattr(mod, "CUDA_SOURCES", ()))
                meta = tuple(sorted(getattr(mod, "META", {}).items()))
                register(ImplInfo(op=op, backend=be, fn=fn, sources=tuple(srcs), meta=meta,
                                  available=avail[be], doc=(fn.__doc__ or ""),
                                  check_shapes=getattr(mod, "CHECK_SHAPES", None),
                                  tile_configs=getattr(mod, "TILE_CONFIGS", {}).get(op, {}).get(be)))
    _load_exported(avail)
    _LOADED = True


def _gpu_arch() -> str | None:
    """The current device's ``sm90``-style name (cached per device index: select_impl runs per op call)."""
    import torch  # lazy: keeps torch out of this module's import
    if not _has_gpu():
        return None
    return _gpu_arch_of(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_arch_of(device_index: int) -> str | None:
    import torch  # lazy: keeps torch out of this module's import
    with torch.cuda.device(device_index):
        return gpu_arch_name()


def _load_exported(avail: dict) -> None:
    """Agent exports: ``areal_tik/kernels/exported/<op>_<arch>.py`` (``areal-tik agent export``).

    On a GPU whose arch matches the file name (e.g. ``linear_sm90.py`` on an H200), the
    module's ``OPS`` replace the op's implementation of that backend. The exported file is
    prepended to the implementation's sources, so the fingerprint includes it; its ``META``
    joins the meta-parameters. Other archs (and CPUs) ignore exports. Delete the file to go back.
    """
    arch = _gpu_arch()
    if arch is None:
        return
    try:
        pkg = importlib.import_module("areal_tik.kernels.exported")
    except ModuleNotFoundError:
        return
    for m in pkgutil.iter_modules(pkg.__path__):
        if not m.name.endswith("_" + arch):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
        for op, impls in getattr(mod, "OPS", {}).items():
            for be, fn in impls.items():
                prev = _REGISTRY.get(op, {}).get(be)
                srcs = (mod.__file__,) + (prev.sources if prev else ())
                meta = tuple(sorted({**dict(prev.meta if prev else ()), **getattr(mod, "META", {})}.items()))
                register(ImplInfo(op=op, backend=be, fn=fn, sources=srcs, meta=meta, available=avail[be],
                                  doc=(fn.__doc__ or ""),
                                  check_shapes=getattr(mod, "CHECK_SHAPES", prev.check_shapes if prev else None),
                                  tile_configs=getattr(mod, "TILE_CONFIGS", {}).get(op, {}).get(be)))


def implementations() -> dict[str, dict[str, ImplInfo]]:
    _ensure_loaded()
    return {op: dict(v) for op, v in _REGISTRY.items()}


def parse_backend_spec(spec: str | None) -> dict[str, str]:
    """``"triton"`` -> {"*": "triton"}; ``"linear=cuda,attention_paged=triton"`` -> per op."""
    return dict(_parsed_spec(spec))


@functools.lru_cache(maxsize=64)
def _parsed_spec(spec: str | None) -> tuple[tuple[str, str], ...]:
    try:
        parsed = _parse(spec)
    except SettingsError as e:
        raise BackendUnavailable(str(e)) from None
    _ensure_loaded()
    unknown = sorted(op for op in parsed if op != "*" and op not in _REGISTRY)
    if unknown:
        raise BackendUnavailable(f"backend spec {spec!r} names unknown op(s) {', '.join(unknown)}; ops: "
                                 f"{', '.join(sorted(_REGISTRY))} (and 'attention' for the attention pair)")
    return tuple(parsed.items())


def select_impl(op: str, backend: str | None = None) -> ImplInfo:
    """The implementation of ``op`` to use. ``backend`` is a backend name or a spec
    (``Settings.backend``: ``"triton"``, ``"attention_paged=triton"``); when it names a backend for
    ``op`` that backend is binding (unavailable -> :class:`BackendUnavailable`), else the op takes
    its default."""
    _ensure_loaded()
    impls = _REGISTRY.get(op)
    if not impls:
        raise KeyError(f"no implementation registered for op {op!r}")
    spec = dict(_parsed_spec(backend)) if backend else {}
    req = spec.get(op, spec.get("*"))
    if req is not None:
        info = impls.get(req)
        if info is None:
            raise BackendUnavailable(f"op {op!r} has no {req!r} implementation (have: {sorted(impls)})")
        ok, why = info.available()
        if not ok:
            raise BackendUnavailable(f"op {op!r}: backend {req!r} requested but unavailable: {why}")
        return info
    gpu = _has_gpu()
    order = DEFAULT_ORDER if gpu else ("torch_ref",)
    arch = (_gpu_arch() or "") if gpu else ""
    pref = ARCH_PREFERRED.get(arch, {}).get(op)
    if pref is not None:
        order = (pref,) + tuple(b for b in order if b != pref)
    for be in order:
        info = impls.get(be)
        ok, why = info.available() if info is not None else (False, "not registered")
        if ok:
            return info
        if be == pref:
            _warn_preferred_unavailable(arch, pref, why)
    raise BackendUnavailable(f"op {op!r}: no available implementation among {sorted(impls)}")


_WARNED_PREFERRED: set[tuple[str, str]] = set()


def _warn_preferred_unavailable(arch: str, backend: str, why: str) -> None:
    """Once per (arch, backend): say that the architecture's preferred backend cannot run here and why
    (its ops then take DEFAULT_ORDER's first available backend, together)."""
    if (arch, backend) in _WARNED_PREFERRED:
        return
    _WARNED_PREFERRED.add((arch, backend))
    ops = sorted(op for op, be in ARCH_PREFERRED.get(arch, {}).items() if be == backend)
    logging.getLogger("areal_tik.dispatch").warning(
        "areal-tik: %s prefers the %s backend for %s, but it is unavailable here (%s); those ops run on the "
        "next available backend instead (set %s to choose explicitly)", arch, backend, ", ".join(ops), why, BACKEND_ENV)


def _has_gpu() -> bool:
    """torch.cuda.is_available(), asked once per process (it reads os.environ on every call, and
    select_impl runs per op call: cProfile of one 1.5B-shape eager prefill on the H200 counted 990 calls for 396
    op calls, 5 ms of its 60 ms under the profiler)."""
    return _cuda_available()


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    try:
        import torch  # lazy: keeps torch out of this module's import
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def backend_status() -> dict[str, tuple[bool, str]]:
    """Whether each backend can run here, with the reason when it cannot."""
    return {be: availability.status(be) for be in BACKENDS}
