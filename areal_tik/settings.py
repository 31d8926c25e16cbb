"""The one settings object of a process, read once at its entry point and passed down.

``Settings`` names every choice that changes what runs:

- ``kernels``: ``"tik"`` (rollout and training on the same batch-invariant kernels) or
  ``"default"`` (HF's own math, the baseline). AReaL users set it as ``actor.kernel_backend``;
  inside the package the axis is always called ``kernels``.
- ``backend``: which implementation family runs each op, ``triton`` | ``cuda`` | ``torch_ref`` |
  ``fa3`` (the attention pair only: FlashAttention-3 from vLLM, one walk over the keys), as a spec:
  ``None`` (each op takes its measured default), ``"triton"`` (every op), or
  ``"attention_varlen=triton,attention_paged=triton"`` (per op; ``attention=`` names both ops of the
  attention pair, e.g. ``"attention=fa3"``). The environment variable ``AREAL_TIK_BACKEND`` is the one
  documented environment setting; :meth:`Settings.from_env` reads it only when the caller passes no
  ``backend`` (an explicit value, ``actor.tik.backend`` or ``serve --backend``, wins).
- ``attention_backward``: the training attention's backward kernel, ``auto`` | ``flash`` |
  ``triton`` (``auto``: PyTorch's flash backward where it runs and deterministic algorithms are
  off, else our bitwise-repeatable Triton backward). Not under the bit contract.
- ``precompile``: compile every linear tile config a process can pick before its first step.
- ``profile_step``: record this trainer step under ``torch.profiler`` (``None``: never).
- ``server_device``: the device of a rollout server the trainer launches (``None``: the
  trainer's; AReaL's ``xccl`` weight updates need another GPU, e.g. ``cuda:1``).

Nothing below the entry points reads the environment for these: the CLI and the AReaL entry
point build one ``Settings``, the server child receives it as flags (:meth:`server_flags`).
This module imports nothing from the package, so every floor may take it as an argument.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

__all__ = ["Settings", "SettingsError", "BACKEND_ENV", "KERNELS", "BACKENDS", "OP_GROUPS", "ATTENTION_BACKWARDS",
           "parse_backend_spec"]

BACKEND_ENV = "AREAL_TIK_BACKEND"
KERNELS = ("tik", "default")
BACKENDS = ("triton", "cuda", "torch_ref", "fa3")
# A spec's group names: one name for ops that must run on one backend (their bits agree between rollout and training)
OP_GROUPS = {"attention": ("attention_varlen", "attention_paged")}
ATTENTION_BACKWARDS = ("auto", "flash", "triton")


class SettingsError(ValueError):
    """A setting with a value outside its choices (the message says which and how to fix it)."""


def parse_backend_spec(spec: str | None) -> dict[str, str]:
    """``None``/``""`` -> {}; ``"triton"`` -> ``{"*": "triton"}``; ``"linear=cuda, rms_norm=triton"``
    -> per op; a group name (:data:`OP_GROUPS`: ``"attention=fa3"``) -> each of its ops. Raises
    :class:`SettingsError` on an unknown backend name, an empty op name, or a spec that gives the ops of one
    group different backends (a group's ops compute bits that must agree with each other)."""
    out: dict[str, str] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        op, eq, be = part.rpartition("=")
        op, be = op.strip(), be.strip()
        if eq and not op:
            raise SettingsError(f"backend spec {spec!r}: '{part}' names no op (write op=backend)")
        if be not in BACKENDS:
            raise SettingsError(f"backend spec {spec!r} names unknown backend {be!r}; choose from "
                                f"{', '.join(BACKENDS)} (e.g. 'triton' or 'attention_paged=triton')")
        for name in OP_GROUPS.get(op, (op or "*",)):
            out[name] = be
    for group, members in OP_GROUPS.items():
        chosen = {m: out.get(m, out.get("*")) for m in members}
        if len(set(chosen.values())) > 1:
            named = ", ".join(f"{m}={b or 'its default'}" for m, b in chosen.items())
            raise SettingsError(f"backend spec {spec!r} splits the {group} pair ({named}): its ops must run on one "
                                f"backend, their bits must agree between rollout and training (write "
                                f"'{group}=<backend>')")
    return out


@dataclasses.dataclass(frozen=True)
class Settings:
    kernels: str = "tik"
    backend: str | None = None
    attention_backward: str = "auto"
    precompile: bool = True
    profile_step: int | None = None
    server_device: str | None = None

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise SettingsError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        parse_backend_spec(self.backend)
        if self.attention_backward not in ATTENTION_BACKWARDS:
            raise SettingsError(f"attention_backward must be one of {ATTENTION_BACKWARDS}, got "
                                f"{self.attention_backward!r}")
        if self.profile_step is not None and (isinstance(self.profile_step, bool) or
                                              not isinstance(self.profile_step, int) or self.profile_step < 0):
            raise SettingsError(f"profile_step must be a step number >= 0 or None, got {self.profile_step!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields) -> "Settings":
        """Settings from explicit ``fields``, with ``backend`` taken from ``AREAL_TIK_BACKEND`` when
        the caller gave none. The only environment read of the package's settings."""
        environ = os.environ if environ is None else environ
        if fields.get("backend") is None and environ.get(BACKEND_ENV):
            fields["backend"] = environ[BACKEND_ENV]
        return cls(**fields)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)

    def server_flags(self) -> list[str]:
        """The flags that give an ``areal-tik serve`` child these settings (its entry point parses
        them back with the same validation)."""
        flags = ["--kernels", self.kernels, "--attention-backward", self.attention_backward]
        if self.backend:
            flags += ["--backend", self.backend]
        if not self.precompile:
            flags.append("--no-precompile")
        return flags
