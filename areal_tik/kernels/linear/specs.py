"""Compile-check specs of the linear Triton kernels (``COMPILE_SPECS``): every config of
:data:`CONFIGS` (bf16), one with a bias, and the fp32 family, with the launch's argument
specialisations."""
from __future__ import annotations

from areal_tik.kernels._dense_common import div16_attrs
from areal_tik.kernels.linear.configs import CONFIGS, CONFIGS_FP32, TMA_KERNELS
from areal_tik.kernels.linear.triton_kernels import (
    _linear_fwd_kernel, _linear_fwd_tma_kernel, _linear_fwd_tma_persistent_kernel,
)

_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
        "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}


def _spec(name, has_bias=False, dtype="bf16"):
    c = dict({**CONFIGS, **CONFIGS_FP32}[name])
    nw, ns = c.pop("num_warps"), c.pop("num_stages")
    kind = c.pop("kernel")
    if kind in TMA_KERNELS:
        return _tma_spec(c, kind, nw, ns, has_bias, dtype)
    sig = {k: (f"*{dtype}" if v.startswith("*") else v) for k, v in _SIG.items()}
    return dict(fn=_linear_fwd_kernel, signature=sig,
                constexprs=dict(c, HAS_BIAS=has_bias, PRECISION="ieee" if dtype == "fp32" else "tf32"),
                num_warps=nw, num_stages=ns,
                attrs=div16_attrs(_linear_fwd_kernel, ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K",
                                                        "stride_xm", "stride_wn", "stride_ym"]))


def _tma_spec(c, kind, nw, ns, has_bias, dtype):
    fn = _linear_fwd_tma_kernel if kind == "tma" else _linear_fwd_tma_persistent_kernel
    sig = {"x_desc": f"tensordesc<{dtype}[{c['BLOCK_M']}, {c['BLOCK_K']}]>",
           "w_desc": f"tensordesc<{dtype}[{c['BLOCK_N']}, {c['BLOCK_K']}]>",
           "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32"}
    cx = dict(c, HAS_BIAS=has_bias, PRECISION="tf32")
    if kind == "tma_p":
        cx["NUM_PROGS"] = 132
    return dict(fn=fn, signature=sig, constexprs=cx, num_warps=nw, num_stages=ns,
                attrs=div16_attrs(fn, ["b_ptr", "y_ptr", "N", "K", "stride_ym"]))


def compile_specs() -> list[dict]:
    return ([_spec(n) for n in CONFIGS] + [_spec("mid64_n128", has_bias=True)]
            + [_spec(n, dtype="fp32") for n in CONFIGS_FP32])
