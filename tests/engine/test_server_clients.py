"""The rollout server under real client behaviour: clients that go away (time out, die) while
their request runs or is held during a pause, retries with the same request id, and
``abort_all`` while requests are held.

A request whose client is gone must end in the engine (its KV pages free again, its request id
free for the retry) instead of generating to its full length for nobody. One real ``tiny-qwen2``
server (tik kernels, CPU) serves the module; long requests (up to 250 new tokens) take many
seconds on a CPU, so a request that ends early was ended by the server.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import types

import pytest

from areal_tik.engine.server import ServerConfig, build

sys.path.insert(0, os.path.dirname(__file__))
from http_helpers import (bits, call, free_port, in_thread, info, serving, wait_active, wait_idle,  # noqa: E402
                          wait_until)

CTX = 256
LONG_TOKENS = 250
SHORT = {"input_ids": [3, 5, 7], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 21, "ignore_eos": True}}


def long_body(rid: str | None = None, seed: int = 5) -> dict:
    body = {"input_ids": [2, 4, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 1.0, "sampling_seed": seed,
                                "ignore_eos": True}}
    return body if rid is None else {**body, "rid": rid}


@pytest.fixture(scope="module")
def S():
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=free_port(), max_running_requests=4,
                       context_length=CTX, precompile=False)
    server = build(cfg, device="cpu")
    pages = server.worker.engine.stats()["num_pages"]  # read before the engine thread starts
    with serving(server) as addr:
        yield types.SimpleNamespace(server=server, addr=addr, pages=pages,
                                    short_ref=bits(call(addr, "/generate", SHORT)))


def post_then_leave(addr: str, body: dict) -> socket.socket:
    """Send one /generate on a raw connection and return the open socket (close it to go away)."""
    host, port = addr.split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall((f"POST /generate HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
    return s


def aiohttp_with_timeout(addr: str, body: dict, timeout_s: float) -> str:
    """AReaL's client library with a total timeout shorter than the generation: what it raises."""
    import aiohttp

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            try:
                async with s.post(f"http://{addr}/generate", json=body) as r:
                    await r.read()
                    return f"answered {r.status}"
            except asyncio.TimeoutError:
                return "timed out"
    return asyncio.run(go())


def assert_clean(S) -> dict:
    """Nothing in flight or held, and every KV page free again."""
    i = wait_idle(S.addr, timeout=30)
    assert i["kv_pages_free"] == S.pages, f"KV pages leaked: {i['kv_pages_free']} of {S.pages} free"
    return i


def test_a_client_that_times_out_ends_its_request_and_frees_its_pages_and_rid(S):
    """AReaL's client times out (aiohttp, total timeout) on a long generation and retries with the
    same rid: the first request is ended in the engine within a second or so (not after its 250
    tokens), its pages are free, and the retry is served (200, the exact bits of the request alone)."""
    before = wait_idle(S.addr, timeout=30)
    th, box = in_thread(aiohttp_with_timeout, S.addr, long_body("retry-me"), 1.5)
    th.join(120)
    assert box["r"] == "timed out", box
    i = wait_until(S.addr, lambda i: i["active_requests"] == 0, "the request of the gone client still runs",
                   timeout=10)
    generated = i["generated_tokens"] - before["generated_tokens"]
    assert generated < LONG_TOKENS, f"the request ran to its full length ({generated} tokens) for nobody"
    assert i["client_disconnects"] == before["client_disconnects"] + 1
    assert bits(call(S.addr, "/generate", {**SHORT, "rid": "retry-me"})) == S.short_ref
    assert_clean(S)


def test_a_raw_disconnect_mid_generation_frees_the_engine(S):
    before = wait_idle(S.addr, timeout=30)
    sock = post_then_leave(S.addr, long_body("raw-gone"))
    wait_active(S.addr)
    sock.close()
    i = wait_until(S.addr, lambda i: i["active_requests"] == 0, "the request of the gone client still runs",
                   timeout=10)
    assert i["generated_tokens"] - before["generated_tokens"] < LONG_TOKENS
    assert i["kv_pages_free"] == S.pages
    assert_clean(S)


def test_a_held_request_whose_client_left_never_runs(S):
    """A request that arrives during a pause is held; its client leaves; it is dropped from the
    held list, and after continue nothing runs for it."""
    before = wait_idle(S.addr, timeout=30)
    assert call(S.addr, "/pause_generation", {})[0] == 200
    try:
        sock = post_then_leave(S.addr, long_body("held-gone"))
        wait_until(S.addr, lambda i: i["held_requests"] == 1, "the request was never held", timeout=10)
        sock.close()
        wait_until(S.addr, lambda i: i["held_requests"] == 0, "the held request of a gone client is still held",
                   timeout=10)
    finally:
        assert call(S.addr, "/continue_generation", {})[0] == 200
    i = assert_clean(S)
    assert i["generated_tokens"] == before["generated_tokens"] and i["engine_steps"] == before["engine_steps"]
    assert bits(call(S.addr, "/generate", {**SHORT, "rid": "held-gone"})) == S.short_ref  # the rid is free


def test_abort_all_ends_the_held_requests_too(S):
    """``/abort_request {abort_all}`` during a pause ends the held requests (AReaL reads an abort
    before prefill as nothing generated); after continue none of them runs."""
    before = wait_idle(S.addr, timeout=30)
    assert call(S.addr, "/pause_generation", {})[0] == 200
    try:
        waiting = [in_thread(call, S.addr, "/generate", long_body(f"held-{k}", seed=k)) for k in range(2)]
        wait_until(S.addr, lambda i: i["held_requests"] == 2, "the requests were never held", timeout=10)
        code, _, obj = call(S.addr, "/abort_request", {"abort_all": True})
        assert code == 200 and obj["aborted"] == 2, obj
        for th, box in waiting:
            th.join(30)
            assert not th.is_alive(), "a held request never got its answer"
            code, _, obj = box["r"]
            assert code == 200 and obj["output_ids"] == [], obj
            fr = obj["meta_info"]["finish_reason"]
            assert fr["type"] == "abort" and fr["message"].startswith("Abort before prefill"), fr
    finally:
        assert call(S.addr, "/continue_generation", {})[0] == 200
    i = assert_clean(S)
    assert i["generated_tokens"] == before["generated_tokens"], "an aborted held request ran after continue"


class _Holder:
    """A request holding an id (hashable, as the server's Pending is)."""
    def __init__(self, rid: str):
        self.rid, self.client_gone = rid, False


class _Transport:
    def __init__(self):
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


def _server_with_holder(rid: str):
    """A TikServer (no engine: a worker that records what it is given) whose request id ``rid`` is
    held by a request whose connection is still open."""
    from areal_tik.engine.server.routes import TikServer
    worker = types.SimpleNamespace(submitted=[], submit=lambda fn: worker.submitted.append(fn))
    server = TikServer(worker, cfg=None, info={})
    holder = _Holder(rid)
    request = types.SimpleNamespace(transport=_Transport())
    server._inflight[rid] = holder
    server.clients.add(holder, request)
    return server, holder, request


def test_a_retry_that_outruns_its_first_connections_close_waits_for_it():
    """A busy event loop can read a retry before the close of the retried request's connection:
    the retry waits (up to RETRY_GRACE_S) for that close instead of a 409, and the first request
    is ended in the engine."""
    async def go():
        server, holder, request = _server_with_holder("c1-1")
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, lambda: setattr(request.transport, "closing", True))
        t0 = loop.time()
        free = await server._rid_free("c1-1")
        return free, loop.time() - t0, holder.client_gone, len(server.worker.submitted)
    free, waited, gone, ended = asyncio.run(go())
    assert free and gone and ended == 1 and 0.15 <= waited < 1.0, (free, waited, gone, ended)


def test_a_second_request_with_an_id_whose_client_stays_is_refused_after_the_grace():
    """The negative control: nothing closes, so the id stays taken (a 409 after RETRY_GRACE_S);
    and an id whose holder finishes during the wait is free."""
    async def go():
        server, holder, _ = _server_with_holder("dup")
        server.RETRY_GRACE_S = 0.3
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        taken = not await server._rid_free("dup")
        waited = loop.time() - t0
        loop.call_later(0.1, lambda: server._inflight.pop("dup"))
        freed = await server._rid_free("dup")
        return taken, waited, holder.client_gone, freed
    taken, waited, gone, freed = asyncio.run(go())
    assert taken and not gone and 0.3 <= waited < 1.0 and freed, (taken, waited, gone, freed)
