"""Arms of a kernels A/B inside one process: ``KERNELS[@BACKEND_SPEC]``.

``default`` / ``tik`` pick ``patch_model(kernels=...)``; an optional ``@spec`` is the backend spec
(``Settings.backend``) the arm's model is patched with (``patch_model(..., backend=arm.spec)``: the ops
are bound then, so an arm's CUDA graphs capture its own backends), e.g.
``tik@attention_varlen=cuda,attention_paged=cuda``. Used by bench_engine and the profile probes.
"""
from __future__ import annotations

import dataclasses

from areal_tik.dispatch.registry import parse_backend_spec

KERNELS = ("default", "tik")


@dataclasses.dataclass(frozen=True)
class Arm:
    label: str
    kernels: str
    spec: str | None


def parse_arm(text: str) -> Arm:
    kernels, sep, spec = text.partition("@")
    if kernels not in KERNELS:
        raise ValueError(f"arm {text!r}: kernels must be one of {KERNELS}")
    if sep and not spec:
        raise ValueError(f"arm {text!r}: empty backend spec after '@'")
    if sep and kernels != "tik":
        raise ValueError(f"arm {text!r}: a backend spec only applies to tik kernels")
    if spec:
        parse_backend_spec(spec)  # unknown backend names fail here, before any GPU work
    return Arm(label=text, kernels=kernels, spec=spec or None)


def parse_arms(texts: list[str]) -> list[Arm]:
    arms = [parse_arm(t) for t in texts]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate arms: {labels}")
    return arms
