"""The engine worker: one background thread that alone touches the engine; HTTP handlers hand it
commands through a queue and await futures. A request the engine fails on fails alone."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable

from areal_tik.engine.server.request_validation import RequestError
from areal_tik.engine.server.worker_weights import WeightUpdateCommands
from areal_tik.kernels import jit_watch

logger = logging.getLogger("areal_tik.server")


class Pending:
    """One /generate request in the engine thread's hands."""

    __slots__ = ("rid", "prompt_ids", "params", "fut", "loop", "out_ids", "out_lps", "version",
                 "want_input_lps", "logprob_start_len", "temperature", "client_gone")

    def __init__(self, rid, prompt_ids, params, fut, loop, want_input_lps, logprob_start_len, temperature):
        self.rid, self.prompt_ids, self.params, self.fut, self.loop = rid, prompt_ids, params, fut, loop
        self.out_ids: list[int] = []
        self.out_lps: list[float] = []
        self.version = None
        self.want_input_lps = want_input_lps
        self.logprob_start_len = logprob_start_len
        self.temperature = temperature
        self.client_gone = False  # set (event-loop thread) once its client went away


class EngineWorker(WeightUpdateCommands):
    """Owns the engine; runs commands and ``engine.step()`` in one background thread.

    ``engine`` must offer ``add_request(rid, input_ids, params)``, ``step() ->
    list[RequestOutput]``, ``abort(rid)``, ``update_weights(path, version)`` and
    ``version``; ``score(input_ids, temperature) -> list[float]`` (log-prob of token i+1
    given tokens <= i) when input log-probs are asked for. Used when present:
    ``has_unfinished()``, ``stage_weights``/``commit_weights``/``check_weight_specs``.

    Guarantees: a request is in ``_active`` only while the engine holds it; an engine fault
    fails the request it belongs to (an output with finish_reason ``"error"``) or, when
    ``step`` itself raises, the requests then in flight, which are removed from the engine;
    the thread keeps serving either way.
    """

    def __init__(self, engine, sampling_params_cls, model_info: Callable[[], dict] | None = None):
        self.engine = engine
        self.SamplingParams = sampling_params_cls
        self._cmds: queue.Queue = queue.Queue()
        self._active: dict[str, Pending] = {}
        self._held: list[Pending] = []  # arrived while paused
        self.paused = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tik-engine", daemon=True)
        self.model_info = model_info
        self.n_steps = 0
        self.n_generated = 0
        self.n_failed = 0  # requests failed after they were accepted (an engine fault)
        self.last_error: str | None = None
        self.groups: dict[str, Any] = {}  # weight-update process groups by name (xccl mode)
        self._interval_reset()

    def _interval_reset(self):
        """Counters since the last weight update (one RL step): how much of a rollout the engine
        was stepping, and from the first request's arrival to the last one's finish."""
        self.iv = {"busy_s": 0.0, "steps": 0, "tokens": 0, "requests": 0, "first_add": None, "last_finish": None,
                   "eager_steps": 0, "eager_s": 0.0, "max_step_s": 0.0, "graphs": self._graph_count(),
                   "jit": jit_watch.snapshot()}

    def _runner_counter(self, name: str) -> int:
        return int(getattr(getattr(self.engine, "runner", None), name, 0) or 0)

    def _graph_count(self) -> int:
        return self._runner_counter("num_graphs")

    def interval_stats(self) -> dict:
        """Also: eager steps (prefill, or decode past the graph buckets) and their seconds, the
        slowest step, CUDA graphs captured and Triton JIT compiles in this interval (``jit_specs``: what each
        of the last compiles specialised, :mod:`areal_tik.kernels.jit_watch`)."""
        iv = self.iv
        span = (iv["last_finish"] - iv["first_add"]) if iv["first_add"] is not None and iv["last_finish"] else None
        jit = jit_watch.delta(iv["jit"])
        return {"engine_busy_s": round(iv["busy_s"], 4), "engine_steps": iv["steps"], "tokens": iv["tokens"],
                "requests": iv["requests"], "first_request_to_last_finish_s": None if span is None else round(span, 4),
                "eager_steps": iv["eager_steps"], "eager_s": round(iv["eager_s"], 4),
                "max_step_ms": round(1e3 * iv["max_step_s"], 2), "graphs_captured": self._graph_count() - iv["graphs"],
                "jit_compiles": jit["compiles"] if jit["installed"] else None, "jit_compile_s": jit["seconds"],
                "jit_kernels": jit["by_kernel"], "jit_specs": jit["specs"]}

    # ---- thread side -------------------------------------------------------------
    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, fn: Callable[[], Any]) -> "asyncio.Future":
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put((fn, fut, loop))
        self._wake.set()
        return fut

    def _resolve(self, fut, loop, value=None, exc=None):
        def _set():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)
        loop.call_soon_threadsafe(_set)

    def _run(self):
        dev = getattr(self.engine, "device", None)
        if dev is not None and str(dev).startswith("cuda"):
            import torch  # lazy: keeps torch out of this module's import
            torch.cuda.set_device(dev)  # this thread's current device = the engine's (e.g. cuda:1)
        while not self._stop.is_set():
            ran = False
            while True:
                try:
                    fn, fut, loop = self._cmds.get_nowait()
                except queue.Empty:
                    break
                ran = True
                try:
                    self._resolve(fut, loop, fn())
                except Exception as e:  # noqa: BLE001 - reported to the HTTP caller
                    logger.error("engine command failed: %s", traceback.format_exc())
                    self._resolve(fut, loop, exc=e)
            if self._active and not self.paused:
                try:
                    t_step = time.perf_counter()
                    n_eager = self._runner_counter("num_eager_steps")
                    outs = self.engine.step()
                    dt = time.perf_counter() - t_step
                    self.iv["busy_s"] += dt
                    self.iv["steps"] += 1
                    self.iv["max_step_s"] = max(self.iv["max_step_s"], dt)
                    if self._runner_counter("num_eager_steps") != n_eager:
                        self.iv["eager_steps"] += 1
                        self.iv["eager_s"] += dt
                except Exception as e:  # noqa: BLE001 - the engine thread never dies
                    self._step_raised(e)
                    continue
                self.n_steps += 1
                for o in outs or ():
                    self._absorb(o)
                self._reconcile()
                continue
            if not ran:
                self._wake.wait(0.05)
                self._wake.clear()

    def _step_raised(self, e: Exception):
        """``engine.step`` itself raised (the LLMEngine contains its requests' faults; another
        engine may not): every request in flight is removed from the engine and failed, so
        the next request starts from an empty engine instead of the same fault."""
        self.last_error = f"{type(e).__name__}: {e}".splitlines()[0]
        logger.error("engine.step failed: %s", traceback.format_exc())
        for rid, p in list(self._active.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort: the request is failed either way
                logger.exception("abort of %s after a failed step failed", rid)
            self._fail(p, RequestError(f"engine step failed: {self.last_error}", 500))

    def _reconcile(self):
        """Fail requests the engine no longer holds (none should exist: a request enters
        ``_active`` only once the engine took it), instead of stepping on them forever."""
        has = getattr(self.engine, "has_unfinished", None)
        if self._active and has is not None and not has():
            for p in list(self._active.values()):
                self._fail(p, RequestError("the engine lost this request", 500))

    def _fail(self, p: Pending, exc: Exception):
        """Remove ``p`` and fail its future with ``exc``; nothing else changes."""
        if self._active.get(p.rid) is p:
            del self._active[p.rid]
        if p in self._held:
            self._held.remove(p)
        self.n_failed += 1
        self._resolve(p.fut, p.loop, exc=exc)

    def _absorb(self, o):
        p = self._active.get(str(o.request_id))
        if p is None:
            return
        if o.finish_reason == "error":
            self.last_error = getattr(o, "error", None) or "error"
            self._fail(p, RequestError(f"the engine failed on this request: {self.last_error}", 500))
            return
        p.out_ids = list(o.output_ids)
        p.out_lps = [float(x) for x in (o.output_logprobs or [])]
        p.version = getattr(o, "version", None)
        if o.finish_reason is not None:
            self._finish(p, o.finish_reason)

    def _finish(self, p: Pending, reason: str):
        self._active.pop(p.rid, None)
        self.n_generated += len(p.out_ids)
        self.iv["tokens"] += len(p.out_ids)
        self.iv["last_finish"] = time.perf_counter()
        input_lps = None
        if p.want_input_lps:
            try:
                input_lps = self._input_logprobs(p)
            except Exception as e:  # noqa: BLE001 - fails this request only
                self._fail(p, RequestError(f"input log-probs failed: {type(e).__name__}: {e}", 500))
                return
        self._resolve(p.fut, p.loop, dict(out_ids=p.out_ids, out_lps=p.out_lps, reason=reason,
                                          version=self.engine.version if p.version is None else p.version,
                                          input_lps=input_lps))

    def _input_logprobs(self, p: Pending) -> list:
        ids = p.prompt_ids
        lps = self.engine.score(ids, p.temperature)  # len(ids) - 1 values
        full = [None] + [float(x) for x in lps]
        start = max(0, min(p.logprob_start_len, len(ids)))
        return [[full[i], int(ids[i]), None] for i in range(start, len(ids))]

    # ---- commands (run in the engine thread) ---------------------------------------
    def cmd_add(self, p: Pending):
        """Queue ``p`` (held while paused). A request id already in flight or held fails
        ``p`` alone (409); the request holding the id is not touched."""
        if p.rid in self._active or any(h.rid == p.rid for h in self._held):
            self._resolve(p.fut, p.loop, exc=RequestError(f"request id {p.rid!r} is already in flight", 409))
            return
        if self.paused:
            self._held.append(p)
            return
        self._add_now(p)

    def _add_now(self, p: Pending):
        """Give ``p`` to the engine; it joins ``_active`` only once the engine took it. An engine
        refusal fails ``p`` alone (400)."""
        if p.params.max_new_tokens <= 0:  # scoring only
            self._finish(p, "length")
            return
        try:
            self.engine.add_request(p.rid, list(p.prompt_ids), p.params)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses fails alone
            self._resolve(p.fut, p.loop, exc=RequestError(f"{e}", 400))
            return
        self._active[p.rid] = p
        self.iv["requests"] += 1
        if self.iv["first_add"] is None:
            self.iv["first_add"] = time.perf_counter()

    def abort_all(self):
        """End every request the engine holds (finish reason ``abort``, output so far); the held
        ones stay held. The number ended."""
        outs = []
        for rid in list(self._active):
            r = self.engine.abort(rid)
            if r is not None:
                outs.extend(r if isinstance(r, (list, tuple)) else [r])
        for o in outs:
            p = self._active.get(str(o.request_id))
            if p is not None and len(o.output_ids) >= len(p.out_ids):
                p.out_ids = list(o.output_ids)
                p.out_lps = [float(x) for x in (o.output_logprobs or [])]
        for p in list(self._active.values()):
            self._finish(p, "abort")
        return len(outs)

    def cmd_abort_all(self) -> int:
        """``/abort_request {abort_all}``: every request the engine holds and every request held
        during a pause ends now with ``abort``. The number ended."""
        n = self.abort_all()
        held, self._held = self._held, []
        for p in held:
            self._finish(p, "abort")
        return n + len(held)

    def cmd_pause(self):
        self.paused = True
        return self.abort_all()

    def cmd_continue(self):
        """Apply the distributed weight update staged during the pause (if any), then run the
        held requests; what happened to the update, or None."""
        try:
            update = self.close_open_update()
        finally:
            self.paused = False
            held, self._held = self._held, []
            for p in held:
                self._add_now(p)
        return update

    def cmd_abort_rid(self, rid: str):
        held = next((h for h in self._held if h.rid == rid), None)
        return self.cmd_cancel(held if held is not None else self._active.get(rid))

    def cmd_cancel(self, p: Pending | None) -> bool:
        """End ``p`` now with ``abort`` and its output so far: held during a pause (it never reached
        the engine), or in the engine (removed there, its KV pages freed). False when ``p`` has
        already ended (or is None)."""
        if p is None:
            return False
        if p in self._held:
            self._held.remove(p)
            self._finish(p, "abort")
            return True
        if self._active.get(p.rid) is not p:
            return False
        r = self.engine.abort(p.rid)
        outs = r if isinstance(r, (list, tuple)) else ([] if r is None else [r])
        for o in outs:  # LLMEngine.abort returns the request's unfinished samples
            if str(o.request_id) == p.rid and len(o.output_ids) >= len(p.out_ids):
                p.out_ids, p.out_lps = list(o.output_ids), [float(x) for x in (o.output_logprobs or [])]
        self._finish(p, "abort")
        return True
