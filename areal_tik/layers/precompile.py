"""Compile, before the first step, every Triton linear tile config a patched model can pick.

The linear op picks its tile config from the row count M (``kernels/linear.py``: tuned M
buckets per (N, K), else a built-in rule). Each config is a separate Triton compile, so a
micro-batch or prefill whose M lands in a bucket not seen before pays a JIT compile (0.3-3 s
for the TMA kernels) inside that step. :func:`precompile_linears` launches each reachable
config once, on small dummy inputs (M is not specialised by the kernels, so any M compiles the
same binary), so that no later step compiles.

What it covers: every ``TikLinear`` shape of the model for M in ``[1, max_tokens]``. It does not
change any result (dummy tensors only; the model's weights are only read for their shapes).
``Settings.precompile = False`` (``actor.tik.precompile=false``, ``serve --no-precompile``) turns it off.
"""
from __future__ import annotations

import logging
import time

import torch

from areal_tik.kernels import jit_watch

__all__ = ["linear_shapes", "linear_config_names", "precompile_linears"]

logger = logging.getLogger("areal_tik.precompile")


def linear_shapes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[tuple[int, int, torch.dtype, bool]]:
    """Distinct ``(N, K, dtype, has_bias)`` of the model's ``TikLinear`` modules (global shapes:
    a DTensor-sharded weight reports the full one). ``dtype``: the dtype the forward runs in,
    when it is not the stored weights' (FSDP2 keeps fp32 masters and computes in bf16)."""
    from areal_tik.layers.modules import TikLinear
    seen = []
    for m in model.modules():
        if isinstance(m, TikLinear):
            n, k = (int(s) for s in m.weight.shape)
            key = (n, k, dtype or m.weight.dtype, m.bias is not None)
            if key not in seen:
                seen.append(key)
    return seen


def _m_grid(m_min: int, m_max: int) -> list[int]:
    """Row counts that reach every bucket between m_min and m_max: every M up to 512 (the
    decode/medium rules), then every multiple of 128 (all tuned bounds and the built-in rule's
    tile-count threshold are multiples of 128), then m_max."""
    ms = set(range(max(1, m_min), min(512, m_max) + 1))
    ms.update(range(max(512, m_min - m_min % 128), m_max + 1, 128))
    ms.add(m_max)
    return sorted(m for m in ms if m_min <= m <= m_max)


def linear_config_names(n: int, k: int, arch: str, m_min: int, m_max: int, dtype=torch.bfloat16) -> list[str]:
    """The tile configs ``linear_fwd`` can pick for ``[M, k] x [k, n]`` with m_min <= M <= m_max."""
    from areal_tik.kernels.linear import config_name_for
    return sorted({config_name_for(m, n, k, dtype, arch) for m in _m_grid(m_min, m_max)})


def precompile_linears(model: torch.nn.Module, max_tokens: int, min_tokens: int = 1,
                       device: torch.device | str | None = None, progress: bool = False,
                       dtype: torch.dtype | None = None, enabled: bool = True) -> dict:
    """Launch each reachable linear config of ``model`` once (CUDA only; a no-op elsewhere and when
    ``enabled`` is False, ``Settings.precompile``).
    ``dtype``: the compute dtype when it differs from the stored weights' (see :func:`linear_shapes`).

    Returns ``{"shapes", "configs", "compiles", "compile_s", "seconds"}``; ``compiles`` counts
    the Triton compilations this caused (0 when all were compiled already, in memory)."""
    from areal_tik.kernels import linear as lin
    from areal_tik.kernels._dense_common import interpreting
    dev = torch.device(device) if device is not None else None
    if dev is None:
        p = next(model.parameters(), None)
        dev = p.device if p is not None and p.device.type == "cuda" else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    shapes = linear_shapes(model, dtype)
    res = {"shapes": len(shapes), "configs": 0, "compiles": 0, "compile_s": 0.0, "seconds": 0.0}
    if dev.type != "cuda" or interpreting() or not shapes or not enabled:
        return res
    jit_watch.install()
    before, t0 = jit_watch.snapshot(), time.perf_counter()
    arch = lin._arch_of(dev)
    work = [(n, k, dt, hb, name) for n, k, dt, hb in shapes
            for name in linear_config_names(n, k, arch, min_tokens, max_tokens, dt)]
    it = work
    if progress:
        from tqdm import tqdm
        it = tqdm(work, desc="precompiling linear configs", unit="cfg")
    with torch.cuda.device(dev), torch.no_grad():
        m = 64
        for n, k, dt, hb, name in it:
            w = torch.zeros((n, k), dtype=dt, device=dev)
            b = torch.zeros((n,), dtype=dt, device=dev) if hb else None
            x = torch.zeros((m, k), dtype=dt, device=dev)
            lin.linear_fwd(x, w, b, config=name)
            del w, b, x
        torch.cuda.synchronize(dev)
    d = jit_watch.delta(before)
    res.update(configs=len(work), compiles=d["compiles"], compile_s=d["seconds"],
               seconds=round(time.perf_counter() - t0, 3))
    logger.info("precompiled %d linear configs over %d shapes (M %d..%d) in %.1fs, %d compiles",
                res["configs"], res["shapes"], min_tokens, max_tokens, res["seconds"], res["compiles"])
    return res
