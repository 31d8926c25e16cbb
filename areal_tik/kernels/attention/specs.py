"""Compile-check specs of the Triton attention kernels (``COMPILE_SPECS``): every kernel compiled
for sm_80/sm_90 on a CPU by ``areal-tik compile-check`` at the configured tiles."""
from __future__ import annotations

from areal_tik.kernels.attention import tuning as T
from areal_tik.kernels.attention.triton_backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from areal_tik.kernels.attention.triton_kernels import attn_decode_kernel, attn_fwd_kernel

def _sig(fn, types: dict, constexprs: dict) -> dict:
    sig = {}
    for a in fn.arg_names:
        if a in constexprs:
            sig[a] = "constexpr"
        elif a in types:
            sig[a] = types[a]
        elif a.startswith("stride") or a.startswith("n_"):
            sig[a] = "i32"
        elif a in ("qk_scale", "sm_scale"):
            sig[a] = "fp32"
        else:
            raise KeyError(f"no compile-check type for {fn.__name__}.{a}")
    return sig


def compile_specs():
    specs = []
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    fwd_t = dict(Q=bf, K=bf, V=bf, O=bf, LSE=f32, BT=i32, CUQ=i32, SEQK=i32)
    for D in T.SUPPORTED_HEAD_DIMS:
        t = T._FWD_GPU[D]
        for paged, ps, lse in ((False, 16, True), (True, 16, False), (True, 256, False)):
            c = dict(GROUP=4, HEAD_DIM=D, BLOCK_M=t["BLOCK_M"], BLOCK_N=T.BLOCK_N, PARTITION=T.KV_PARTITION,
                     PAGED=paged, PAGE_SIZE=ps, STORE_LSE=lse, FLAT=int(t.get("FLAT", 1)))
            specs.append(dict(fn=attn_fwd_kernel, signature=_sig(attn_fwd_kernel, fwd_t, c), constexprs=c,
                              num_warps=t["num_warps"], num_stages=t["num_stages"], enable_fp_fusion=False))
        dec = T._DEC_GPU
        for group, ps in ((4, 16), (8, 64)):
            c = dict(GROUP=group, HEAD_DIM=D, BLOCK_H=16, BLOCK_N=T.BLOCK_N, PARTITION=T.KV_PARTITION, PAGE_SIZE=ps,
                     HSPLIT=int(dec.get("HSPLIT", 1)))
            ty = dict(Q=bf, KC=bf, VC=bf, BT=i32, CUQ=i32, SEQK=i32, O=bf, WM=f32, WL=f32, WA=f32, CNT=i32)
            specs.append(dict(fn=attn_decode_kernel, signature=_sig(attn_decode_kernel, ty, c), constexprs=c,
                              num_warps=dec["num_warps"], num_stages=dec["num_stages"], enable_fp_fusion=False))
        b = T._BWD_GPU[D]
        ty = dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DK=bf, DV=bf, DQ=bf, CU=i32)
        for fn, bm, bn_ in ((attn_bwd_dkdv_kernel, b["BLOCK_M1"], b["BLOCK_N1"]),
                            (attn_bwd_dq_kernel, b["BLOCK_M2"], b["BLOCK_N2"])):
            c = dict(GROUP=4, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn_)
            specs.append(dict(fn=fn, signature=_sig(fn, ty, c), constexprs=c,
                              num_warps=b["num_warps"], num_stages=b["num_stages"]))
    return specs

