"""HTTP server around :class:`LLMEngine` speaking the subset of SGLang's native API that
AReaL's ``RemoteSGLangEngine`` (``areal/engine/sglang_remote.py``) uses.

Endpoints (responses are ``Content-Type: application/json``; AReaL's client refuses others):

- ``GET /health`` -> 200 once the model is loaded;
- ``GET /model_info``, ``GET /get_server_info`` (also POST) -> model path, kernels mode
  (``tik`` | ``default``), the kernel fingerprint, the weight version and a digest of the
  loaded bf16 weights, and how log-probs are defined (``log_softmax(logits/T)``,
  unfiltered): what the trainer checks before skipping its recompute;
- ``POST /generate`` ``{input_ids, sampling_params, return_logprob, [logprob_start_len],
  [top_logprobs_num], stream=false}`` -> ``{text, output_ids, meta_info: {id,
  finish_reason: {type: stop|length|abort, ...}, prompt_tokens, completion_tokens,
  output_token_logprobs: [[logprob, token_id, None], ...], [input_token_logprobs],
  weight_version}}``. With ``max_new_tokens == 0`` or a ``logprob_start_len`` the input
  log-probs are returned (first position ``None``, like SGLang);
- ``POST /pause_generation`` -> in-flight requests return now with ``finish_reason.type
  == "abort"`` and their partial output (AReaL re-posts them with the output appended:
  regime R5), new requests wait until ``POST /continue_generation``;
- ``POST /update_weights_from_disk {model_path, abort_all_requests}`` -> loads
  synchronously (AReaL deletes the folder right after the reply), bumps the version;
- ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  backend, group_name}`` -> joins the trainer's process group (AReaL's ``xccl`` mode);
  ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
  abort_all_requests}`` -> receives one bucket by broadcast from the trainer and loads it.
  One weight update is several buckets between ``/pause_generation`` and
  ``/continue_generation``: the version advances once, at its first bucket;
  ``POST /destroy_weights_update_group {group_name}`` -> leaves it (NCCL's teardown is
  collective: the trainer's own destroy waits for this one);
- ``POST /flush_cache`` -> no-op success (the engine keeps no cross-request cache that
  could go stale: weights changed means every KV page was freed by the abort).

Stepping happens in one background thread that alone touches the engine; HTTP handlers
hand it commands through a queue and await futures.

Hostile input: every body is checked before the engine sees it (``request_validation``); a
refusal is 400 (409: request id in flight, or a weight update with requests in flight and
no abort) with ``{"success": false, "message", "error": {"message", "type"}}``. A request
the engine fails on later fails alone (500); the others and the server carry on. Weight
updates are all or nothing (``worker_weights``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable

from areal_tik.engine.http_errors import error_middleware, error_reply, json_reply
from areal_tik.engine.request_validation import (Limits, RequestError, parse_abort, parse_disk_update,
                                                 parse_distributed_update, parse_generate, parse_group_init,
                                                 parse_group_name)
from areal_tik.engine.worker_weights import WeightUpdateCommands
from areal_tik.kernels import jit_watch

logger = logging.getLogger("areal_tik.server")

MAX_BODY_BYTES = 64 << 20  # the largest request body (a context-length prompt is well under 1 MiB)


@dataclasses.dataclass
class ServerConfig:
    """``max_running_requests``: sequences decoded together (SGLang's name; AReaL sends a whole
    RL batch at once, e.g. 16 prompts x 8 samples, so 64 made the rollout run in waves).
    ``context_length``: longest prompt + output (SGLang's name; ``None``: the model's, capped at
    8192); it and ``max_running_requests`` bound the KV cache. ``mem_fraction``: share of the
    GPU memory free at start-up the KV cache may take (the trainer shares the GPU in an SPMD
    world of one, so SGLang's ``mem_fraction_static`` = 0.9 is not taken over).
    ``disable_cuda_graph`` / ``cuda_graph_max_bs`` (SGLang's names): ``EngineConfig.enforce_eager`` /
    ``cuda_graph_max_bs``; ``prefill_graph_max_tokens``: ``EngineConfig``'s (``None``: its default)."""
    model: str
    kernels: str = "tik"
    backend: str | None = None          # Settings.backend: the op implementations (bound at patch time)
    precompile: bool = True             # Settings.precompile
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    seed: int = 0
    max_running_requests: int = 256
    context_length: int | None = None
    mem_fraction: float = 0.5
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    prefill_graph_max_tokens: int | None = None


class _Pending:
    """One /generate request in the engine thread's hands."""

    __slots__ = ("rid", "prompt_ids", "params", "fut", "loop", "out_ids", "out_lps", "version",
                 "want_input_lps", "logprob_start_len", "temperature")

    def __init__(self, rid, prompt_ids, params, fut, loop, want_input_lps, logprob_start_len, temperature):
        self.rid, self.prompt_ids, self.params, self.fut, self.loop = rid, prompt_ids, params, fut, loop
        self.out_ids: list[int] = []
        self.out_lps: list[float] = []
        self.version = None
        self.want_input_lps = want_input_lps
        self.logprob_start_len = logprob_start_len
        self.temperature = temperature


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
        self._active: dict[str, _Pending] = {}
        self._held: list[_Pending] = []  # arrived while paused
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
        self._dist_update_open = False  # a bucketed update has started and not been closed by continue
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
        return len(getattr(getattr(self.engine, "runner", None), "_graphs", None) or ())

    def interval_stats(self) -> dict:
        """Also: eager steps (prefill, or decode past the graph buckets) and their seconds, the
        slowest step, CUDA graphs captured and Triton JIT compiles in this interval."""
        iv = self.iv
        span = (iv["last_finish"] - iv["first_add"]) if iv["first_add"] is not None and iv["last_finish"] else None
        jit = jit_watch.delta(iv["jit"])
        return {"engine_busy_s": round(iv["busy_s"], 4), "engine_steps": iv["steps"], "tokens": iv["tokens"],
                "requests": iv["requests"], "first_request_to_last_finish_s": None if span is None else round(span, 4),
                "eager_steps": iv["eager_steps"], "eager_s": round(iv["eager_s"], 4),
                "max_step_ms": round(1e3 * iv["max_step_s"], 2), "graphs_captured": self._graph_count() - iv["graphs"],
                "jit_compiles": jit["compiles"] if jit["installed"] else None, "jit_compile_s": jit["seconds"],
                "jit_kernels": jit["by_kernel"]}

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
            import torch
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

    def _fail(self, p: _Pending, exc: Exception):
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

    def _finish(self, p: _Pending, reason: str):
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

    def _input_logprobs(self, p: _Pending) -> list:
        ids = p.prompt_ids
        lps = self.engine.score(ids, p.temperature)  # len(ids) - 1 values
        full = [None] + [float(x) for x in lps]
        start = max(0, min(p.logprob_start_len, len(ids)))
        return [[full[i], int(ids[i]), None] for i in range(start, len(ids))]

    # ---- commands (run in the engine thread) ---------------------------------------
    def cmd_add(self, p: _Pending):
        """Queue ``p`` (held while paused). A request id already in flight or held fails
        ``p`` alone (409); the request holding the id is not touched."""
        if p.rid in self._active or any(h.rid == p.rid for h in self._held):
            self._resolve(p.fut, p.loop, exc=RequestError(f"request id {p.rid!r} is already in flight", 409))
            return
        if self.paused:
            self._held.append(p)
            return
        self._add_now(p)

    def _add_now(self, p: _Pending):
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

    def cmd_pause(self):
        self.paused = True
        return self.abort_all()

    def cmd_continue(self):
        self.paused = False
        self._dist_update_open = False
        held, self._held = self._held, []
        for p in held:
            self._add_now(p)

    def cmd_abort_rid(self, rid: str):
        held = next((h for h in self._held if h.rid == rid), None)
        if held is not None:  # never reached the engine
            self._held.remove(held)
            self._finish(held, "abort")
            return True
        p = self._active.get(rid)
        if p is None:
            return False
        r = self.engine.abort(rid)
        outs = r if isinstance(r, (list, tuple)) else ([] if r is None else [r])
        for o in outs:  # LLMEngine.abort returns the request's unfinished samples
            if str(o.request_id) == rid and len(o.output_ids) >= len(p.out_ids):
                p.out_ids, p.out_lps = list(o.output_ids), [float(x) for x in (o.output_logprobs or [])]
        self._finish(p, "abort")
        return True


class TikServer:
    """aiohttp application around an :class:`EngineWorker`.

    Every request body is checked at the edge (``request_validation``): a bad one is
    answered 400 (409 for a request id already in flight) with a one-line reason and never
    reaches the engine; every reply, errors included, is JSON (``http_errors``)."""

    def __init__(self, worker: EngineWorker, cfg: ServerConfig, info: dict):
        self.worker = worker
        self.cfg = cfg
        self.info = info  # static: fingerprint, kernels, model path, ...
        self._rid = itertools.count()
        self._inflight: set[str] = set()  # /generate ids between arrival and reply (event-loop thread only)
        self.started = time.time()

    # ---- helpers -----------------------------------------------------------------
    _json = staticmethod(json_reply)

    async def _body(self, request):
        """The JSON body (``None`` when there is none); :class:`RequestError` if it is not JSON."""
        from aiohttp import web
        if not request.can_read_body:
            return None
        try:
            return json.loads(await request.read())
        except web.HTTPException:
            raise  # e.g. 413: the middleware answers it
        except Exception:  # noqa: BLE001 - bad bytes, bad JSON, absurd nesting
            raise RequestError("request body is not valid JSON") from None

    def _limits(self) -> Limits:
        eng = self.worker.engine
        return Limits(vocab_size=getattr(getattr(eng, "runner", None), "vocab_size", None),
                      max_model_len=getattr(eng, "max_model_len", None))

    def _new_rid(self) -> str:
        while (rid := f"tik-{next(self._rid)}") in self._inflight:
            pass
        return rid

    def server_info(self) -> dict:
        w = self.worker
        return {
            **self.info,
            "weight_version": int(w.engine.version),
            "paused": w.paused,
            "active_requests": len(w._active),
            "held_requests": len(w._held),
            "engine_steps": w.n_steps,
            "generated_tokens": w.n_generated,
            "failed_requests": w.n_failed,
            "uptime_s": time.time() - self.started,
            "last_error": w.last_error,
            **(w.model_info() if w.model_info else {}),
        }

    # ---- handlers ----------------------------------------------------------------
    async def health(self, request):
        return self._json({"status": "ok"})

    async def model_info(self, request):
        return self._json({"model_path": self.cfg.model, "tokenizer_path": self.info.get("tokenizer_path"),
                           "is_generation": True, "served_model_name": self.cfg.served_model_name or self.cfg.model,
                           "weight_version": int(self.worker.engine.version)})

    async def get_server_info(self, request):
        # in the engine thread: the weights digest reads the model (which only that thread touches,
        # and on its device: a server on cuda:1 would launch the digest kernel on cuda:0 from here)
        return self._json(await self.worker.submit(self.server_info))

    async def generate(self, request):
        try:
            req = parse_generate(await self._body(request), self._limits())
            params = self.worker.SamplingParams(**req.sampling)
        except (RequestError, ValueError, TypeError) as e:
            return error_reply(getattr(e, "message", str(e)), getattr(e, "status", 400))
        rid = req.rid or self._new_rid()
        if rid in self._inflight:
            return error_reply(f"request id {rid!r} is already in flight; give each request its own rid", 409)
        ids = req.input_ids
        temp = params.temperature if params.temperature > 0 else 1.0
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        p = _Pending(rid, ids, params, fut, loop, req.want_input_logprobs, max(0, req.logprob_start_len or 0), temp)
        self._inflight.add(rid)
        try:
            await self.worker.submit(lambda: self.worker.cmd_add(p))
            try:
                res = await fut
            except asyncio.CancelledError:  # client went away
                await self.worker.submit(lambda: self.worker.cmd_abort_rid(rid))
                raise
        except RequestError as e:
            return error_reply(e.message, e.status)
        finally:
            self._inflight.discard(rid)
        meta = {
            "id": rid,
            "finish_reason": self._finish_reason(res, params),
            "prompt_tokens": len(ids),
            "completion_tokens": len(res["out_ids"]),
            "cached_tokens": 0,
            "weight_version": res["version"],
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res["out_lps"], res["out_ids"])]
            if res["input_lps"] is not None:
                meta["input_token_logprobs"] = res["input_lps"]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [None] * len(res["out_ids"])
        return self._json({"text": "", "output_ids": res["out_ids"], "meta_info": meta})

    @staticmethod
    def _finish_reason(res, params) -> dict:
        r = res["reason"]
        if r == "stop":
            last = res["out_ids"][-1] if res["out_ids"] else None
            return {"type": "stop", "matched": last}
        if r == "length":
            return {"type": "length", "length": params.max_new_tokens}
        if r == "abort":
            msg = "Abort before prefill" if not res["out_ids"] else "Aborted by pause or weight update"
            return {"type": "abort", "message": msg}
        return {"type": str(r)}

    async def pause_generation(self, request):
        n = await self.worker.submit(self.worker.cmd_pause)
        return self._json({"success": True, "aborted": n})

    async def continue_generation(self, request):
        await self.worker.submit(self.worker.cmd_continue)
        return self._json({"success": True})

    async def _weights_call(self, what: str, fn):
        """Run weight-update command ``fn`` in the engine thread; a refusal is a one-line reply
        (its status: 400, or 409 for requests in flight), after which nothing has changed."""
        try:
            return await self.worker.submit(fn), None
        except RequestError as e:
            logger.error("%s refused: %s", what, e.message)
            return None, error_reply(e.message, e.status)
        except Exception as e:  # noqa: BLE001 - WeightUpdateError, a missing or unreadable checkpoint, ...
            logger.error("%s failed: %s", what, e)
            return None, error_reply(f"{what}: {type(e).__name__}: {e}", 400)

    async def update_weights_from_disk(self, request):
        try:
            path, abort = parse_disk_update(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        res, err = await self._weights_call("update_weights_from_disk",
                                            lambda: self.worker.cmd_update_weights(path, abort))
        if err is not None:
            return err
        logger.info("loaded weights from %s as version %s in %.2fs (+ digest %.2fs); since the previous update: %s",
                    path, res["version"], res["load_s"], res.get("info_s", 0.0), res.get("previous_interval"))
        return self._json({"success": True, "message": "Succeeded to update model weights.",
                           "num_paused_requests": 0, **res})

    async def init_weights_update_group(self, request):
        from areal_tik.engine.weight_group import join_group
        try:
            args = parse_group_init(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        old = self.worker.groups.pop(args["group_name"], None)
        if old is not None:  # a restarted trainer re-creates its group: it is already waiting in the rendezvous
            from areal_tik.engine.weight_group import leave_group
            logger.warning("weight update group %s exists: replacing it (trainer restarted?)", args["group_name"])
            await asyncio.to_thread(leave_group, old)
        t0 = time.perf_counter()
        try:  # the rendezvous blocks until the trainer joins: off the event loop and the engine thread
            pg = await asyncio.to_thread(join_group, **args)
        except Exception as e:  # noqa: BLE001
            logger.error("joining weight update group %s failed: %s", args, e)
            return error_reply(f"{type(e).__name__}: {e}", 400)
        self.worker.groups[args["group_name"]] = pg
        logger.info("joined weight update group %s as rank %d of %d (%s) in %.2fs", args["group_name"], args["rank"],
                    args["world_size"], args["backend"], time.perf_counter() - t0)
        return self._json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request):
        """Leave a weight update group. NCCL's communicator teardown is collective: a trainer
        destroying its side blocks until this side does too (AReaL's engine ``destroy`` hung
        there for minutes with no call like this one)."""
        try:
            name = parse_group_name(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        pg = self.worker.groups.pop(name, None)
        if pg is None:
            return error_reply(f"no weight update group {name!r}", 400)
        from areal_tik.engine.weight_group import leave_group
        await asyncio.to_thread(leave_group, pg)
        logger.info("left weight update group %s", name)
        return self._json({"success": True, "message": f"left {name}"})

    async def update_weights_from_distributed(self, request):
        try:
            req = parse_distributed_update(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        res, err = await self._weights_call("update_weights_from_distributed",
                                            lambda: self.worker.cmd_update_from_distributed(req))
        if err is not None:
            return err
        logger.info("received %d tensors from group %s into version %s in %.2fs%s", len(req["names"]),
                    req["group_name"], res["version"], res["load_s"],
                    f"; since the previous update: {res['previous_interval']}" if res.get("previous_interval") else "")
        return self._json({"success": True, "message": "Succeeded to update model weights.", **res})

    async def flush_cache(self, request):
        return self._json({"success": True})

    async def abort_request(self, request):
        try:
            abort_all, rid = parse_abort(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        if abort_all:
            n = await self.worker.submit(self.worker.abort_all)
            return self._json({"success": True, "aborted": n})
        ok = await self.worker.submit(lambda: self.worker.cmd_abort_rid(rid))
        return self._json({"success": bool(ok)})

    async def unsupported(self, request):
        return error_reply(f"{request.path} is not supported by the areal-tik server (no LoRA, no memory offload)",
                           400)

    def app(self):
        from aiohttp import web
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware()])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_post("/get_server_info", self.get_server_info)
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        for path in ("/load_lora_adapter",
                     "/unload_lora_adapter", "/release_memory_occupation", "/resume_memory_occupation"):
            r.add_post(path, self.unsupported)
        return app


def run_server(server: TikServer, ready: threading.Event | None = None, stop: threading.Event | None = None):
    """Serve until ``stop`` is set (or forever); blocking. Starts the engine thread."""
    from aiohttp import web

    async def main():
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, server.cfg.host, server.cfg.port)
        await site.start()
        logger.info("areal-tik server (%s kernels, fingerprint %s) on http://%s:%d", server.info.get("kernels"),
                    server.info.get("kernel_fingerprint"), server.cfg.host, server.cfg.port)
        if ready is not None:
            ready.set()
        try:
            while stop is None or not stop.is_set():
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()

    server.worker.start()
    try:
        asyncio.run(main())
    finally:
        server.worker.stop()
        from areal_tik.engine.weight_group import leave_group
        for pg in server.worker.groups.values():
            leave_group(pg)


def _default_fingerprint() -> str:
    import hashlib

    from areal_tik.dispatch.fingerprint import environment
    env = environment()
    return "default-" + hashlib.sha256(json.dumps(env, sort_keys=True, default=str).encode()).hexdigest()[:12]


def build(cfg: ServerConfig, device: str | None = None, dtype: str = "bfloat16") -> TikServer:
    """Build model (preset or HF dir), patch it per ``cfg.kernels``, wrap engine and server."""
    import os

    import torch

    from areal_tik.layers.weights_digest import model_digest
    from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
    from areal_tik.layers.models import build_model

    if cfg.kernels not in ("tik", "default"):
        raise ValueError(f"--kernels must be 'tik' or 'default', got {cfg.kernels!r}")
    jit_watch.install()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, dtype=getattr(torch, dtype), device=device)
    from areal_tik.layers.patch import patch_model
    model = patch_model(model, kernels=cfg.kernels, backend=cfg.backend)
    model.eval()
    t1 = time.perf_counter()
    max_pos = int(getattr(model.config, "max_position_embeddings", 8192))
    graphs = {} if cfg.prefill_graph_max_tokens is None else {"prefill_graph_max_tokens": int(cfg.prefill_graph_max_tokens)}
    engine = LLMEngine(model, EngineConfig(max_num_seqs=int(cfg.max_running_requests),
                                           max_model_len=min(int(cfg.context_length), max_pos)
                                           if cfg.context_length else None,
                                           gpu_memory_utilization=float(cfg.mem_fraction),
                                           enforce_eager=bool(cfg.disable_cuda_graph),
                                           cuda_graph_max_bs=cfg.cuda_graph_max_bs, **graphs))
    _attach_score(engine, model)
    logger.info("start-up: model built/loaded + patched in %.1fs, engine (KV cache) in %.1fs",
                t1 - t0, time.perf_counter() - t1)
    if cfg.kernels == "tik":
        # every linear tile config a prefill or decode step can pick, compiled now rather than
        # inside a rollout (a no-op off CUDA)
        from areal_tik.layers.precompile import precompile_linears
        precompile_linears(model, max_tokens=max(engine.config.max_num_batched_tokens, engine.config.max_num_seqs),
                           enabled=cfg.precompile)

    if cfg.kernels == "tik":
        from areal_tik.dispatch.fingerprint import compute
        fp = compute(cfg.backend)
        fingerprint, selection = fp["fingerprint"], fp["selection"]
    else:
        fingerprint, selection = _default_fingerprint(), {}
    tok_path = cfg.model if os.path.isdir(cfg.model) else None
    info = {
        "model_path": cfg.model,
        "tokenizer_path": tok_path,
        "kernels": cfg.kernels,
        "kernel_fingerprint": fingerprint,
        "kernel_selection": selection,
        "logprobs": "log_softmax(logits.float()/T)[token], unfiltered (no top-p/top-k/penalty)",
        "dtype": dtype,
        "device": device,
        "server": "areal-tik",
    }
    digest_cache = {}

    def model_info():
        v = engine.weights_serial  # advances with every load (a bucketed update is several per version)
        if digest_cache.get("v") != v:
            digest_cache.update(v=v, d=model_digest(model, dtype=getattr(torch, dtype)))
        return {"weights_digest": digest_cache["d"]}

    worker = EngineWorker(engine, SamplingParams, model_info=model_info)
    return TikServer(worker, cfg, info)


def _attach_score(engine, model):
    """Give the engine a ``score(ids, T)``: log-prob of ids[i+1] given ids[:i+1], one plain
    forward on the same patched model, through the same log-prob op the sampler uses."""
    if hasattr(engine, "score"):
        return
    import torch

    from areal_tik.dispatch import ops

    @torch.no_grad()
    def score(ids, temperature):
        dev = next(model.parameters()).device
        x = torch.tensor([list(ids)], dtype=torch.long, device=dev)
        pos = torch.arange(x.shape[1], device=dev)[None]
        logits = model(input_ids=x, position_ids=pos, use_cache=False).logits[0]
        return ops.logprobs_from_logits(logits[:-1], x[0, 1:], float(temperature)).tolist()

    engine.score = score
