"""Capturing the engine's CUDA graphs: one memory pool, the graphs by key, and the rules every capture
follows. What a graph holds (a decode or prefill forward on static buffers) is the runner's business
(``model_runner.py``); how it is captured safely is here.

- Before a capture, the forward runs once eagerly on a side stream (Triton compiles outside the
  capture) under a *warm-up* context that must store no K/V; the capture then runs under the real
  context, on this runner's device and its own stream (``torch.cuda.graph``'s default capture stream
  lives on the *current* device, so a runner on cuda:1 next to a trainer on cuda:0 captured nothing),
  with ``capture_error_mode="thread_local"`` (other threads' CUDA calls, e.g. the NCCL watchdog of an
  xccl weight-update group, cannot invalidate it).
- Python's cyclic garbage collector is paused during a capture (:func:`gc_paused`).
- A failed capture leaves the device's current stream as it was and makes the next capture start a
  fresh memory pool (:meth:`GraphCapture.capturing`).
- On a CPU the tests emulate graphs (:class:`EmulatedGraph`): the warm-up runs for real, the capture
  records the forward, a replay re-runs it on the static buffers.
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch

from areal_tik.layers.attn_context import AttentionContext, reset_context, set_context

__all__ = ["GraphCapture", "EmulatedGraph", "gc_paused"]


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off inside the block, then as it was before. A collection inside a
    CUDA graph capture may free objects that only a reference cycle kept alive -- a dead engine's CUDA graphs
    (torch >= 2.9 no longer collects before a capture) -- and destroying a graph is not permitted while this
    thread captures: torch warns "operation not permitted when stream is capturing (function reset)" and the
    capture is invalidated (its capture_end raises). Explicit ``gc.collect()`` calls still run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class EmulatedGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on a CPU: ``replay`` runs ``fn`` and copies
    its result into the static output ``out`` (allocated, unwritten, at capture)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


class GraphCapture:
    """The graphs of one runner on ``device`` (emulated when ``emulate``): ``graphs`` maps a key to
    ``(graph, static output)``, all captured into one memory pool (``pool``); ``seconds`` is the wall time
    spent in warm-ups and captures."""

    def __init__(self, device: torch.device, emulate: bool):
        self.device, self.emulate = device, emulate
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None
        self.seconds = 0.0

    @contextlib.contextmanager
    def capturing(self):
        """The context of one capture. Python's GC is paused (:func:`gc_paused`). On a GPU the runner's device is
        current and, after the block, the device's current stream is the one before it, also when the capture
        raised (``torch.cuda.graph`` leaves its capture stream current when ``capture_end`` raises). If the block
        raises, the next capture starts a fresh memory pool: torch's ``capture_end`` raises before it ends the
        pool's allocation recording, and every later capture into that pool would fail ("beginAllocateToPool:
        already recording to mempool_id"). The graphs captured before keep their pool."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(gc_paused())
            if not self.emulate:
                stack.enter_context(torch.cuda.device(self.device))
                stack.enter_context(torch.cuda.stream(torch.cuda.current_stream(self.device)))
            try:
                yield
            except BaseException:
                self.pool = None
                raise

    def record(self, key, ctx: AttentionContext, warm: AttentionContext, fwd, warm_fwd=None):
        """Warm up ``warm_fwd`` (default ``fwd``) eagerly under ``warm`` (which must not store K/V), then capture
        ``fwd`` under ``ctx`` into ``graphs[key]`` (an emulated graph on a CPU) in :meth:`capturing`.
        Returns (graph, static output)."""
        warm_fwd = warm_fwd or fwd
        t0 = time.perf_counter()
        set_context(warm)
        try:
            if self.emulate:
                out = warm_fwd()   # warm-up (runs for real, as on the GPU)

                def fn(ctx=ctx):
                    set_context(ctx)
                    try:
                        return fwd()
                    finally:
                        reset_context()
                with self.capturing():
                    graph = EmulatedGraph(fn, torch.empty_like(out))
                out = graph.out
            else:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    warm_fwd()   # warm-up: compile kernels outside capture
                torch.cuda.current_stream(self.device).wait_stream(stream)
                set_context(ctx)
                with self.capturing():
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                        out = fwd()
                if self.pool is None:
                    self.pool = graph.pool()
        finally:
            reset_context()
        self.graphs[key] = (graph, out)
        self.seconds += time.perf_counter() - t0
        return graph, out
