"""Attention meta-parameters: the bit-defining block sizes (``BLOCK_N``, ``KV_PARTITION``), the
launch tiles (not bit-defining), the tuned table per GPU arch (``tuned.json``) and ``META``, which
the fingerprint hashes. Launchers read them at call time (``tuning.BLOCK_N``), so ``configure``
and tests may change them."""
from __future__ import annotations

import json
import hashlib
import os

from areal_tik.kernels import interpreting
from areal_tik.kernels._device import gpu_arch_name as _gpu_arch_name

# ---- bit-defining meta-parameters (fingerprinted through META) -------------------------
# Defaults (CPU, and any GPU without an entry in tuned.json). ``configure`` can
# replace them (the tuned JSON for this GPU's arch is applied at import, see the bottom).
BLOCK_N = 64          # KV block of the online softmax, aligned to position 0
KV_PARTITION = 256    # split-KV partition (multiple of BLOCK_N), at absolute positions
LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (64, 128)
TUNED_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned.json")

# Launch tile sizes. These do not define bits (see module docstring, point 3); the tests
# check that by comparing different tiles and regimes (and bench/tune_attention.py checks
# every candidate before it may be committed).
#   fwd:    prefill / chunked / varlen kernel; FLAT=1 walks KV in one loop with the
#           partition merge inside it (software-pipelined across partitions), FLAT=0 in
#           nested partition/block loops. Same arithmetic either way.
#   decode: split-KV kernel; HSPLIT splits the GQA group's query heads over programs.
#   bwd:    dK/dV kernel tiles (BLOCK_M1 x BLOCK_N1) and dQ kernel tiles (BLOCK_M2 x BLOCK_N2).
_DEFAULT_FWD = {64: dict(BLOCK_M=128, num_warps=4, num_stages=3, FLAT=1),
                128: dict(BLOCK_M=128, num_warps=8, num_stages=3, FLAT=1)}
_DEFAULT_DEC = dict(num_warps=4, num_stages=3, HSPLIT=1)
_DEFAULT_BWD = {64: dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3),
                128: dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3)}
_FWD_GPU = {d: dict(c) for d, c in _DEFAULT_FWD.items()}
_DEC_GPU = dict(_DEFAULT_DEC)
_BWD_GPU = {d: dict(c) for d, c in _DEFAULT_BWD.items()}
_INTERP_BLOCK_M = 16
_TUNED_SOURCE = "defaults"

META: dict = {}


def _refresh_meta() -> None:
    """META = the bit-defining constants plus the launch configuration in use (the launch
    tiles are not bit-defining, but fingerprinting them is the conservative choice)."""
    META.clear()
    META.update({
        "BLOCK_N": BLOCK_N, "KV_PARTITION": KV_PARTITION, "denominator": "dot(p_bf16, ones)",
        "fp_fusion": False, "torch_ref": "exact-max, tree-BLOCK_N + ascending blocks",
        "decode": "single launch, last partition program merges ascending",
        "launch": repr((sorted((d, sorted(c.items())) for d, c in _FWD_GPU.items()), sorted(_DEC_GPU.items()),
                        sorted((d, sorted(c.items())) for d, c in _BWD_GPU.items()))),
        "tuned": _TUNED_SOURCE,
    })


def configure(cfg: dict | None = None, source: str = "configure()") -> dict:
    """Set the meta-parameters from a dict like one arch entry of ``tuned.json``:
    ``{"BLOCK_N": 64, "KV_PARTITION": 256, "fwd": {"128": {...}}, "decode": {...},
    "bwd": {"128": {...}}}`` (missing keys keep the defaults). ``None`` restores the
    defaults. Changes the bits (BLOCK_N, KV_PARTITION) and META/the fingerprint; the
    registry reads META when it first loads, so call this before serving/training.
    Returns the previous configuration (for the tuner / tests to restore)."""
    global BLOCK_N, KV_PARTITION, _TUNED_SOURCE
    prev = current_config()
    prev["_source"] = _TUNED_SOURCE
    cfg = dict(cfg or {})
    BLOCK_N = int(cfg.get("BLOCK_N", 64))
    KV_PARTITION = int(cfg.get("KV_PARTITION", 256))
    _FWD_GPU.clear()
    _DEC_GPU.clear()
    _BWD_GPU.clear()
    for d in SUPPORTED_HEAD_DIMS:
        _FWD_GPU[d] = {**_DEFAULT_FWD[d], **{k: int(v) for k, v in cfg.get("fwd", {}).get(str(d), {}).items()}}
        _BWD_GPU[d] = {**_DEFAULT_BWD[d], **{k: int(v) for k, v in cfg.get("bwd", {}).get(str(d), {}).items()}}
    _DEC_GPU.update({**_DEFAULT_DEC, **{k: int(v) for k, v in cfg.get("decode", {}).items()}})
    _TUNED_SOURCE = cfg.get("_source", source) if cfg else "defaults"
    _cfg()
    _refresh_meta()
    return prev


def current_config() -> dict:
    return {"BLOCK_N": BLOCK_N, "KV_PARTITION": KV_PARTITION,
            "fwd": {str(d): dict(c) for d, c in _FWD_GPU.items()}, "decode": dict(_DEC_GPU),
            "bwd": {str(d): dict(c) for d, c in _BWD_GPU.items()}}


def load_tuned(path: str | None = None, arch: str | None = None) -> bool:
    """Apply the committed tuning for this GPU arch (``tuned.json``: ``{"sm90":
    {...configure() dict..., "_source": "bench/results/..."}}``), or the table at ``path``.
    Returns True if an entry was applied."""
    path = path or TUNED_JSON
    if interpreting() or not os.path.exists(path):
        return False
    arch = arch or _gpu_arch_name()
    if arch is None:
        return False
    with open(path) as f:
        table = json.load(f)
    entry = table.get(arch)
    if not entry:
        return False
    digest = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:12]
    configure(entry, source=f"{os.path.basename(path)}:{arch}:{digest}")
    _refresh_meta()
    META["tuned"] = f"{os.path.basename(path)}:{arch}:{digest}"
    return True



def _cfg() -> tuple[int, int]:
    """Current (BLOCK_N, KV_PARTITION), read at call time so tests can shrink them."""
    bn, part = BLOCK_N, KV_PARTITION
    if bn < 16 or bn & (bn - 1) or part % bn or part <= 0:
        raise ValueError(f"BLOCK_N={bn} must be a power of two >= 16 and KV_PARTITION={part} a multiple of it")
    return bn, part
