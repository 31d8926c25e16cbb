"""The tile configs the triton backend may use (:data:`CONFIGS`, :data:`CONFIGS_FP32`, the
interpreter's one config) and the built-in choice among them when no tuned rule applies
(:func:`default_config_name`). Configs differ only in tiling, warps, stages, load unrolling,
program order and how tiles are fetched, never in the reduction (``BLOCK_K``)."""
from __future__ import annotations

import triton

BLOCK_K = 64  # the bit-defining reduction step (fixed for every config)


def _cfg(bm, bn, warps, stages, unroll=1, group=8, kernel="ptr", flatten=False, ws=False):
    c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=group, num_warps=warps, num_stages=stages,
             kernel=kernel)
    if kernel in ("ptr", "splitk"):
        c["K_UNROLL"] = unroll
    if kernel == "tma_p":
        c.update(FLATTEN=flatten, WARP_SPEC=ws)
    return c


#: Every tile config the triton backend may use on a GPU. They differ only in M/N tiling,
#: warps, stages, load unrolling, program order and how tiles are fetched (plain pointers,
#: TMA descriptors, persistent TMA), never in the reduction (BLOCK_K=64, ascending K, one
#: fresh fp32 accumulator per output tile); the GPU test checks each against the others
#: bit for bit, and bench/tune_linear.py re-checks every candidate before timing it.
#: "kernel": "ptr" = :func:`linear_fwd_kernel`, "tma" = :func:`linear_fwd_tma_kernel`,
#: "tma_p" = :func:`linear_fwd_tma_persistent_kernel` (TMA kinds: sm_90+ only), "splitk" =
#: :func:`linear_fwd_splitk_kernel` (one program per tile and chunk of the fixed K split; with one chunk
#: it runs its pointer twin). Every kind reduces the same fixed split of K (:mod:`.splits`).
CONFIGS = {
    # decode: memory bound, small M tile, N tile sized for enough programs, loads in flight
    "dec16_n16": _cfg(16, 16, 4, 4, unroll=4),
    "dec16_n32": _cfg(16, 32, 4, 4, unroll=4),
    "dec16_n64": _cfg(16, 64, 4, 4, unroll=2),
    "dec32_n32": _cfg(32, 32, 4, 4, unroll=2),
    "dec32_n64": _cfg(32, 64, 4, 4, unroll=2),
    "dec64_n64": _cfg(64, 64, 4, 4, unroll=2),
    "dec16_n16_s6": _cfg(16, 16, 4, 6, unroll=2),
    "dec16_n32_s6": _cfg(16, 32, 4, 6, unroll=2),
    "dec16_n64_s6": _cfg(16, 64, 4, 6, unroll=1),
    "dec16_n128": _cfg(16, 128, 4, 4, unroll=1),
    "dec16_n32_w2": _cfg(16, 32, 2, 5, unroll=2),
    "dec64_n32": _cfg(64, 32, 4, 4, unroll=2),
    # decode at M 16..128 on layer weights: one 64-row tile (weights read once), narrow N tiles for more
    # programs, deep pipelines for more weight bytes in flight per program (the step is bound by weight reads)
    "dec64_n16_s8": _cfg(64, 16, 4, 8),
    "dec64_n16_s12": _cfg(64, 16, 4, 12),
    "dec64_n16_u2s6": _cfg(64, 16, 4, 6, unroll=2),
    "dec64_n32_s8": _cfg(64, 32, 4, 8),
    "dec64_n64_s8": _cfg(64, 64, 4, 8),
    "dec32_n16_s10": _cfg(32, 16, 4, 10),
    "tma64_n16_s8": _cfg(64, 16, 4, 8, kernel="tma"),
    "tma64_n32_s8": _cfg(64, 32, 4, 8, kernel="tma"),
    "tma64_n64_s6": _cfg(64, 64, 4, 6, kernel="tma"),
    # medium M (64..512): more, smaller programs to fill 132 SMs
    "mid64_n128": _cfg(64, 128, 4, 4),
    "mid64_n64": _cfg(64, 64, 4, 5),
    "mid32_n128": _cfg(32, 128, 4, 5),
    "mid128_n64": _cfg(128, 64, 4, 5),
    "mid64_n256": _cfg(64, 256, 8, 4),
    "big128_n128": _cfg(128, 128, 8, 4),
    "big128_n128_w4": _cfg(128, 128, 4, 4),
    # large M: Hopper-style big tiles
    "big128_n256": _cfg(128, 256, 8, 3),
    "big256_n128": _cfg(256, 128, 8, 3),
    "big128_n256_g16": _cfg(128, 256, 8, 3, group=16),
    # TMA descriptors (sm_90+)
    "tma64_n128": _cfg(64, 128, 4, 4, kernel="tma"),
    "tma128_n128": _cfg(128, 128, 8, 4, kernel="tma"),
    "tma128_n128_w4": _cfg(128, 128, 4, 4, kernel="tma"),
    "tma128_n256": _cfg(128, 256, 8, 3, kernel="tma"),
    "tma256_n128": _cfg(256, 128, 8, 3, kernel="tma"),
    # one program per (tile, chunk of the fixed K split): decode M on narrow outputs (N 1.5K-4.6K) leaves
    # most SMs idle with one program per tile; the chunk sums are added by each tile's last program
    "sk16_n64": _cfg(16, 64, 4, 4, unroll=2, kernel="splitk"),
    "sk32_n64": _cfg(32, 64, 4, 6, kernel="splitk"),
    "sk64_n32": _cfg(64, 32, 4, 6, kernel="splitk"),
    "sk64_n64": _cfg(64, 64, 4, 6, kernel="splitk"),
    "sk64_n128": _cfg(64, 128, 4, 4, kernel="splitk"),
    "sk128_n64": _cfg(128, 64, 4, 4, kernel="splitk"),
    "sk128_n128": _cfg(128, 128, 8, 4, kernel="splitk"),
    # persistent TMA (grouped tile order; optional loop flattening / warp specialisation)
    "tmap128_n128": _cfg(128, 128, 8, 4, kernel="tma_p"),
    "tmap128_n256": _cfg(128, 256, 8, 3, kernel="tma_p"),
    "tmap128_n128_flat": _cfg(128, 128, 8, 4, kernel="tma_p", flatten=True),
    "tmap128_n256_flat": _cfg(128, 256, 8, 3, kernel="tma_p", flatten=True),
    "tmap128_n128_ws": _cfg(128, 128, 8, 4, kernel="tma_p", ws=True),
    "tmap128_n256_ws": _cfg(128, 256, 8, 3, kernel="tma_p", ws=True),
}
TMA_KERNELS = ("tma", "tma_p")

#: fp32 inputs take twice the shared memory per stage: smaller tiles, fewer stages.
CONFIGS_FP32 = {
    "f32_dec16_n32": _cfg(16, 32, 4, 2),
    "f32_mid64_n64": _cfg(64, 64, 4, 2),
    "f32_big64_n128": _cfg(64, 128, 8, 2),
}

#: The single config used under the CPU interpreter (tile-shape invariance of the
#: interpreter's numpy dot is not guaranteed, so tests there use one tile shape).
INTERPRETER_CONFIG = _cfg(16, 32, 4, 1, unroll=2, group=4)


def _dec_bn(N: int, bm: int) -> int:
    if N >= 64 * 256 or bm >= 64:
        return 64
    if N >= 32 * 128:
        return 32
    return 16


#: decode-sized M on TMA GPUs without a tuned rule: one 64-row TMA tile and the widest N tile that still makes at
#: least this many programs (the tuned table's measured winners on an H200, 1.5B shapes at M 64 and 128, and most
#: 7B cells follow it; bench/results/2026-12-02T0255_H200_b46d7e5_decode-linear-deeper-tiles: there the pointer
#: default dec64_n64 ran 1.4-1.7x the winner's time)
DECODE_MIN_PROGRAMS = 96
DECODE_TMA_TILES = {128: "tma64_n128", 64: "tma64_n64_s6", 32: "tma64_n32_s8", 16: "tma64_n16_s8"}


#: large M on TMA GPUs without a tuned rule: the persistent TMA kernel once there are this many 128 x 256 output
#: tiles (four waves of 132 SMs; on an H200 it beat big128_n256 by 1.31-1.38x at 560-4,480 tiles, the 1.5B gate
#: projection at M 2,048-16,384, while at 140 tiles, M 512, the unflattened persistent kernel took 1.8x the best
#: time: bench/results/2026-11-30T0545_H200_b92234a_tune-kv-gate)
PERSISTENT_MIN_TILES = 4 * 132


def default_config_name(M: int, N: int, K: int, arch: str = "sm_90") -> str:
    """Built-in choice when no tuned rule applies: at 8 < M <= 256 on a TMA arch (sm_90+) a 64-row TMA tile whose
    N tile leaves at least :data:`DECODE_MIN_PROGRAMS` programs; past M 256 there the persistent TMA kernel once
    the output has :data:`PERSISTENT_MIN_TILES` tiles of 128 x 256; otherwise pointer kernels (valid on every
    arch)."""
    if 8 < M <= 256 and arch_has_tma(arch):
        tiles_m = triton.cdiv(M, 64)
        bn = next((bn for bn in (128, 64, 32) if tiles_m * triton.cdiv(N, bn) >= DECODE_MIN_PROGRAMS), 16)
        return DECODE_TMA_TILES[bn]
    if M <= 16:
        return f"dec16_n{_dec_bn(N, 16)}"
    if M <= 32:
        return "dec32_n64" if _dec_bn(N, 32) == 64 else "dec32_n32"
    if M <= 64:
        return "dec64_n64"
    if M <= 256:
        return "mid64_n128"
    tiles_256 = triton.cdiv(M, 128) * triton.cdiv(N, 256)
    if tiles_256 >= PERSISTENT_MIN_TILES and arch_has_tma(arch):
        return "tmap128_n256_flat"
    return "big128_n256" if tiles_256 >= 132 else "big128_n128"


def arch_has_tma(arch: str) -> bool:
    try:
        return int(arch.split("_")[1][:-1]) >= 9  # "sm_90" -> major 9, "sm_100" -> 10
    except (IndexError, ValueError):
        return False


def fallback_ptr_config(cfg: dict) -> dict:
    """A TMA or split config's pointer-kernel twin (same tile, same bits; used when TMA preconditions fail,
    or when a split launch has one chunk or no arrival counters)."""
    return _cfg(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], unroll=cfg.get("K_UNROLL", 1),
                group=cfg["GROUP_M"])
