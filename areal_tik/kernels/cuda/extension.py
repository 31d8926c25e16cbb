"""The csrc CUDA extension as the cuda ops call it: the files it is built from, the
revision markers a build must carry, the bit-defining ``META`` shared by every cuda op, and
:func:`extension`, the loaded module after the stale-build checks.

The kernels live in ``csrc/tik_attention.cu`` and ``csrc/tik_elementwise.cu`` (plain CUDA,
no torch headers, C launcher API in ``csrc/tik_api.h``); ``csrc/tik_bindings.cpp`` binds
them to torch. The module is ``areal_tik._C`` when ``setup.py`` built it, else a JIT build
by :func:`areal_tik.kernels.cuda.loader.load`. Nothing here touches CUDA at import time, so
the registry can import the cuda op modules on a CPU machine (the cuda backend then reports
itself unavailable).

The one extension serves every cuda op (:mod:`.attention`, :mod:`.elementwise`), so each op
module lists the same ``CUDA_SOURCES`` (hashed into the kernel fingerprint) and ``META``.
"""
from __future__ import annotations

import glob
import os

import torch

from areal_tik.kernels.cuda import loader

__all__ = ["CUDA_SOURCES", "META", "BLOCK_N", "SPLIT", "DECODE_PATH", "PREFILL_KERNELS", "ELEMENTWISE_API",
           "PREFILL_KERNEL", "extension"]

# every csrc file, headers included (the fingerprint hashes them all)
CUDA_SOURCES = tuple(sorted(f for ext in ("h", "cuh", "cu", "cpp")
                            for f in glob.glob(os.path.join(loader.CSRC_DIR, f"*.{ext}"))))

BLOCK_N = 64      # must equal TIK_ATTN_BLOCK_N in csrc/tik_api.h
SPLIT = 256       # must equal TIK_ATTN_SPLIT
DECODE_PATH = 4   # must equal TIK_ATTN_DECODE_PATH (4-warp decode, fused merge, chunks per CTA, lse output)
PREFILL_KERNELS = 2  # must equal TIK_ATTN_PREFILL_KERNELS (the build knows prefill_kernel)
ELEMENTWISE_API = 2  # must equal TIK_ELEMENTWISE_API (2: apply_rope_fwd has the backward transpose)
# Kernel of FOLD-mode launches that are not decode-shaped ("auto": the sm_90a wgmma kernel where
# the GPU and the build have it and D = 128, else mma.sync; "mma"/"wgmma" force one); a launch may
# pass prefill_kernel=. The GPU tests check both give the same bits. Defined here because META
# names it; the attention wrappers (attention.py) take their default from here.
PREFILL_KERNEL = "auto"

META = {"cuda.attn.BLOCK_N": BLOCK_N, "cuda.attn.SPLIT": SPLIT, "cuda.attn.mma": "m16n8k16 bf16->f32",
        "cuda.attn.exp": "ex2.approx.ftz", "cuda.rms_norm": "warp/row, lane-strided 8-groups, xor tree",
        "cuda.rope": "fp32 mul/add rn",
        "cuda.attn.prefill": f"{PREFILL_KERNEL}: sm_90a and D=128 -> wgmma m64n64k16/m64n128k16 + TMA (2 consumer "
                             "warpgroups, 128 rows per CTA, + a producer warpgroup), else mma.sync m16n8k16",
        "cuda.attn.decode": "max_seqlen_q*G<=16: one 4-warp CTA per 16 rows, warps split the head dim "
                            "(P V, D/4 columns each; S split by columns, exchanged in shared memory); split-KV: "
                            "256-position chunks, one or more per CTA, merged ascending "
                            "(in the launch by the tile's last CTA, or by a merge kernel: same operations); K/V by TMA "
                            "boxes on sm_90a at D=128 with boxes of >= 64 rows, else cp.async (same bits)"}


def extension():
    """The compiled module (prebuilt or JIT). Raises RuntimeError with the reason."""
    mod = loader.load()
    if getattr(mod, "BLOCK_N", BLOCK_N) != BLOCK_N or getattr(mod, "SPLIT", SPLIT) != SPLIT:
        raise RuntimeError(f"areal-tik CUDA extension built with BLOCK_N={mod.BLOCK_N}, SPLIT={mod.SPLIT}; "
                           f"cuda_ops expects {BLOCK_N}/{SPLIT}: rebuild")
    if getattr(mod, "DECODE_PATH", None) != DECODE_PATH:
        raise RuntimeError(f"areal-tik CUDA extension {getattr(mod, '__file__', mod)} was built from other csrc "
                           f"(DECODE_PATH={getattr(mod, 'DECODE_PATH', None)}, expected {DECODE_PATH}: it predates "
                           "the current decode path, e.g. the removed 1-warp decode, the decode without the "
                           "fused merge, or a build without the lse output): rebuild it (pip install -e . to rebuild areal_tik._C, or delete the stale "
                           "areal_tik/_C*.so to use the JIT build)")
    # revision markers of later csrc features: a build without one predates that feature
    for attr, want, feature in (("PREFILL_KERNELS", PREFILL_KERNELS, "the prefill_kernel selector (wgmma prefill)"),
                                ("ELEMENTWISE_API", ELEMENTWISE_API, "the RoPE backward kernel (ELEMENTWISE_API)")):
        if getattr(mod, attr, None) != want:
            raise RuntimeError(f"areal-tik CUDA extension {getattr(mod, '__file__', mod)} predates {feature}: "
                               "rebuild it (pip install -e ., or delete the stale areal_tik/_C*.so to use the JIT "
                               "build)")
    return mod


def need_cuda(name, *named):
    """Every input of a cuda op must be a CUDA tensor, all on one device."""
    dev = None
    for n, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise ValueError(f"{name}: the cuda backend needs CUDA tensors; {n} is on {t.device}")
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise ValueError(f"{name}: {n} is on {t.device} but the other inputs are on {dev}")
