"""Soak the rollout server the way a real RL run uses it, and check that nothing drifts or leaks.

Many concurrent clients post ``/generate`` requests drawn from a small pool of request specs
(prompt, seed, length); some time out and go away (half of those retry at once with the same
``rid``, as AReaL's client does); a controller meanwhile pauses and continues generation, updates
the weights from disk (alternating two checkpoints, with and without a pause), aborts everything
and aborts single requests. The KV cache is kept small enough that sequences are preempted.

Checked at the end (:func:`check`):
- every completed request has the exact bits (token ids and log-probs) of the same request run
  alone on the same weights (references taken before the soak, one request at a time), and every
  aborted request's partial output is a prefix of them;
- no retry of a gone client's ``rid`` is refused (409);
- nothing leaks: no request active, held or awaiting a reply, every KV page free again, the engine
  holding no request; the process's resident memory grew by at most ``rss_bound_mb`` between the
  end of the warm-up (the first third of the soak) and the end;
- the soak did what it claims: completions, disconnects, pauses, weight updates and preemptions all > 0.

CPU (the test suite, tests/engine/test_server_soak.py, tiny preset, seconds) or GPU:

    timeout 590 python bench/soak_server.py --device cuda --model qwen2.5-1.5b --duration 420 --clients 256 \\
        --max-running 64 --max-total-tokens 8192 --out $OUT/soak.json

prints one JSON summary (requests served, disconnects, preemptions, leaks, p50/p99 latency, RSS and
GPU memory) and exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(addr: str, path: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=120) as r:
        return json.loads(r.read())


def post(addr: str, path: str, payload: dict) -> dict:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def rss_mb() -> float:
    """This process's resident set size in MiB (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_specs(n: int, vocab: int, max_prompt: int, max_new: int, seed: int) -> list[dict]:
    """``n`` distinct request specs: random prompts of 3..max_prompt tokens, 2..max_new new tokens."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(vocab) for _ in range(rng.randint(3, max_prompt))],
             "max_new_tokens": rng.randint(2, max_new), "seed": rng.randrange(1 << 31)} for _ in range(n)]


def body(spec: dict, rid: str | None = None) -> dict:
    b = {"input_ids": spec["input_ids"], "return_logprob": True,
         "sampling_params": {"max_new_tokens": spec["max_new_tokens"], "temperature": 1.0,
                             "sampling_seed": spec["seed"], "ignore_eos": True}}
    if rid is not None:
        b["rid"] = rid
    return b


def bits(reply: dict) -> tuple:
    lps = reply["meta_info"]["output_token_logprobs"]
    return tuple(reply["output_ids"]), tuple(x[0] for x in lps)


class Soak:
    """The clients, the controller and what they saw (all on one asyncio loop)."""

    def __init__(self, addr: str, specs: list[dict], checkpoints: list[str], weight_set_of: dict, *,
                 duration_s: float, clients: int, seed: int, disconnect_p: float = 0.25):
        self.addr, self.specs, self.checkpoints = addr, specs, checkpoints
        self.weight_set_of = weight_set_of       # weight version -> index into checkpoints
        self.duration_s, self.n_clients, self.disconnect_p = duration_s, clients, disconnect_p
        self.rng = random.Random(seed)
        self.completed: list[tuple] = []         # (spec index, weight version, bits, latency s)
        self.aborted: list[tuple] = []           # (spec index, weight version, bits)
        self.counts = {"requests": 0, "disconnects": 0, "retries": 0, "retry_409": 0, "errors": 0, "pauses": 0,
                       "weight_updates": 0, "abort_all": 0, "abort_rid": 0}
        self.errors: list[str] = []
        self.in_flight: dict[str, int] = {}     # rid -> spec index
        self.rss_warm: float | None = None

    async def _post(self, session, path: str, payload: dict, timeout_s: float | None = None):
        import aiohttp
        kw = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
        async with session.post(f"http://{self.addr}{path}", json=payload, **kw) as r:
            return r.status, await r.json(content_type=None)

    async def _one(self, session, k: int, n: int, spec_i: int, timeout_s: float | None, rid: str):
        self.counts["requests"] += 1
        self.in_flight[rid] = spec_i
        t0 = time.perf_counter()
        try:
            status, reply = await self._post(session, "/generate", body(self.specs[spec_i], rid), timeout_s)
        except asyncio.TimeoutError:
            self.counts["disconnects"] += 1
            return "gone"
        finally:
            self.in_flight.pop(rid, None)
        if status != 200:
            self.counts["errors"] += 1
            if status == 409:
                self.counts["retry_409"] += 1
            self.errors.append(f"{rid}: {status} {str(reply)[:200]}")
            return "error"
        fr = reply["meta_info"]["finish_reason"]["type"]
        version = reply["meta_info"]["weight_version"]
        if fr == "abort":
            self.aborted.append((spec_i, version, bits(reply)))
        else:
            self.completed.append((spec_i, version, bits(reply), time.perf_counter() - t0))
        return fr

    async def client(self, session, k: int, deadline: float):
        n = 0
        while time.perf_counter() < deadline:
            n += 1
            spec_i = self.rng.randrange(len(self.specs))
            rid = f"c{k}-{n}"
            leave = self.rng.random() < self.disconnect_p
            res = await self._one(session, k, n, spec_i, self.rng.uniform(0.05, 1.5) if leave else None, rid)
            if res == "gone" and self.rng.random() < 0.5:   # AReaL retries a timed-out request with its rid
                self.counts["retries"] += 1
                await self._one(session, k, n, spec_i, None, rid)

    async def controller(self, session, deadline: float):
        version = max(self.weight_set_of)
        first = [0.0, 0.5]   # a pause with an update, then an update without a pause, come first: every soak has both
        while time.perf_counter() < deadline:
            await asyncio.sleep(self.rng.uniform(0.3, 1.5))
            r = first.pop(0) if first else self.rng.random()
            if r < 0.4:
                await self._post(session, "/pause_generation", {})
                self.counts["pauses"] += 1
                await asyncio.sleep(self.rng.uniform(0.0, 0.3))
                if r == 0.0 or self.rng.random() < 0.6:
                    version = await self._update(session, version)
                await self._post(session, "/continue_generation", {})
            elif r < 0.55:
                version = await self._update(session, version)   # no pause: abort_all_requests ends them
            elif r < 0.75:
                await self._post(session, "/abort_request", {"abort_all": True})
                self.counts["abort_all"] += 1
            elif self.in_flight:
                rid = self.rng.choice(list(self.in_flight))
                await self._post(session, "/abort_request", {"rid": rid})
                self.counts["abort_rid"] += 1

    async def _update(self, session, version: int) -> int:
        target = 1 - self.weight_set_of[version]
        status, reply = await self._post(session, "/update_weights_from_disk",
                                         {"model_path": self.checkpoints[target], "abort_all_requests": True})
        if status != 200:
            self.errors.append(f"weight update: {status} {str(reply)[:200]}")
            return version
        self.weight_set_of[reply["version"]] = target
        self.counts["weight_updates"] += 1
        return reply["version"]

    async def run(self):
        import aiohttp
        t0 = time.perf_counter()
        deadline = t0 + self.duration_s
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            async def warm_mark():
                await asyncio.sleep(self.duration_s / 3)
                self.rss_warm = rss_mb()
            clients = [asyncio.create_task(self.client(session, k, deadline)) for k in range(self.n_clients)]
            others = [asyncio.create_task(self.controller(session, deadline)), asyncio.create_task(warm_mark())]
            await asyncio.gather(*others)
            while not all(c.done() for c in clients):   # time is up: end what still runs, without waiting for it
                await self._post(session, "/continue_generation", {})
                await self._post(session, "/abort_request", {"abort_all": True})
                await asyncio.wait(clients, timeout=0.2)
            await asyncio.gather(*clients)
        self.elapsed_s = time.perf_counter() - t0


def references(addr: str, specs: list[dict], checkpoints: list[str]) -> tuple[dict, dict]:
    """Each spec run alone (one request at a time) on each checkpoint: ({(spec, weight set): bits},
    {weight version: weight set}). The server starts on checkpoints[0] (its version then)."""
    refs, set_of = {}, {int(get(addr, "/get_server_info")["weight_version"]): 0}
    for w, path in enumerate(checkpoints):
        if w:
            reply = post(addr, "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True})
            set_of[int(reply["version"])] = w
        for i, spec in enumerate(specs):
            refs[(i, w)] = bits(post(addr, "/generate", body(spec)))
    return refs, set_of


def check(soak: Soak, refs: dict, info: dict, rss_end: float, rss_bound_mb: float) -> dict:
    """The soak's summary; ``problems`` lists every failed check (empty: all held)."""
    problems = []
    mismatch = [(i, v) for i, v, got, _ in soak.completed if got != refs[(i, soak.weight_set_of[v])]]
    if mismatch:
        problems.append(f"{len(mismatch)} completed requests differ from the same request alone, e.g. "
                        f"spec {mismatch[0][0]} at version {mismatch[0][1]}")
    not_prefix = []
    for i, v, (ids, lps) in soak.aborted:
        ref_ids, ref_lps = refs[(i, soak.weight_set_of[v])]
        if ids != ref_ids[:len(ids)] or lps != ref_lps[:len(lps)]:
            not_prefix.append((i, v))
    if not_prefix:
        problems.append(f"{len(not_prefix)} aborted requests' partial outputs are not a prefix of the request alone")
    leaks = {k: info[k] for k in ("active_requests", "held_requests", "pending_replies") if info[k]}
    if info["kv_pages_free"] != info["kv_pages_total"]:
        leaks["kv_pages_in_use"] = info["kv_pages_total"] - info["kv_pages_free"]
    if info.get("engine_unfinished"):
        leaks["engine_unfinished"] = True
    if leaks:
        problems.append(f"leaks: {leaks}")
    growth = rss_end - soak.rss_warm if soak.rss_warm is not None else float("nan")
    if not growth <= rss_bound_mb:
        problems.append(f"RSS grew {growth:.1f} MiB after the warm-up (bound {rss_bound_mb} MiB)")
    if soak.errors:
        problems.append(f"{len(soak.errors)} unexpected replies, e.g. {soak.errors[0]}")
    did = {"completed": len(soak.completed), "disconnects": soak.counts["disconnects"],
           "pauses": soak.counts["pauses"], "weight_updates": soak.counts["weight_updates"],
           "preemptions": info["preemptions"], "server_seen_disconnects": info["client_disconnects"]}
    problems += [f"the soak saw no {k}" for k, v in did.items() if not v]
    lat = sorted(x[3] for x in soak.completed)

    def pct(p):
        return round(lat[min(len(lat) - 1, int(p * len(lat)))], 4) if lat else None
    return {"duration_s": round(soak.elapsed_s, 1), "clients": soak.n_clients, "requests": soak.counts["requests"],
            "served": len(soak.completed), "aborted": len(soak.aborted), **soak.counts,
            "preemptions": info["preemptions"], "server_seen_disconnects": info["client_disconnects"],
            "bit_mismatches": len(mismatch), "abort_prefix_mismatches": len(not_prefix), "leaks": leaks,
            "latency_p50_s": pct(0.50), "latency_p99_s": pct(0.99),
            "rss_warm_mb": None if soak.rss_warm is None else round(soak.rss_warm, 1), "rss_end_mb": round(rss_end, 1),
            "rss_growth_mb": round(growth, 1), "problems": problems}


def wait_idle(addr: str, timeout_s: float = 120.0) -> dict:
    t0 = time.time()
    while True:
        info = get(addr, "/get_server_info")
        if not (info["active_requests"] or info["held_requests"] or info["pending_replies"]):
            return info
        if time.time() - t0 > timeout_s:
            return info
        time.sleep(0.05)


def soak_server(server, addr: str, checkpoints: list[str], *, n_specs: int, max_prompt: int, max_new: int,
                duration_s: float, clients: int, seed: int, rss_bound_mb: float) -> dict:
    """References, then the soak against the running ``server`` (in this process), then the checks."""
    vocab = int(server.worker.engine.runner.vocab_size)
    specs = make_specs(n_specs, vocab, max_prompt, max_new, seed)
    refs, set_of = references(addr, specs, checkpoints)
    soak = Soak(addr, specs, checkpoints, set_of, duration_s=duration_s, clients=clients, seed=seed + 1)
    asyncio.run(soak.run())
    info = wait_idle(addr)
    # the engine is idle now (nothing active or held): it holds no request, and every page is free
    info["engine_unfinished"] = bool(server.worker.engine.has_unfinished())
    return check(soak, refs, info, rss_mb(), rss_bound_mb)


def main(argv=None) -> int:
    import torch

    from areal_tik.engine.server import ServerConfig, build, serving
    from areal_tik.layers.models import build_model
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--device", default=None)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of soak")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV cache size (small: preemption)")
    p.add_argument("--specs", type=int, default=32, help="distinct requests (each run alone twice first: the references)")
    p.add_argument("--max-prompt", type=int, default=200)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--rss-bound-mb", type=float, default=256.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ServerConfig(model=a.model, port=free_port(), max_running_requests=a.max_running,
                       context_length=a.context_length, page_size=a.page_size, max_total_tokens=a.max_total_tokens)
    server = build(cfg, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = [os.path.join(tmp, "a"), os.path.join(tmp, "b")]
        server.worker.engine.model.save_pretrained(ckpts[0])
        other = build_model(a.model, dtype=torch.bfloat16, device=device, seed=a.seed + 1)
        other.save_pretrained(ckpts[1])
        del other
        gpu0 = torch.cuda.memory_allocated(device) if device.startswith("cuda") else None
        with serving(server) as addr:
            summary = soak_server(server, addr, ckpts, n_specs=a.specs, max_prompt=a.max_prompt, max_new=a.max_new,
                                  duration_s=a.duration, clients=a.clients, seed=a.seed, rss_bound_mb=a.rss_bound_mb)
        if gpu0 is not None:
            summary["gpu_allocated_growth_mb"] = round((torch.cuda.memory_allocated(device) - gpu0) / 2 ** 20, 1)
    summary.update(model=a.model, device=device, max_total_tokens=a.max_total_tokens, page_size=a.page_size)
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
