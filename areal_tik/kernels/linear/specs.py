"""Compile-check specs of the linear Triton kernels (``COMPILE_SPECS``): every config of
:data:`CONFIGS` (bf16) with one K chunk, the split kernel and one config of each other form with the
fixed K splits, one with a bias, and the fp32 family, with the launch's argument specialisations."""
from __future__ import annotations

from areal_tik.kernels._dense_common import div16_attrs
from areal_tik.kernels.linear.configs import CONFIGS, CONFIGS_FP32, TMA_KERNELS
from areal_tik.kernels.linear.splits import K_SPLITS
from areal_tik.kernels.linear.triton_kernels import (
    linear_fwd_kernel, linear_fwd_splitk_kernel, linear_fwd_tma_kernel, linear_fwd_tma_persistent_kernel,
)

_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
        "K": "i32", "K_CHUNK": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
_SPLIT_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
              "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "K_CHUNK": "i32", "stride_xm": "i32",
              "stride_wn": "i32", "stride_ym": "i32"}


def _spec(name, has_bias=False, dtype="bf16", splits=1):
    c = dict({**CONFIGS, **CONFIGS_FP32}[name])
    nw, ns = c.pop("num_warps"), c.pop("num_stages")
    kind = c.pop("kernel")
    if kind in TMA_KERNELS:
        return _tma_spec(c, kind, nw, ns, has_bias, dtype, splits)
    fn = linear_fwd_splitk_kernel if kind == "splitk" else linear_fwd_kernel
    base = _SPLIT_SIG if kind == "splitk" else _SIG
    sig = {k: (f"*{dtype}" if v.startswith("*") and k not in ("ws_ptr", "cnt_ptr") else v) for k, v in base.items()}
    return dict(fn=fn, signature=sig,
                constexprs=dict(c, HAS_BIAS=has_bias, PRECISION="ieee" if dtype == "fp32" else "tf32",
                                SPLITS=splits),
                num_warps=nw, num_stages=ns,
                attrs=div16_attrs(fn, ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "K_CHUNK",
                                       "stride_xm", "stride_wn", "stride_ym"]))


def _tma_spec(c, kind, nw, ns, has_bias, dtype, splits):
    fn = linear_fwd_tma_kernel if kind == "tma" else linear_fwd_tma_persistent_kernel
    sig = {"x_desc": f"tensordesc<{dtype}[{c['BLOCK_M']}, {c['BLOCK_K']}]>",
           "w_desc": f"tensordesc<{dtype}[{c['BLOCK_N']}, {c['BLOCK_K']}]>",
           "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "K_CHUNK": "i32",
           "stride_ym": "i32"}
    cx = dict(c, HAS_BIAS=has_bias, PRECISION="tf32", SPLITS=splits)
    if kind == "tma_p":
        cx["NUM_PROGS"] = 132
    return dict(fn=fn, signature=sig, constexprs=cx, num_warps=nw, num_stages=ns,
                attrs=div16_attrs(fn, ["b_ptr", "y_ptr", "N", "K", "K_CHUNK", "stride_ym"]))


#: configs whose in-program split is compiled too: one of each kernel form (pointer, TMA, persistent TMA plain,
#: flattened and warp-specialised); the rest differ from these only in tile constants
_SPLIT_FORM_SAMPLES = ("dec64_n32", "tma64_n128", "tmap128_n256", "tmap128_n256_flat", "tmap128_n256_ws")


def compile_specs() -> list[dict]:
    """Every config with one K chunk, every config with each split count of :data:`.splits.K_SPLITS` (the
    split kernel with at least two: with one it runs its pointer twin), a bias variant, the fp32 family."""
    split_counts = sorted({s for s in K_SPLITS.values() if s > 1} or {4})
    split_forms = [n for n, c in CONFIGS.items() if c["kernel"] == "splitk"] + list(_SPLIT_FORM_SAMPLES)
    return ([_spec(n) for n in CONFIGS if CONFIGS[n]["kernel"] != "splitk"]
            + [_spec(n, splits=s) for n in split_forms for s in split_counts]
            + [_spec("mid64_n128", has_bias=True)] + [_spec(n, dtype="fp32") for n in CONFIGS_FP32])
