"""Fix Triton's CPU interpreter for bf16 (test setup only; kernels are never changed).

Triton's interpreter stores bf16 as raw ``uint16`` numpy arrays, so ``tl.dot`` on bf16
operands multiplies bit patterns and ``tl.sum``/``tl.max`` on bf16 add or compare
integers. :func:`apply` upcasts bf16 operands to float32 inside the interpreter's
``create_dot`` and reductions (bf16*bf16 products are exact in float32, as on the GPU's
tensor cores, which accumulate in fp32), then casts reductions back to bf16. Float
dots accumulate k by k (fixed order, independent of the tile shape), because
``np.matmul`` rounds a row differently depending on the matrix shape, which would make
the interpreter contradict the GPU's measured tile-shape invariance.

fp32 -> bf16 casts: the interpreter truncates (``_convert_float`` with no rounding mode,
and its "RTNE" mode neither breaks ties to even nor carries into the exponent), while the
GPU's ``.to(tl.bfloat16)`` rounds to nearest even. The patch rounds every fp32 -> bf16
conversion (casts, ``fp_to_fp``, bf16 reduction results) to nearest even, via PyTorch's
conversion, so a CPU test of rounding points (e.g. HF's ``silu`` rounded to bf16) sees
the GPU's bits.

Applied by ``tests/conftest.py`` and by CPU-only tools that run kernels under
``TRITON_INTERPRET=1`` (the agent's evaluator). Idempotent.
"""
from __future__ import annotations

_APPLIED = False


def apply() -> bool:
    """Patch the interpreter in place; returns True when a patch is active."""
    global _APPLIED
    if _APPLIED:
        return True
    import numpy as np  # lazy: keeps numpy out of this module's import
    import triton.language as tl  # lazy: keeps triton out of this module's import
    from triton.runtime import interpreter as it  # lazy: keeps triton out of this module's import

    builder_cls = it.InterpreterBuilder
    orig_dot = builder_cls.create_dot

    def _to_f32(handle):
        if handle.dtype.scalar == tl.bfloat16:
            return it._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        fa, fb = _to_f32(a), _to_f32(b)
        if fa is None and fb is None and not (a.data.dtype == np.float32 and d.data.dtype == np.float32):
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        fa = (a.data if fa is None else fa).astype(np.float32)
        fb = (b.data if fb is None else fb).astype(np.float32)
        # Accumulate k by k into the accumulator with separately rounded fp32 mul and add:
        # each output element's reduction order is then fixed by K alone, never by the
        # tile's M/N (np.matmul's BLAS blocking changes rows with the matrix shape).
        acc = np.array(d.data, dtype=np.float32, copy=True)
        for k in range(fa.shape[-1]):  # 2-D and batched 3-D dots alike
            acc = acc + np.multiply(fa[..., :, k:k + 1], fb[..., k:k + 1, :])
        return it.TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)

    builder_cls.create_dot = create_dot

    import torch  # lazy: keeps torch out of this module's import

    def _f32_to_bf16_bits(data):
        """Round float32 values to bf16 (nearest even, like the GPU); uint16 bit patterns."""
        f = np.ascontiguousarray(np.asarray(data, dtype=np.float32))
        return torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    orig_cast = builder_cls.cast_impl
    orig_fp_to_fp = builder_cls.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return it.TensorHandle(_f32_to_bf16_bits(src.data.view(np.float32)), dst_type.scalar)
        return orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16
                and rounding_mode in (None, it._ir.ROUNDING_MODE.RTNE)):
            return it.TensorHandle(_f32_to_bf16_bits(src.data.view(np.float32)), dst_type.scalar)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)

    red = it.ReduceOps
    orig_sum, orig_min_max = red.sum, red.min_max

    def _wrap_bf16(tensor, fn):
        """Run ``fn`` on a float32 copy of a bf16 tensor and cast the result back."""
        f32 = _to_f32(tensor.handle)
        tmp = self_to_tensor(f32, tl.float32)
        res = fn(tmp)
        return res

    def self_to_tensor(data, dtype):
        return tl.core.tensor(it.TensorHandle(np.asarray(data), dtype.scalar), dtype)

    def _back_to_bf16(t):
        return self_to_tensor(_f32_to_bf16_bits(t.handle.data), tl.bfloat16)

    def sum_(self, input):
        if input.dtype.scalar == tl.bfloat16:
            return _back_to_bf16(_wrap_bf16(input, lambda t: orig_sum(self, t)))
        return orig_sum(self, input)

    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if x.dtype.scalar != tl.bfloat16:
            return orig_min_max(self, input, val_reduce_op, idx_reduce_op)
        res = _wrap_bf16(x, lambda t: orig_min_max(self, t, val_reduce_op, idx_reduce_op))
        if isinstance(res, tuple):
            return (_back_to_bf16(res[0]), res[1])
        return res if val_reduce_op is None else _back_to_bf16(res)

    red.sum = sum_
    red.min_max = min_max
    _APPLIED = True
    return True
