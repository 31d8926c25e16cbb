"""The rollout engines a run can use, by name: one :class:`RolloutEngine` entry each, looked up by the trainer,
the train entry point, the config checks, ``areal-tik verify``, the A/B and the rollout benchmark.

An engine is a name (``tik``: ``areal-tik serve``, our engine; ``vllm``: AReaL's vLLM server, stock or with the
tik plugin; ``sglang``: AReaL's own SGLang) and the facts and hooks the rest of the package needs:

- ``rollout_backend``: the AReaL client family it speaks (``rollout.backend: <it>:dN...``: ``sglang`` or ``vllm``);
- ``shared_weights``: the kernels with which its servers load the trainer's shared weight buffer
  (``actor.tik.weight_transfer: ipc``);
- ``kernels``: the values of the kernel axis it serves. ``tik`` in it is a promise to the skip rule (design.md
  section 6): with tik kernels its servers answer ``GET /get_server_info`` with ``kernels: tik``, the kernel
  fingerprint, the weight version and the weights digest, so recompute can be skipped; a stock engine
  (``default`` only) is never skipped for;
- hooks, each a callable or a ``"module:attr"`` path imported when first used (so that reading the registry
  imports neither AReaL nor vLLM): ``client`` (the AReaL ``RemoteInfEngine`` class; none: AReaL's own),
  ``server_args(config, settings, parallel)`` (what AReaL's ``launch_server`` receives), ``launch(config,
  settings, log_dir)`` (start one server for the SPMD entry point: ``(Popen, "host:port")``), ``check_config(config)``
  (its checks of a tik run, raising ``ConfigError``), ``verify(request, progress)`` (``areal-tik verify --engine``:
  ``verify.request``), ``offline(model_dir, kernels, **kw)`` (in-process generation: ``verify.offline``) and
  ``available()`` (``(ok, reason)`` on this machine).

The kernel axis (``tik`` | ``default``: which kernels run) is another axis than the engine (which program
serves the rollout): ``tik`` names both our kernels and our engine, and vLLM runs either kernels. How to add an
engine: docs/rollout-engines.md.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Callable

__all__ = ["RolloutEngine", "EngineError", "register", "unregister", "get", "names", "all_engines", "select",
           "for_config", "engine_name_key"]

Hook = Callable | str | None


class EngineError(ValueError):
    """An engine name or choice that cannot be met (the message names the choices)."""


@dataclasses.dataclass(frozen=True)
class RolloutEngine:
    name: str
    rollout_backend: str
    kernels: tuple[str, ...]
    summary: str
    # the kernels with which its servers load the trainer's shared buffer (POST /update_weights_from_ipc,
    # actor.tik.weight_transfer=ipc); empty: none
    shared_weights: tuple[str, ...] = ()
    package: str | None = None          # the distribution whose version describes it (the A/B's records)
    server_log: str | None = None       # the log file of a server the SPMD entry point starts
    client: Hook = None
    server_args: Hook = None
    launch: Hook = None
    check_config: Hook = None
    verify: Hook = None
    offline: Hook = None
    available: Hook = None

    def hook(self, name: str) -> Callable | None:
        """The hook ``name`` as a callable (a ``"module:attr"`` path imported now), or None when absent."""
        h = getattr(self, name)
        if h is None or callable(h):
            return h
        mod, _, attr = h.partition(":")
        return getattr(importlib.import_module(mod), attr)

    def need(self, name: str) -> Callable:
        """The hook ``name``; :class:`EngineError` naming the engine when it has none."""
        h = self.hook(name)
        if h is None:
            raise EngineError(f"rollout engine {self.name!r} has no {name!r} hook")
        return h

    def runs_here(self) -> tuple[bool, str]:
        """``(ok, reason)`` from the ``available`` hook (no hook: available)."""
        h = self.hook("available")
        return (True, "") if h is None else tuple(h())

    def takes_shared_weights(self, kernels: str) -> bool:
        """Whether its servers, on ``kernels``, load the trainer's shared buffer (``actor.tik.weight_transfer:
        ipc``): the areal-tik server on either kernels, vLLM only with the tik plugin's worker extension."""
        return kernels in self.shared_weights

    def serves(self, kernels: str) -> bool:
        """Whether it runs ``kernels`` (``tik``: its servers report what the skip rule checks)."""
        return kernels in self.kernels


_ENGINES: dict[str, RolloutEngine] = {}


def register(engine: RolloutEngine) -> RolloutEngine:
    """Add ``engine`` (a new name goes last: automatic selection prefers earlier entries); a name already taken is
    an :class:`EngineError` (``unregister`` it first)."""
    if engine.name in _ENGINES:
        raise EngineError(f"rollout engine {engine.name!r} is already registered")
    _ENGINES[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    _ENGINES.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def all_engines() -> tuple[RolloutEngine, ...]:
    return tuple(_ENGINES.values())


def get(name: str) -> RolloutEngine:
    if name not in _ENGINES:
        raise EngineError(f"unknown rollout engine {name!r}; registered: {', '.join(_ENGINES)}")
    return _ENGINES[name]


def select(rollout_backend: str, kernels: str, name: str | None = None) -> RolloutEngine:
    """The engine a run uses. ``name`` (``actor.tik.rollout_engine``): that engine, which must speak
    ``rollout_backend`` and serve ``kernels``. Without one: among the engines that do, in registration order, the
    first that runs here (its ``available`` hook), else the last of them (the fallback: its launch reports what is
    missing), so ``sglang:...`` with default kernels is AReaL's SGLang when installed and ``areal-tik serve``
    otherwise."""
    if name:
        e = get(name)
        if e.rollout_backend != rollout_backend or not e.serves(kernels):
            raise EngineError(f"rollout engine {name!r} runs behind rollout.backend {e.rollout_backend}:... on "
                              f"kernels {'/'.join(e.kernels)}; this run has {rollout_backend}:... and {kernels} kernels")
        return e
    fits = [e for e in _ENGINES.values() if e.rollout_backend == rollout_backend and e.serves(kernels)]
    if not fits:
        have = ", ".join(f"{e.name} ({e.rollout_backend}, kernels {'/'.join(e.kernels)})" for e in _ENGINES.values())
        raise EngineError(f"no rollout engine serves rollout.backend {rollout_backend}:... with {kernels} kernels; "
                          f"registered: {have}")
    return next((e for e in fits[:-1] if e.runs_here()[0]), fits[-1])


def engine_name_key(config) -> str | None:
    """``actor.tik.rollout_engine`` of an experiment config (None: chosen by :func:`select`)."""
    return getattr(getattr(getattr(config, "actor", None), "tik", None), "rollout_engine", None)


def for_config(config) -> RolloutEngine:
    """The engine of an AReaL experiment config: ``rollout.backend``'s family, ``actor.kernel_backend``, and
    ``actor.tik.rollout_engine`` when set."""
    backend = str(config.rollout.backend).split(":", 1)[0].strip()
    return select(backend, getattr(config.actor, "kernel_backend", "default"), engine_name_key(config))


def _package_status(package: str) -> tuple[bool, str]:
    found = importlib.util.find_spec(package) is not None
    return found, f"{package} {'is' if found else 'is not'} importable here"


def _sglang_available() -> tuple[bool, str]:
    return _package_status("sglang")


# ---- the built-in engines, in preference order (select() takes the first that fits and runs here) ----------
BUILTIN: tuple[dict[str, Any], ...] = (
    dict(name="vllm", rollout_backend="vllm", kernels=("tik", "default"), shared_weights=("tik",), package="vllm",
         server_log="vllm_server.log",
         summary="AReaL's vLLM server (python -m areal_tik.areal.vllm_server): stock, or with the tik plugin",
         client="areal_tik.areal.vllm_launch:TikRemotevLLMEngine",
         server_args="areal_tik.areal.vllm_launch:server_args_for", launch="areal_tik.areal.vllm_launch:launch_for",
         check_config="areal_tik.areal.vllm_launch:check_tik_config",
         verify="areal_tik.verify.vllm_parity:verify_vllm", offline="areal_tik.verify.offline:VLLMEngine",
         available="areal_tik.vllm_plugin:available"),
    dict(name="sglang", rollout_backend="sglang", kernels=("default",), package="sglang",
         summary="AReaL's own SGLang client and server (default kernels; AReaL launches it)",
         available=_sglang_available),
    dict(name="tik", rollout_backend="sglang", kernels=("tik", "default"), shared_weights=("tik", "default"),
         server_log="tik_server.log",
         summary="areal-tik serve: our engine behind SGLang's HTTP API, on the trainer's kernels",
         client="areal_tik.areal.rollout:TikRemoteSGLangEngine", server_args="areal_tik.areal.rollout:server_args_for",
         launch="areal_tik.areal.rollout:launch_for", verify="areal_tik.verify.request:verify_ours",
         offline="areal_tik.verify.offline:OurEngine"),
)
for _spec in BUILTIN:
    register(RolloutEngine(**_spec))
