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

from areal_tik.kernels import jit_watch

logger = logging.getLogger("areal_tik.server")

JSON = "application/json"
TOP_K_DISABLED = 1 << 30


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


class EngineWorker:
    """Owns the engine; runs commands and ``engine.step()`` in one background thread.

    ``engine`` must offer ``add_request(rid, input_ids, params)``, ``step() ->
    list[RequestOutput]``, ``abort(rid)``, ``update_weights(path, version)`` and
    ``version``; ``score(input_ids, temperature) -> list[float]`` (log-prob of token i+1
    given tokens <= i) when input log-probs are asked for.
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
                except Exception as e:  # noqa: BLE001
                    self.last_error = traceback.format_exc()
                    logger.error("engine.step failed: %s", self.last_error)
                    for p in list(self._active.values()):
                        self._resolve(p.fut, p.loop, exc=e)
                    self._active.clear()
                    continue
                self.n_steps += 1
                for o in outs or ():
                    self._absorb(o)
                continue
            if not ran:
                self._wake.wait(0.05)
                self._wake.clear()

    def _absorb(self, o):
        p = self._active.get(str(o.request_id))
        if p is None:
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
            except Exception as e:  # noqa: BLE001
                self._resolve(p.fut, p.loop, exc=e)
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
        if self.paused:
            self._held.append(p)
            return
        self._add_now(p)

    def _add_now(self, p: _Pending):
        if p.params.max_new_tokens <= 0:  # scoring only
            self._finish(p, "length")
            return
        self._active[p.rid] = p
        self.engine.add_request(p.rid, list(p.prompt_ids), p.params)
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

    def cmd_update_weights(self, path: str, abort: bool):
        self._dist_update_open = False
        return self._load(lambda: path, abort, new_version=True, what="update_weights_from_disk", with_info=True)

    def cmd_update_from_distributed(self, body: dict, abort: bool):
        """One bucket of an xccl update: receive (in this thread, the only one touching the
        model) and load it. The first bucket after a pause opens a new version."""
        from areal_tik.engine.weight_group import receive_bucket
        pg = self.groups.get(body.get("group_name"))
        if pg is None:
            raise RuntimeError(f"update_weights_from_distributed: no weight update group {body.get('group_name')!r} "
                               f"(known: {sorted(self.groups)}); call /init_weights_update_group first")
        new_version = not self._dist_update_open
        device = getattr(self.engine, "device", "cpu")
        res = self._load(lambda: receive_bucket(pg, body["names"], body["dtypes"], body["shapes"], device), abort,
                         new_version=new_version, what="update_weights_from_distributed", with_info=False)
        self._dist_update_open = True  # only once a bucket loaded: a failed first bucket opens no version
        return res

    def _load(self, source: Callable[[], Any], abort: bool, new_version: bool, what: str, with_info: bool):
        """``with_info``: also compute the model info (weights digest) now; a bucket leaves it to
        the next ``/get_server_info`` (only the last bucket's digest would mean anything)."""
        if abort:
            self.abort_all()
        elif self._active:
            raise RuntimeError(f"{what} with requests in flight and abort_all_requests=false")
        version = int(self.engine.version) + (1 if new_version else 0)
        interval = None
        if new_version:
            interval = self.interval_stats()
            self._interval_reset()
        t0 = time.perf_counter()
        self.engine.update_weights(source(), version)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        info = self.model_info() if self.model_info and with_info else {}
        return {"version": version, "load_s": dt, "info_s": time.perf_counter() - t1, "previous_interval": interval,
                **info}


class TikServer:
    """aiohttp application around an :class:`EngineWorker`."""

    def __init__(self, worker: EngineWorker, cfg: ServerConfig, info: dict):
        self.worker = worker
        self.cfg = cfg
        self.info = info  # static: fingerprint, kernels, model path, ...
        self._rid = itertools.count()
        self.started = time.time()

    # ---- helpers -----------------------------------------------------------------
    @staticmethod
    def _json(obj, status=200):
        from aiohttp import web
        return web.Response(text=json.dumps(obj), status=status, content_type=JSON)

    async def _body(self, request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            raise ValueError("request body is not JSON")
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        return body

    def server_info(self) -> dict:
        w = self.worker
        return {
            **self.info,
            "weight_version": int(w.engine.version),
            "paused": w.paused,
            "active_requests": len(w._active),
            "engine_steps": w.n_steps,
            "generated_tokens": w.n_generated,
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

    def _params(self, sp: dict):
        temp = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
        top_k = sp.get("top_k", -1)
        top_k = -1 if top_k is None or int(top_k) <= 0 or int(top_k) >= TOP_K_DISABLED else int(top_k)
        if float(sp.get("frequency_penalty", 0.0) or 0.0) != 0.0:
            raise ValueError("frequency_penalty is not supported by the tik server (it would change the log-probs)")
        if float(sp.get("presence_penalty", 0.0) or 0.0) != 0.0:
            raise ValueError("presence_penalty is not supported by the tik server")
        if sp.get("stop"):
            raise ValueError("string stop sequences ('stop') are not supported; use stop_token_ids")
        if int(sp.get("min_new_tokens", 0) or 0) != 0:
            raise ValueError("min_new_tokens is not supported")
        return self.worker.SamplingParams(
            temperature=temp,
            top_p=float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0),
            top_k=top_k,
            max_new_tokens=int(sp.get("max_new_tokens", 128) if sp.get("max_new_tokens") is not None else 128),
            stop_token_ids=[int(t) for t in (sp.get("stop_token_ids") or [])],
            ignore_eos=bool(sp.get("ignore_eos", False)),
            seed=sp.get("sampling_seed", sp.get("seed")),
        )

    async def generate(self, request):
        try:
            body = await self._body(request)
            if body.get("stream"):
                raise ValueError("stream=true is not supported")
            ids = body.get("input_ids")
            if not isinstance(ids, list) or not ids or isinstance(ids[0], list):
                raise ValueError("input_ids must be a non-empty list of token ids (batched input not supported)")
            ids = [int(t) for t in ids]
            if body.get("image_data"):
                raise ValueError("image_data is not supported")
            if body.get("lora_path"):
                raise ValueError("LoRA is not supported")
            params = self._params(body.get("sampling_params") or {})
        except (ValueError, TypeError) as e:
            return self._json({"error": {"message": str(e), "type": "invalid_request"}}, status=400)
        rid = str(body.get("rid") or f"tik-{next(self._rid)}")
        lsl = body.get("logprob_start_len")
        want_input = bool(body.get("return_logprob")) and (lsl is not None and int(lsl) >= 0
                                                           or params.max_new_tokens == 0)
        temp = params.temperature if params.temperature > 0 else 1.0
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        p = _Pending(rid, ids, params, fut, loop, want_input, int(lsl or 0) if lsl is not None else 0, temp)
        await self.worker.submit(lambda: self.worker.cmd_add(p))
        try:
            res = await fut
        except asyncio.CancelledError:  # client went away
            await self.worker.submit(lambda: self.worker.cmd_abort_rid(rid))
            raise
        except Exception as e:  # noqa: BLE001
            return self._json({"error": {"message": f"{type(e).__name__}: {e}", "type": "engine_error"}}, status=500)
        meta = {
            "id": rid,
            "finish_reason": self._finish_reason(res, params),
            "prompt_tokens": len(ids),
            "completion_tokens": len(res["out_ids"]),
            "cached_tokens": 0,
            "weight_version": res["version"],
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res["out_lps"], res["out_ids"])]
            if res["input_lps"] is not None:
                meta["input_token_logprobs"] = res["input_lps"]
            if body.get("top_logprobs_num"):
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

    async def update_weights_from_disk(self, request):
        try:
            body = await self._body(request)
            path = body["model_path"]
        except (ValueError, KeyError) as e:
            return self._json({"success": False, "message": f"bad request: {e}"}, status=400)
        abort = bool(body.get("abort_all_requests", False))
        try:
            res = await self.worker.submit(lambda: self.worker.cmd_update_weights(path, abort))
        except Exception as e:  # noqa: BLE001
            logger.error("weight update from %s failed: %s", path, e)
            return self._json({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        logger.info("loaded weights from %s as version %s in %.2fs (+ digest %.2fs); since the previous update: %s",
                    path, res["version"], res["load_s"], res.get("info_s", 0.0), res.get("previous_interval"))
        return self._json({"success": True, "message": "Succeeded to update model weights.",
                           "num_paused_requests": 0, **res})

    async def init_weights_update_group(self, request):
        from areal_tik.engine.weight_group import join_group
        try:
            body = await self._body(request)
            args = dict(master_address=str(body["master_address"]), master_port=int(body["master_port"]),
                        rank=int(body.get("rank_offset", 1)), world_size=int(body["world_size"]),
                        group_name=str(body.get("group_name", "weight_update_group")),
                        backend=str(body.get("backend", "nccl")))
        except (ValueError, KeyError, TypeError) as e:
            return self._json({"success": False, "message": f"bad request: {e}"}, status=400)
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
            return self._json({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        self.worker.groups[args["group_name"]] = pg
        logger.info("joined weight update group %s as rank %d of %d (%s) in %.2fs", args["group_name"], args["rank"],
                    args["world_size"], args["backend"], time.perf_counter() - t0)
        return self._json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request):
        """Leave a weight update group. NCCL's communicator teardown is collective: a trainer
        destroying its side blocks until this side does too (AReaL's engine ``destroy`` hung
        there for minutes with no call like this one)."""
        try:
            name = str((await self._body(request)).get("group_name", "weight_update_group"))
        except (ValueError, TypeError) as e:
            return self._json({"success": False, "message": f"bad request: {e}"}, status=400)
        pg = self.worker.groups.pop(name, None)
        if pg is None:
            return self._json({"success": False, "message": f"no weight update group {name!r}"}, status=400)
        from areal_tik.engine.weight_group import leave_group
        await asyncio.to_thread(leave_group, pg)
        logger.info("left weight update group %s", name)
        return self._json({"success": True, "message": f"left {name}"})

    async def update_weights_from_distributed(self, request):
        try:
            body = await self._body(request)
            for k in ("names", "dtypes", "shapes"):
                if not isinstance(body.get(k), list):
                    raise ValueError(f"{k} must be a list")
            if body.get("load_format") not in (None, "direct", "auto"):
                raise ValueError(f"load_format {body.get('load_format')!r} is not supported")
        except ValueError as e:
            return self._json({"success": False, "message": f"bad request: {e}"}, status=400)
        abort = bool(body.get("abort_all_requests", False))
        try:
            res = await self.worker.submit(lambda: self.worker.cmd_update_from_distributed(body, abort))
        except Exception as e:  # noqa: BLE001
            logger.error("weight update from group %s failed: %s", body.get("group_name"), e)
            return self._json({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        logger.info("received %d tensors from group %s into version %s in %.2fs%s", len(body["names"]),
                    body.get("group_name"), res["version"], res["load_s"],
                    f"; since the previous update: {res['previous_interval']}" if res.get("previous_interval") else "")
        return self._json({"success": True, "message": "Succeeded to update model weights.", **res})

    async def flush_cache(self, request):
        return self._json({"success": True})

    async def abort_request(self, request):
        body = await self._body(request)
        if body.get("abort_all"):
            n = await self.worker.submit(self.worker.abort_all)
            return self._json({"success": True, "aborted": n})
        ok = await self.worker.submit(lambda: self.worker.cmd_abort_rid(str(body.get("rid"))))
        return self._json({"success": bool(ok)})

    async def unsupported(self, request):
        return self._json({"success": False, "message": f"{request.path} is not supported by the areal-tik server "
                                                       "(no LoRA, no memory offload)"},
                          status=400)

    def app(self):
        from aiohttp import web
        app = web.Application(client_max_size=1 << 30)
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
