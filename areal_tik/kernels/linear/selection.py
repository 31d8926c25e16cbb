"""Which tile config runs for an ``[M, K] x [K, N]`` problem (speed only, never bits): the rule of
``linear_tuned.json`` (this package; written by ``bench/tune_linear.py``) for (arch, N, K) when
it has one, else the built-in default of :mod:`.configs`; fp32 has its own small family, and
the CPU interpreter always uses one fixed config."""
from __future__ import annotations

import functools
import json
import os

import torch

from areal_tik.kernels import interpreting
from areal_tik.kernels.linear.configs import (
    CONFIGS, CONFIGS_FP32, INTERPRETER_CONFIG, TMA_KERNELS, arch_has_tma, default_config_name,
)


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> tuple[str, int]:
    """(arch "sm_90", SM count) of a CUDA device; speed-only inputs (which tile), never bits."""
    p = torch.cuda.get_device_properties(index)
    return f"sm_{p.major}{p.minor}", p.multi_processor_count


def _arch_of(device) -> str:
    if device is None or getattr(device, "type", "cuda") != "cuda" or not torch.cuda.is_available():
        return "sm_90"
    return device_info(device.index if device.index is not None else torch.cuda.current_device())[0]


# ---- tuned table: areal_tik/kernels/linear/linear_tuned.json, written by bench/tune_linear.py
TUNED_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "linear_tuned.json")


def _load_table_text(path: str = TUNED_TABLE_PATH) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def parse_tuned_table(text: str) -> dict:
    """``{arch: {(N, K): [(M_max or None, config_name), ...]}}`` from the JSON table.

    Format (``format: 1``): ``{"format": 1, "archs": {"sm_90": {"rules": [{"N": .., "K": ..,
    "buckets": [[M_max, "cfg"], ..., [null, "cfg"]]}, ...], ...provenance}}}``; buckets
    ascend by M_max (``null`` = no upper bound). Unknown config names and malformed rules
    raise: a table is committed on purpose and must not be half-applied silently.
    """
    if not text.strip():
        return {}
    d = json.loads(text)
    if d.get("format") != 1:
        raise ValueError(f"{TUNED_TABLE_PATH}: unsupported format {d.get('format')!r}")
    out = {}
    for arch, entry in d.get("archs", {}).items():
        rules = {}
        for r in entry.get("rules", []):
            buckets = [(None if mx is None else int(mx), str(name)) for mx, name in r["buckets"]]
            for _, name in buckets:
                if name not in CONFIGS:
                    raise ValueError(f"tuned table {arch} N={r['N']} K={r['K']}: unknown config {name!r}")
            bounds = [mx for mx, _ in buckets if mx is not None]
            if bounds != sorted(bounds) or any(mx is None for mx, _ in buckets[:-1]):
                raise ValueError(f"tuned table {arch} N={r['N']} K={r['K']}: buckets must ascend, null last")
            rules[(int(r["N"]), int(r["K"]))] = buckets
        out[arch] = rules
    return out


TABLE_TEXT = _load_table_text()
TUNED = parse_tuned_table(TABLE_TEXT)


def tuned_config_name(M: int, N: int, K: int, arch: str, table: dict | None = None) -> str | None:
    buckets = (TUNED if table is None else table).get(arch, {}).get((N, K))
    if not buckets:
        return None
    for mx, name in buckets:
        if mx is None or M <= mx:
            return name
    return buckets[-1][1]


@functools.lru_cache(maxsize=4096)
def pick_config(M: int, N: int, K: int, arch: str = "sm_90") -> str:
    """Name of the GPU tile config for an ``[M, K] x [K, N]`` problem (speed only): the
    tuned table's rule for (arch, N, K) if any, else :func:`default_config_name`."""
    name = tuned_config_name(M, N, K, arch)
    if name is not None and CONFIGS[name]["kernel"] in TMA_KERNELS and not arch_has_tma(arch):
        name = None
    return name or default_config_name(M, N, K, arch)


def config_name_for(M: int, N: int, K: int, dtype: torch.dtype, arch: str) -> str:
    """Name of the GPU tile config ``linear_fwd`` uses for an ``[M, K] x [K, N]`` problem in
    ``dtype`` (a key of :data:`CONFIGS`, or of :data:`CONFIGS_FP32` for fp32)."""
    if dtype == torch.float32:
        return "f32_dec16_n32" if M <= 16 else "f32_mid64_n64" if M <= 256 else "f32_big64_n128"
    return pick_config(M, N, K, arch)


def config_for(M: int, N: int, K: int, x2: torch.Tensor) -> dict:
    if interpreting():
        return INTERPRETER_CONFIG
    name = config_name_for(M, N, K, x2.dtype, _arch_of(x2.device))
    return (CONFIGS_FP32 if x2.dtype == torch.float32 else CONFIGS)[name]


def row_grid(m_min: int, m_max: int) -> list[int]:
    """Row counts that reach every tile config between m_min and m_max: every M up to 512 (the
    decode/medium rules), then every multiple of 128 (all tuned bounds and the built-in rule's
    tile-count threshold are multiples of 128), then m_max."""
    ms = set(range(max(1, m_min), min(512, m_max) + 1))
    ms.update(range(max(512, m_min - m_min % 128), m_max + 1, 128))
    ms.add(m_max)
    return sorted(m for m in ms if m_min <= m <= m_max)


def config_names(n: int, k: int, dtype: torch.dtype, arch: str, m_min: int, m_max: int) -> list[str]:
    """The tile configs ``linear_fwd`` can pick for ``[M, k] x [k, n]`` on ``arch`` with m_min <= M <= m_max."""
    return sorted({config_name_for(m, n, k, dtype, arch) for m in row_grid(m_min, m_max)})


def tile_configs(n: int, k: int, dtype: torch.dtype, m_min: int, m_max: int, device) -> list[str]:
    """The Triton linear's ``TILE_CONFIGS`` hook: every config a call on ``device`` with m_min <= M <= m_max can
    compile (each is its own Triton compile; :func:`linear_triton` takes one as ``config=``); none under the CPU
    interpreter, which compiles nothing."""
    if interpreting():
        return []
    return config_names(n, k, dtype, _arch_of(torch.device(device)), m_min, m_max)
