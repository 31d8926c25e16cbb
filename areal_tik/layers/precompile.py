"""Compile, before the first step, every linear tile config a patched model can pick.

The Triton linear picks its tile config from the row count M (``kernels/linear``: tuned M
buckets per (N, K), else a built-in rule). Each config is a separate Triton compile, so a
micro-batch or prefill whose M lands in a bucket not seen before pays a JIT compile (0.3-3 s
for the TMA kernels) inside that step. :func:`precompile_linears` launches the model's *bound*
linear (the implementation ``patch_model`` chose) once per reachable config, on small dummy
inputs (M is not specialised by the kernels, so any M compiles the same binary), so that no
later step compiles. Which configs are reachable is the bound implementation's own answer
(``ImplInfo.tile_configs``); an implementation without tile configs (``torch_ref``) has nothing
to compile, and nothing runs.

What it covers: every ``TikLinear`` shape of the model (on a stacked inference model, ``layers/stacking.py``, the
stacked q/k/v and gate/up GEMMs in place of the linears they stack, which run only without their stack; a stacked
gate/up that runs fused with its activation, ``linear_silu_mul``, also compiles the fused kernels' configs) and the
router GEMM of its MoE blocks, for M in
``[1, max_tokens]``; and the MoE blocks themselves: each distinct block shape runs once (router, experts,
combine) at one token count per grouped-GEMM tile the bound experts op lists (``ImplInfo.tile_configs``; the
torch_ref one lists none), on zero hidden states with the block's own weights when they are plain CUDA tensors
(a sharded trainer's blocks compile on their first forward instead). It does not change any result (dummy
inputs only; the model's weights are only read).
``Settings.precompile = False`` (``actor.tik.precompile=false``, ``serve --no-precompile``) turns it off.
"""
from __future__ import annotations

import logging
import time

import torch

from areal_tik.kernels import jit_watch
from areal_tik.layers.modules import TikLinear, fuses_gate_up_silu
from areal_tik.layers.moe import TikMoE
from areal_tik.layers.stacking import GATE_UP_ATTR, StackedWeights, stacks_of

__all__ = ["linear_shapes", "precompile_plan", "moe_plan", "precompile_linears"]

logger = logging.getLogger("areal_tik.precompile")


def _by_ops(pairs) -> list[tuple[object, list[tuple]]]:
    """``(bound ops, shape)`` pairs grouped by ops: [(bound ops, its distinct shapes in first-seen order)]."""
    groups: dict[int, tuple[object, list]] = {}
    for ops, shape in pairs:
        seen = groups.setdefault(id(ops), (ops, []))[1]
        if shape not in seen:
            seen.append(shape)
    return list(groups.values())


def _shapes_by_ops(model: torch.nn.Module, dtype: torch.dtype | None) -> list[tuple[object, list[tuple]]]:
    """[(bound ops, their distinct ``(N, K, dtype, has_bias)``)] over the model's ``TikLinear`` modules, the router
    GEMMs of its MoE blocks, and the stacked q/k/v and gate/up GEMMs an inference model runs in place of the separate
    projections, which leave the list (``layers/stacking.py``: their N is the sum of the stacked linears', a shape of
    its own with tile configs of its own)."""
    def pairs():
        # a stacked inference model runs its stacks in place of the stacked linears (those run only without the
        # stack: autograd on, or a parameter replaced), so the separate shapes are left out: compiles at start-up
        # cost seconds
        stacked = {id(lin) for m in model.modules() for st in stacks_of(m) for lin in st.linears}
        for m in model.modules():
            ops = getattr(m, "_tik_ops", None)
            if isinstance(m, TikLinear) and id(m) not in stacked:
                n, k = (int(s) for s in m.weight.shape)
                yield ops, (n, k, dtype or m.weight.dtype, m.bias is not None)
            elif isinstance(m, TikMoE) and ops is not None:     # the router
                yield ops, (*(int(s) for s in m.gate.weight.shape), dtype or m.gate.weight.dtype, False)
            if ops is not None:
                for st in stacks_of(m):
                    yield ops, (*(int(s) for s in st.weight.shape), dtype or st.weight.dtype, st.bias is not None)
    return _by_ops(pairs())


def linear_shapes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[tuple[int, int, torch.dtype, bool]]:
    """Distinct ``(N, K, dtype, has_bias)`` of the model's ``TikLinear`` modules (global shapes:
    a DTensor-sharded weight reports the full one). ``dtype``: the dtype the forward runs in,
    when it is not the stored weights' (FSDP2 keeps fp32 masters and computes in bf16)."""
    out = []
    for _, shapes in _shapes_by_ops(model, dtype):
        out += [s for s in shapes if s not in out]
    return out


def _fused_gate_up_by_ops(model: torch.nn.Module, dtype: torch.dtype | None) -> list[tuple[object, list[tuple]]]:
    """[(bound ops, distinct ``(2I, K, dtype, has_bias)``)] of the stacked gate/up GEMMs that run fused with their
    activation (``linear_silu_mul``, where ``modules.fuses_gate_up_silu``)."""
    stacks = ((getattr(m, "_tik_ops", None), getattr(m, GATE_UP_ATTR, None)) for m in model.modules())
    return _by_ops((ops, (*(int(s) for s in st.weight.shape), dtype or st.weight.dtype, st.bias is not None))
                   for ops, st in stacks
                   if ops is not None and isinstance(st, StackedWeights) and fuses_gate_up_silu(ops))


def precompile_plan(model: torch.nn.Module, max_tokens: int, min_tokens: int, device,
                    dtype: torch.dtype | None = None) -> list[tuple]:
    """``[(bound op, N, K, dtype, has_bias, config)]``: one launch per config that the model's bound linear can
    compile for M in ``[min_tokens, max_tokens]`` on ``device``, and per config its fused gate/up + activation
    (``linear_silu_mul``) can (empty for implementations without tile configs)."""
    work = []
    plans = (("linear", _shapes_by_ops(model, dtype)), ("linear_silu_mul", _fused_gate_up_by_ops(model, dtype)))
    for op, by_ops in plans:
        for ops, shapes in by_ops:
            configs = ops.impls[op].tile_configs if ops is not None else None
            if configs is None:
                continue          # an implementation that compiles nothing per tile config
            fn = ops.impls[op].fn     # the bound implementation itself (a host's wrapper may take no config)
            work += [(fn, n, k, dt, hb, name) for n, k, dt, hb in shapes
                     for name in configs(n, k, dt, min_tokens, max_tokens, device)]
    return work


def moe_plan(model: torch.nn.Module, max_tokens: int, min_tokens: int) -> list[tuple[TikMoE, list[int]]]:
    """``[(MoE block, token counts)]``: one block per distinct (bound ops, shape), run at the token counts its
    bound experts op lists; blocks whose weights are not plain tensors (a sharded trainer) are left out."""
    seen: dict[tuple, tuple[TikMoE, list[int]]] = {}
    for m in model.modules():
        ops = getattr(m, "_tik_ops", None)
        if not isinstance(m, TikMoE) or ops is None:
            continue
        counts_for = ops.impls["moe_experts"].tile_configs
        w = m.experts.gate_up_proj
        if counts_for is None or type(w.data) is not torch.Tensor:
            continue
        key = (id(ops), tuple(w.shape), tuple(m.experts.down_proj.shape), w.dtype, m._tik_top_k, m._tik_norm_topk,
               hasattr(m, "shared_expert"))
        if key not in seen:
            seen[key] = (m, counts_for(int(w.shape[0]), int(m._tik_top_k), min_tokens, max_tokens))
    return list(seen.values())


def step_token_bound(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The most tokens one forward can carry under a scheduler with these limits: a prefill step holds up to the
    token budget, a decode step one token per running sequence, whichever is larger (the ``max_tokens`` a host
    passes to :func:`precompile_linears`)."""
    return max(int(max_num_batched_tokens), int(max_num_seqs))


def precompile_linears(model: torch.nn.Module, max_tokens: int, min_tokens: int = 1,
                       device: torch.device | str | None = None, progress: bool = False,
                       dtype: torch.dtype | None = None, enabled: bool = True) -> dict:
    """Launch the bound linear once per reachable config of ``model``, and each MoE block shape once per token
    count of :func:`moe_plan` (CUDA only; a no-op elsewhere and when ``enabled`` is False, ``Settings.precompile``).
    ``dtype``: the compute dtype when it differs from the stored weights' (see :func:`linear_shapes`).

    Returns ``{"shapes", "configs", "compiles", "compile_s", "seconds"}``; ``compiles`` counts
    the Triton compilations this caused (0 when all were compiled already, in memory)."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        p = next(model.parameters(), None)
        dev = p.device if p is not None and p.device.type == "cuda" else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    res = {"shapes": len(linear_shapes(model, dtype)), "configs": 0, "compiles": 0, "compile_s": 0.0,
           "seconds": 0.0}
    if dev.type != "cuda" or not enabled:
        return res
    work = precompile_plan(model, max_tokens, min_tokens, dev, dtype)
    moe = [(block, counts) for block, counts in moe_plan(model, max_tokens, min_tokens) if block.gate.weight.is_cuda]
    if not work and not moe:
        return res
    jit_watch.install()
    before, t0 = jit_watch.snapshot(), time.perf_counter()
    it = work
    if progress:
        from tqdm import tqdm   # only when a caller asks for a bar
        it = tqdm(work, desc="precompiling linear configs", unit="cfg")
    with torch.cuda.device(dev), torch.no_grad():
        m = 64
        for op, n, k, dt, hb, name in it:
            w = torch.zeros((n, k), dtype=dt, device=dev)
            b = torch.zeros((n,), dtype=dt, device=dev) if hb else None
            x = torch.zeros((m, k), dtype=dt, device=dev)
            op(x, w, b, config=name)
            del w, b, x
        for block, counts in moe:     # router, grouped-GEMM tiles, combine (and shared expert) of each block shape
            for t in counts:
                block(torch.zeros((t, block.gate.weight.shape[1]), dtype=block.gate.weight.dtype, device=dev))
        torch.cuda.synchronize(dev)
    d = jit_watch.delta(before)
    res.update(configs=len(work) + sum(len(c) for _, c in moe), compiles=d["compiles"], compile_s=d["seconds"],
               seconds=round(time.perf_counter() - t0, 3))
    logger.info("precompiled %d launches (linear configs over %d shapes, %d MoE block runs; M %d..%d) in %.1fs, "
                "%d compiles", res["configs"], res["shapes"], sum(len(c) for _, c in moe), min_tokens, max_tokens,
                res["seconds"], res["compiles"])
    return res
