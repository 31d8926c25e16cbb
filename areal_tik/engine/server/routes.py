"""The HTTP routes (aiohttp): SGLang's native API as AReaL's client calls it, each body checked at
the edge (``request_validation``) before the worker sees it, and the server's event loop."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time

from areal_tik.engine.server.client_watch import ClientWatch
from areal_tik.engine.server.config import IPC_ROUTE, LOOPBACK_HOSTS, MAX_BODY_BYTES, ServerConfig
from areal_tik.engine.server.http_errors import error_middleware, error_reply, json_reply
from areal_tik.engine.server.request_validation import (Limits, RequestError, parse_abort, parse_disk_update,
                                                        parse_distributed_update, parse_generate, parse_group_init,
                                                        parse_group_name, parse_ipc_update)
from areal_tik.engine.server.worker import EngineWorker, Pending

logger = logging.getLogger("areal_tik.server")


class TikServer:
    """aiohttp application around an :class:`EngineWorker`.

    Every request body is checked at the edge (``request_validation``): a bad one is
    answered 400 (409 for a request id already in flight) with a one-line reason and never
    reaches the engine; every reply, errors included, is JSON (``http_errors``).

    A ``/generate`` whose client goes away (its connection closes) is ended in the engine
    within ``ClientWatch``'s sweep interval, running or held during a pause: its KV pages and
    its request id are free again, and a retry with the same ``rid`` is served (a retry that
    arrives before its first connection's close was read waits up to ``RETRY_GRACE_S`` for it;
    a second request with an id whose holder is still running, its client still there, is a 409
    after that wait)."""

    RETRY_GRACE_S = 1.0

    def __init__(self, worker: EngineWorker, cfg: ServerConfig, info: dict):
        self.worker = worker
        self.cfg = cfg
        self.info = info  # static: fingerprint, kernels, model path, ...
        self._rid = itertools.count()
        self._inflight: dict[str, Pending] = {}  # /generate ids between arrival and reply (event-loop thread only)
        self.clients = ClientWatch(self._client_gone)
        self.started = time.time()

    # ---- helpers -----------------------------------------------------------------
    _json = staticmethod(json_reply)

    async def _body(self, request):
        """The JSON body (``None`` when there is none); :class:`RequestError` if it is not JSON."""
        from aiohttp import web  # lazy: keeps aiohttp out of this module's import
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

    async def _rid_free(self, rid: str) -> bool:
        """Whether a new request may take ``rid``: nobody holds it, its holder's client went away,
        or the id frees within ``RETRY_GRACE_S``. A client retrying its rid right after a timeout
        can reach us before this loop has read its first connection's close (a busy loop reads
        sockets in any order), so a holder whose client still looks connected is watched for that
        long (its close seen: the holder is ended; the holder done: the id is free) before a 409."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.RETRY_GRACE_S
        while True:
            holder = self._inflight.get(rid)
            if holder is None or holder.client_gone:
                return True
            self.clients.sweep()
            if holder.client_gone:
                return True
            if self._inflight.get(rid) is not holder:  # it ended meanwhile: look again
                continue
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)

    def _client_gone(self, p: Pending) -> None:
        """``p``'s client went away: end it in the engine thread (its reply goes nowhere)."""
        p.client_gone = True
        self.worker.submit(lambda: self.worker.cmd_cancel(p))

    def server_info(self) -> dict:
        w = self.worker
        stats = getattr(w.engine, "stats", None)
        st = stats() if stats is not None else {}
        return {
            **self.info,
            "weight_version": int(w.engine.version),
            "paused": w.paused,
            "active_requests": len(w._active),
            "held_requests": len(w._held),
            "engine_steps": w.n_steps,
            "generated_tokens": w.n_generated,
            "failed_requests": w.n_failed,
            "pending_replies": len(self._inflight),
            "client_disconnects": self.clients.gone,
            "kv_pages_total": st.get("num_pages"),
            "kv_pages_free": st.get("free_pages"),
            "preemptions": st.get("preemptions"),
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
        if not await self._rid_free(rid):
            return error_reply(f"request id {rid!r} is already in flight; give each request its own rid", 409)
        ids = req.input_ids
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        p = Pending(rid, ids, params, fut, loop, req.want_input_logprobs, max(0, req.logprob_start_len or 0),
                     params.temperature)   # greedy (0) scores at T = 1: the log-prob head's effective_temperature
        self._inflight[rid] = p  # a gone holder's end is queued before this request: the engine sees them in order
        self.clients.add(p, request)
        try:
            await self.worker.submit(lambda: self.worker.cmd_add(p))
            res = await fut
        except RequestError as e:
            return error_reply(e.message, e.status)
        finally:
            self.clients.discard(p)
            if not fut.done():  # the handler itself was cancelled (server shutting down): end the request too
                self.worker.submit(lambda: self.worker.cmd_cancel(p))
            if self._inflight.get(rid) is p:
                del self._inflight[rid]
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
        """Generation resumes; a distributed weight update staged during the pause is applied
        first (reported under ``weight_update``; a refused one is dropped: ``applied`` false)."""
        res, err = await self._weights_call("continue_generation", self.worker.cmd_continue)
        if err is not None:
            return err
        return self._json({"success": True, **({"weight_update": res} if res is not None else {})})

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

    async def update_weights_from_ipc(self, request):
        """The trainer's shared buffer on this machine (``engine/weight_ipc``): loopback peers only."""
        if request.remote not in LOOPBACK_HOSTS:
            return error_reply(f"{IPC_ROUTE} serves loopback peers only (got {request.remote})", 403)
        try:
            req = parse_ipc_update(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        res, err = await self._weights_call("update_weights_from_ipc", lambda: self.worker.cmd_update_from_ipc(req))
        if err is not None:
            return err
        logger.info("loaded %d shared tensors as version %s in %.2fs (+ digest %.2fs); since the previous update: %s",
                    len(req["layout"]), res["version"], res["load_s"], res.get("info_s", 0.0),
                    res.get("previous_interval"))
        return self._json({"success": True, "message": "Succeeded to update model weights.", **res})

    async def init_weights_update_group(self, request):
        from areal_tik.engine.server.weight_group import join_group  # lazy: keeps torch out of this module's import
        try:
            args = parse_group_init(await self._body(request))
        except RequestError as e:
            return error_reply(e.message, e.status)
        old = self.worker.groups.pop(args["group_name"], None)
        if old is not None:  # a restarted trainer re-creates its group: it is already waiting in the rendezvous
            # lazy: keeps torch out of this module's import
            from areal_tik.engine.server.weight_group import leave_group
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
        from areal_tik.engine.server.weight_group import leave_group  # lazy: keeps torch out of this module's import
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
            n = await self.worker.submit(self.worker.cmd_abort_all)
            return self._json({"success": True, "aborted": n})
        ok = await self.worker.submit(lambda: self.worker.cmd_abort_rid(rid))
        return self._json({"success": bool(ok)})

    async def unsupported(self, request):
        return error_reply(f"{request.path} is not supported by the areal-tik server (no LoRA, no memory offload)",
                           400)

    async def _watch_clients(self, app):
        """aiohttp cleanup context: the client watch's sweep runs while the app serves."""
        task = asyncio.create_task(self.clients.run())
        yield
        task.cancel()

    def app(self):
        from aiohttp import web  # lazy: keeps aiohttp out of this module's import
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware()])
        app.cleanup_ctx.append(self._watch_clients)
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
        r.add_post(IPC_ROUTE, self.update_weights_from_ipc)
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


@contextlib.contextmanager
def serving(server: TikServer, ready_timeout: float = 120, join_timeout: float = 30):
    """:func:`run_server` on a daemon thread for the length of the block: yields ``"host:port"``
    once the server listens, stops it (engine thread included) after."""
    ready, stop = threading.Event(), threading.Event()
    th = threading.Thread(target=run_server, args=(server, ready, stop), daemon=True, name="tik-server")
    th.start()
    try:
        if not ready.wait(ready_timeout):
            raise TimeoutError(f"the server did not listen within {ready_timeout} s")
        yield f"{server.cfg.host}:{server.cfg.port}"
    finally:
        stop.set()
        th.join(join_timeout)


def run_server(server: TikServer, ready: threading.Event | None = None, stop: threading.Event | None = None):
    """Serve until ``stop`` is set (or forever); blocking. Starts the engine thread."""
    from aiohttp import web  # lazy: keeps aiohttp out of this module's import

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
        from areal_tik.engine.server.weight_group import leave_group  # lazy: keeps torch out of this module's import
        for pg in server.worker.groups.values():
            leave_group(pg)
