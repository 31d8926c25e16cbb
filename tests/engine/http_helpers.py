"""Helpers of the rollout-server tests that talk HTTP to a server on 127.0.0.1 (no tests here):
one request and its decoded reply, the checks of an error reply, the server's info and waits
on it (``serving``, the server on a thread for a block, is the server package's)."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

from areal_tik.engine.server import serving  # noqa: F401  (re-exported for the tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(addr: str, path: str, body=None, raw: bytes | None = None, method: str = "POST", timeout: float = 120):
    """(status, mime type, decoded JSON or {"raw": text}) of one request."""
    host, port = addr.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data is not None else {})
    r = c.getresponse()
    payload = r.read()
    c.close()
    try:
        obj = json.loads(payload) if payload else None
    except ValueError:
        obj = {"raw": payload.decode(errors="replace")}
    return r.status, (r.getheader("Content-Type") or "").split(";")[0].strip(), obj


def refused(res, status: int = 400, match: str | None = None) -> str:
    """Assert ``res`` is a JSON error reply with a one-line message; return the message."""
    code, ctype, obj = res
    assert code == status, (code, obj)
    assert ctype == "application/json", (ctype, obj)
    msg = obj.get("message") or (obj.get("error") or {}).get("message")
    assert isinstance(msg, str) and msg and "\n" not in msg, obj
    if match is not None:
        assert match.lower() in msg.lower(), msg
    return msg


def bits(res) -> tuple:
    """(token ids, log-probs, token ids of the log-prob entries) of a 200 /generate reply."""
    code, ctype, obj = res
    assert code == 200 and ctype == "application/json", (code, obj)
    lps = obj["meta_info"]["output_token_logprobs"]
    return obj["output_ids"], [x[0] for x in lps], [x[1] for x in lps]


def info(addr: str) -> dict:
    code, _, obj = call(addr, "/get_server_info", method="GET")
    assert code == 200
    return obj


def wait_until(addr: str, cond, what: str, timeout: float = 60.0, poll: float = 0.02) -> dict:
    """The server's info once ``cond(info)`` holds; fails naming ``what`` after ``timeout`` s."""
    t0 = time.time()
    while True:
        i = info(addr)
        if cond(i):
            return i
        assert time.time() - t0 < timeout, f"{what} (after {timeout} s): {i}"
        time.sleep(poll)


def wait_idle(addr: str, timeout: float = 60.0) -> dict:
    return wait_until(addr, lambda i: i["active_requests"] == 0 and i.get("held_requests", 0) == 0,
                      "requests still in flight", timeout, poll=0.05)


def wait_active(addr: str, n: int = 1, timeout: float = 30.0) -> None:
    wait_until(addr, lambda i: i["active_requests"] >= n, "the request never started", timeout, poll=0.01)


def in_thread(fn, *args):
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", fn(*args)), daemon=True)
    th.start()
    return th, box
