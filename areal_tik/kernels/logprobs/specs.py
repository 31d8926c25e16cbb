"""Compile-check specs of the log-prob Triton kernels (``COMPILE_SPECS``): the LSE walk (bf16
logits with int64 tokens, fp32 with int32) and the d logits kernel (with and without the
entropy gradient), with the launch's argument specialisations."""
from __future__ import annotations

from areal_tik.kernels._dense_common import div16_attrs
from areal_tik.kernels.logprobs.layout import LSE_WARPS, V_BLOCK
from areal_tik.kernels.logprobs.triton_kernels import dlogits_kernel, lse_blocks_kernel

_LSE_SIG = {"lg_ptr": "*bf16", "stride_l": "i32", "tok_ptr": "*i64", "state_ptr": "*fp32", "lp_ptr": "*fp32",
            "ent_ptr": "*fp32", "c0": "i32", "c1": "i32", "temperature": "fp32", "last": "i32"}
_DL_SIG = {"lg_ptr": "*bf16", "stride_l": "i32", "tok_ptr": "*i64", "lse_ptr": "*fp32", "mz_ptr": "*fp32",
           "glp_ptr": "*fp32", "gent_ptr": "*fp32", "c0": "i32", "ncols": "i32", "temperature": "fp32"}


def compile_specs() -> list[dict]:
    return [
        dict(fn=lse_blocks_kernel, signature=_LSE_SIG, constexprs={"V_BLOCK": V_BLOCK}, num_warps=LSE_WARPS,
             attrs=div16_attrs(lse_blocks_kernel, ["lg_ptr", "tok_ptr", "state_ptr", "lp_ptr", "ent_ptr"])),
        dict(fn=lse_blocks_kernel, signature=dict(_LSE_SIG, lg_ptr="*fp32", tok_ptr="*i32"),
             constexprs={"V_BLOCK": V_BLOCK}, num_warps=LSE_WARPS),
        dict(fn=dlogits_kernel, signature=_DL_SIG, constexprs={"HAS_GLP": True, "HAS_GENT": True, "BLOCK": 2048},
             num_warps=8, attrs=div16_attrs(dlogits_kernel, ["lg_ptr", "stride_l"])),
        dict(fn=dlogits_kernel, signature=_DL_SIG, constexprs={"HAS_GLP": True, "HAS_GENT": False, "BLOCK": 2048},
             num_warps=8),
    ]
