"""Ablated copies of the csrc attention kernels, for timing where their time goes (no profiler on the device).

Each variant is csrc/ with one part of a kernel's steady loop removed; the loads, barriers and rings are
kept intact (removing those can deadlock the mbarrier phases), so every variant runs to completion. The
outputs are wrong by construction: bisect_csrc reports `*_eq: false` for them and times them anyway.

wgmma prefill (tik_attention_wgmma.cuh):
    NOSM     no softmax arithmetic (P = S as is, alpha = 1): MMA + pipeline ceiling
    NOPV     no P V wgmma: S + softmax + pipeline
    NOS      no S = Q K^T wgmma (the softmax runs on stale registers): P V + softmax + pipeline
    SKEL     none of the three: the load / barrier skeleton alone
    SRS      probe: S's A operand from registers (P's), not Q from shared memory (would Q in registers pay?)
    NOSHFL   probe: no quad shuffles in softmax_block (row max / row sum): the per-block reduction latency
    KONLY    every computation, half the bytes: the one-box-per-half K/V path loads K only (L2 -> SMEM bound?)
decode (attn_decode_kernel in tik_attention_decode.cu):
    DECLOAD  no compute on any block (S, softmax, P V skipped at run time): the cp.async loader's floor,
             with the split-chunk stores and the fused merge still running
    DECHM    a layout probe: the loader reads each page as head-major (a head's block rows contiguous) instead
             of the engine's row-major pages; DECHMLOAD the same without compute

    python bench/probes/csrc_ablations.py --src csrc --out scratch/bisect [--variants NOSM NOPV NOS SKEL DECLOAD]
    # device (carry scratch): python bench/probes/bisect_csrc.py --dir scratch/bisect --variants H NOSM NOPV NOS SKEL ...
    #                         python bench/probes/bisect_csrc.py --decode --dir scratch/bisect --variants H DECLOAD ...

Writes OUT/H (the unmodified copy) and OUT/<variant>. Exits non-zero when an anchor is missing (the
kernel changed: update the anchors below).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

KERNEL = "tik_attention_wgmma.cuh"
DECODE = "tik_attention_decode.cu"
COMMON = "tik_attention_common.cuh"  # softmax_block, shared by every attention kernel
TMA = "tik_attention_tma.cuh"  # tma_kv_block, the K/V box issue of the wgmma prefill and the decode TMA loader

_S_LOOP = """      wgmma_m64n64k16_ss(s, q_lo + off, k_lo + off, kc > 0);"""
_PV_LOOP = """      wgmma_m64n128k16_rs_tb(acc, pa[kc], v_lo + (uint32_t)(kc * 16 * 128 / 16));"""
_SM_HEAD = """  auto softmax = [&](int j) {  // attn_kernel's per-row operations on S_j; updates m, l, alpha, s := P
"""

# the decode kernel's per-block compute guard
_DEC_GUARD = """    if (warp_max_pos >= j * BN) {
      const bf16* Vb = Vs + buf * BN * LDS;"""

# variant -> [(file, anchor, replacement)]
EDITS = {
    "NOSM": [(KERNEL, _SM_HEAD, _SM_HEAD + "    alpha[0] = alpha[1] = 1.f;  // ABLATION NOSM\n    if (j >= 0) return;\n")],
    "NOPV": [(KERNEL, _PV_LOOP, "      (void)v_lo;  // ABLATION NOPV")],
    "NOS": [(KERNEL, _S_LOOP, "      (void)off;  // ABLATION NOS")],
    "DECLOAD": [(DECODE, _DEC_GUARD, _DEC_GUARD.replace("j * BN) {", "j * BN && p.batch < 0) {  // ABLATION DECLOAD"))],
}
EDITS["SKEL"] = EDITS["NOSM"] + EDITS["NOPV"] + EDITS["NOS"]
# Half the bytes, all the arithmetic: the K/V box issue's one-box-per-half path (contiguous K/V, pages of >= 64
# rows) loads K only (V stays whatever the stage held). If the prefill is bound by streaming K/V from L2 into
# shared memory, this is faster than H by about the load's share; if not, about equal.
_KV_TX = "    mbar_expect_tx(bar, (uint32_t)(BN * 128 * 4));"
_KV_V = "      tma_load_3d(ks + WG_TILE_BYTES + h * WG_HALF_BYTES, tm_v, h * 64, hk, (int)slot, bar);"
# A probe, not an ablation: S = Q K^T with its A operand from registers (wgmma RS form) instead of shared memory.
# The registers are P's (no Q in registers: S is wrong), so this bounds what keeping Q in registers would gain
# by halving the S wgmma's shared-memory operand traffic; the register cost of a real Q (64 per thread) is absent.
_S_SS_DOC = "// D[64 x 64] = A[64 x 16] * B[16 x 64], both from shared memory (descriptors, K-major) + (scale_d ? D : 0)."
_S_RS_FN = """// PROBE SRS: D[64 x 64] = A (registers) * B[16 x 64] (shared memory, K-major) + (scale_d ? D : 0).
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint32_t b_lo, int scale_d) {
  asm volatile(
      "{\\n.reg .pred p;\\n.reg .b64 db;\\nsetp.ne.b32 p, %37, 0;\\nmov.b64 db, {%36, %38};\\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, db, p, 1, 1, 0;\\n}\\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(scale_d), "r"(WG_DESC_HI));
}
"""
EDITS["SRS"] = [(KERNEL, _S_SS_DOC, _S_RS_FN + _S_SS_DOC),
                (KERNEL, _S_LOOP, "      wgmma_m64n64k16_rs(s, pa[kc & 3], k_lo + off, kc > 0);  // PROBE SRS")]
# Probe: the softmax's four quad shuffles per row and block (row max, row sum) removed, in every kernel that uses
# softmax_block (only the prefill is timed with it). Bounds the per-block fixed latency a wider KV block (BN 128:
# half the blocks, so half these reductions per key) could save.
_SM_SHFL = ["    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));",
            "    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));",
            "    rs[i] = __fadd_rn(rs[i], __shfl_xor_sync(0xffffffffu, rs[i], 1));",
            "    rs[i] = __fadd_rn(rs[i], __shfl_xor_sync(0xffffffffu, rs[i], 2));"]
EDITS["NOSHFL"] = [(COMMON, a, "    // ABLATION NOSHFL") for a in _SM_SHFL]
EDITS["KONLY"] = [(TMA, _KV_TX, _KV_TX.replace("* 4", "* 2  /* ABLATION KONLY */")),
                  (TMA, _KV_V, "      // ABLATION KONLY: no V box")]

# Layout probe, not an ablation: the decode loader's one-page path reads the cache as if each page were
# head-major ([page][Hkv][row][D]: a head's 64 rows of a block are 16 KB contiguous, as SDPA's gathered
# [B, Hkv, L, D] copy is) instead of the engine's [page][row][Hkv][D] (256-byte rows 2 KB apart at 8 KV
# heads). Same bytes, same instructions; only the addresses move. DECHMLOAD = DECHM + DECLOAD.
_DEC_KP = """      const bf16* kp = kg0 + (row0e + lr0) * row_elems + col0;
      const bf16* vp = vg0 + (row0e + lr0) * row_elems + col0;"""
_DEC_HM = """      const int64_t hm0 = p.paged ? (int64_t)pg[0] * page_elems + (int64_t)hk * ps * D
                                        + (int64_t)((pos0 & (ps - 1)) + lr0) * D + ls * 8  // PROBE DECHM
                                  : (row0e + lr0) * row_elems + col0;
      const int64_t hm_step = p.paged ? (int64_t)RSTEP * D : rstep_elems;
      const bf16* kp = kg0 + hm0;
      const bf16* vp = vg0 + hm0;"""
_DEC_CPK = "cp_async16(ks_s + so, ok ? kp + u * rstep_elems : kg0, ok ? 16 : 0);"
_DEC_CPV = "cp_async16(vs_s + so, ok ? vp + u * rstep_elems : vg0, ok ? 16 : 0);"
EDITS["DECHM"] = [(DECODE, _DEC_KP, _DEC_HM), (DECODE, _DEC_CPK, _DEC_CPK.replace("rstep_elems", "hm_step")),
                  (DECODE, _DEC_CPV, _DEC_CPV.replace("rstep_elems", "hm_step"))]
EDITS["DECHMLOAD"] = EDITS["DECHM"] + EDITS["DECLOAD"]


def ablate(text: str, variant: str, fname: str = KERNEL) -> str:
    for f, old, new in EDITS[variant]:
        if f != fname:
            continue
        if text.count(old) != 1:
            raise ValueError(f"{variant}: anchor found {text.count(old)} times (want 1): {old.strip()[:70]!r}")
        text = text.replace(old, new)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="csrc")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="+", default=list(EDITS), choices=list(EDITS))
    a = ap.parse_args(argv)
    for name in ["H", *a.variants]:
        d = os.path.join(a.out, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(a.src, d)
        for fname in sorted({f for f, _, _ in EDITS.get(name, [])}):
            with open(os.path.join(a.src, fname)) as f:
                text = ablate(f.read(), name, fname)
            with open(os.path.join(d, fname), "w") as f:
                f.write(text)
        print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
