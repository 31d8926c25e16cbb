"""Arms of a kernels A/B inside one process: ``KERNELS[@BACKEND_SPEC]``.

``default`` / ``tik`` pick ``patch_model(kernels=...)``; an optional ``@spec`` is the
``AREAL_TIK_BACKEND`` value set while that arm is built and measured (the registry reads
it at every op call, so an arm's CUDA graphs capture its own backends), e.g.
``tik@attention_varlen=cuda,attention_paged=cuda``. Used by bench_engine and probes/profile_train.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from areal_tik.dispatch.registry import ENV_VAR, parse_backend_spec

KERNELS = ("default", "tik")


@dataclasses.dataclass(frozen=True)
class Arm:
    label: str
    kernels: str
    spec: str | None

    @contextlib.contextmanager
    def active(self):
        """``AREAL_TIK_BACKEND`` = this arm's spec (unset without one) for the block; restored after."""
        old = os.environ.get(ENV_VAR)
        if self.spec is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = self.spec
        try:
            yield self
        finally:
            if old is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = old


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
