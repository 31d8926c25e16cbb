"""The rollout server against a hostile client, on 127.0.0.1: malformed bodies, hostile
values, duplicate ids, engine faults, client disconnects, abort storms, failed and partial
weight updates (disk and xccl). After each, the server must be healthy and correct: no
request left in flight, the old weight version and digest, and a valid request returning
the same bits (token ids and log-probs compared exactly) as on the fresh server.

One real ``tiny-qwen2`` server (tik kernels, CPU) serves the whole module; requests are
few and short (context length 64).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import socket
import sys
import time
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from areal_tik.engine.sequence import SamplingParams
from areal_tik.engine.server import EngineWorker, ServerConfig, TikServer, build
from areal_tik.engine.server.worker import Pending

sys.path.insert(0, os.path.dirname(__file__))
import hostile  # noqa: E402  (tests/engine/hostile.py: hypothesis strategies)
from http_helpers import (bits, call, free_port as _free_port, in_thread, info, refused, serving,  # noqa: E402
                          wait_active, wait_idle)

CTX = 64
VOCAB = 512
REF = {"input_ids": [3, 5, 7, 9], "return_logprob": True,
       "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}}
LONG = {"input_ids": [4, 6, 8], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": 12, "ignore_eos": True}}


def assert_healthy(S) -> None:
    """Nothing in flight, not paused, the expected version and the fresh digest, and the
    reference request's exact bits."""
    i = wait_idle(S.addr)
    assert not i["paused"]
    assert i["weight_version"] == S.version and i["weights_digest"] == S.digest
    code, ctype, obj = call(S.addr, "/health", method="GET")
    assert code == 200 and obj["status"] == "ok"
    assert bits(call(S.addr, "/generate", REF)) == S.ref


@pytest.fixture(scope="module")
def S(tmp_path_factory):
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=_free_port(), max_running_requests=8,
                       context_length=CTX)
    server = build(cfg, device="cpu")
    with serving(server) as addr:
        ckpt = tmp_path_factory.mktemp("orig")
        server.worker.engine.model.save_pretrained(ckpt)  # nothing in flight yet
        i0 = info(addr)
        ns = types.SimpleNamespace(server=server, addr=addr, ckpt=str(ckpt), version=i0["weight_version"],
                                   digest=i0["weights_digest"], ref=bits(call(addr, "/generate", REF)),
                                   long_ref=bits(call(addr, "/generate", LONG)))
        assert len(ns.ref[0]) == 6 and len(ns.long_ref[0]) == 40
        yield ns


# ---- hostile values ----------------------------------------------------------------------
HOSTILE_SAMPLING = [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": float("-inf")},
    {"temperature": -1.0}, {"temperature": 1e-30}, {"temperature": "hot"}, {"temperature": True},
    {"top_p": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 1.5}, {"top_k": "x"},
    {"max_new_tokens": -1}, {"max_new_tokens": 2.5}, {"max_new_tokens": "9"},
    {"stop_token_ids": "x"}, {"stop_token_ids": [1.5]}, {"frequency_penalty": float("nan")},
    {"ignore_eos": "yes"},
]


def test_nan_and_hostile_sampling_values_get_400_while_others_run(S):
    """A NaN or infinite temperature (or any other bad sampling value) is a 400; a request in
    flight meanwhile finishes with its exact bits, and later requests are unaffected."""
    th, box = in_thread(call, S.addr, "/generate", LONG)
    wait_active(S.addr)
    for sp in HOSTILE_SAMPLING:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, **sp}}
        refused(call(S.addr, "/generate", body), 400, match=next(iter(sp)))
    th.join(120)
    assert bits(box["r"]) == S.long_ref
    assert_healthy(S)


def _inject(worker, ids, sp: SamplingParams, corrupt):
    """Hand ``ids`` straight to the worker (past the edge checks), corrupt ``sp`` in the engine
    thread once the engine holds it, and wait for the request's outcome."""
    async def go():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        p = Pending("injected", ids, sp, fut, loop, False, 0, 1.0)
        await worker.submit(lambda: worker.cmd_add(p))
        await worker.submit(lambda: corrupt(sp))
        try:
            return await asyncio.wait_for(fut, 120)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e
    return asyncio.run(go())


def test_engine_fault_fails_only_its_request(S):
    """Defence in depth: a request whose parameters turn invalid inside the engine (as if it had
    slipped past the edge) fails alone with a 500-class error; the requests stepping with it
    finish with their exact bits, and the engine keeps serving."""
    th, box = in_thread(call, S.addr, "/generate", LONG)
    wait_active(S.addr)
    sp = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3, ignore_eos=True)
    out = _inject(S.server.worker, [1, 2, 3], sp, lambda p: setattr(p, "temperature", float("nan")))
    assert isinstance(out, Exception), out
    assert getattr(out, "status", None) == 500 and "temperature" in str(out), repr(out)
    th.join(120)
    assert bits(box["r"]) == S.long_ref
    assert_healthy(S)


class _FaultyEngine:
    """A stand-in engine: ``step`` raises while a request with prompt [13] is queued (and keeps
    raising until it is removed); ``add_request`` refuses prompt [66]."""

    def __init__(self):
        self.version, self.reqs = 0, {}

    def add_request(self, rid, ids, params):
        if ids == [66]:
            raise ValueError("refused by the engine")
        self.reqs[rid] = (list(ids), params, [])

    def step(self):
        time.sleep(0.005)
        if any(ids == [13] for ids, _, _ in self.reqs.values()):
            raise RuntimeError("device fault")
        outs = []
        for rid, (ids, params, out) in list(self.reqs.items()):
            out.append(len(out) + 1)
            done = len(out) >= params.max_new_tokens
            if done:
                del self.reqs[rid]
            outs.append(types.SimpleNamespace(request_id=rid, output_ids=list(out), output_logprobs=[-1.0] * len(out),
                                              finish_reason="length" if done else None, version=0))
        return outs

    def abort(self, rid):
        self.reqs.pop(rid, None)
        return []

    def has_unfinished(self):
        return bool(self.reqs)

    def update_weights(self, src, version):
        self.version = version


def test_engine_that_raises_or_refuses_leaves_no_stuck_or_phantom_request():
    """With an engine that does not contain its own faults: a step that raises fails the
    requests in flight and clears them from the engine (the next request is served); a
    request the engine refuses is a 400 and leaves nothing in flight."""
    eng = _FaultyEngine()
    cfg = ServerConfig(model="faulty", port=_free_port())
    server = TikServer(EngineWorker(eng, SamplingParams, model_info=lambda: {"weights_digest": "d"}), cfg, {})
    with serving(server, ready_timeout=30, join_timeout=15) as addr:
        gen = {"input_ids": [5], "sampling_params": {"max_new_tokens": 3}}
        code, _, _ = call(addr, "/generate", {"input_ids": [13], "sampling_params": {"max_new_tokens": 3}})
        assert code == 500
        assert call(addr, "/generate", gen)[2]["output_ids"] == [1, 2, 3]
        refused(call(addr, "/generate", {"input_ids": [66], "sampling_params": {"max_new_tokens": 3}}), 400,
                match="refused by the engine")
        assert wait_idle(addr, timeout=10)["active_requests"] == 0
        assert call(addr, "/update_weights_from_disk", {"model_path": "/x"})[2]["success"]  # nothing in flight
        assert call(addr, "/generate", gen)[2]["output_ids"] == [1, 2, 3]


BAD_PROMPTS = [
    ([-1, 5], "outside the vocabulary"), ([5, VOCAB], "outside the vocabulary"), ([10 ** 30], "outside"),
    ([1.0, 2], "integer"), ([1.7, 2], "integer"), ([True, 2], "integer"), (["5"], "integer"),
    ([[1, 2]], "batched"), ([], "non-empty"), ("1 2 3", "list"), ({"0": 1}, "list"),
    ([1] * CTX, "context length"), ([1] * (CTX + 7), "context length"),
]
BAD_SEEDS = [("x", "integer"), (1.5, "integer"), (True, "integer"), (-1, "in ["), (2 ** 64, "in ["),
             ([1], "integer")]


def test_bad_token_ids_context_and_seed_get_400_and_leave_nothing_in_flight(S):
    """Out-of-vocabulary, negative, float, bool or nested token ids, a prompt at or past the
    context length, a non-integer seed: each a 400 with a clear reason, none left in flight,
    so a weight update without abort goes through right after."""
    for ids, why in BAD_PROMPTS:
        refused(call(S.addr, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}), 400,
                match=why)
    for seed, why in BAD_SEEDS:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed}}
        refused(call(S.addr, "/generate", body), 400, match=why)
    assert wait_idle(S.addr, timeout=5)["active_requests"] == 0
    code, _, obj = call(S.addr, "/update_weights_from_disk", {"model_path": S.ckpt, "abort_all_requests": False})
    assert code == 200 and obj["success"], obj
    S.version += 1  # the same weights as a new version: the digest stays
    assert obj["weights_digest"] == S.digest
    assert_healthy(S)


def test_duplicate_rid_in_flight_is_409_and_the_first_request_gets_its_answer(S, monkeypatch):
    """A second request whose id is held by a running request (its client connected) waits up to the server's
    retry grace for the id to free (tests/engine/test_server_clients.py), then gets 409: the grace is cut to
    50 ms here so that the first request (40 tokens) outlasts it."""
    monkeypatch.setattr(S.server, "RETRY_GRACE_S", 0.05)
    body = {**LONG, "rid": "dup"}
    th, box = in_thread(call, S.addr, "/generate", body)
    wait_active(S.addr)
    refused(call(S.addr, "/generate", {**REF, "rid": "dup"}), 409, match="already in flight")
    th.join(120)
    assert not th.is_alive(), "the first request never got its answer"
    assert bits(box["r"]) == S.long_ref and box["r"][2]["meta_info"]["id"] == "dup"
    assert bits(call(S.addr, "/generate", {**REF, "rid": "dup"})) == S.ref  # the id is free again
    assert_healthy(S)


MALFORMED = [
    ("/generate", b"{not json", "json"), ("/generate", b"[1, 2]", "object"), ("/generate", b'"text"', "object"),
    ("/generate", b"7", "object"), ("/generate", b"\xff\xfe", "json"), ("/generate", b"[" * 100000, "json"),
    ("/generate", {"input_ids": [1], "sampling_params": [1]}, "sampling_params"),
    ("/generate", {"input_ids": [1], "sampling_params": "greedy"}, "sampling_params"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": "a"}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 1.5}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"input_ids": [1, 2], "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"input_ids": [1], "stream": True}, "stream"),
    ("/generate", {"input_ids": [1], "rid": 5}, "rid"), ("/generate", {"input_ids": [1], "rid": ["a"]}, "rid"),
    ("/generate", {"input_ids": [1], "rid": ""}, "rid"), ("/generate", {"text": "hi"}, "input_ids"),
    ("/generate", {"input_ids": [1], "image_data": "x.png"}, "image"), ("/generate", {}, "input_ids"),
    ("/abort_request", b"{not json", "json"), ("/abort_request", b"[]", "object"),
    ("/abort_request", {"rid": 5}, "rid"), ("/abort_request", {}, "rid"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/update_weights_from_disk", b"{not json", "json"), ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "no"}, "abort_all_requests"),
    ("/update_weights_from_distributed", {"names": "x"}, "names"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[-1]]}, "shapes"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["bfloat16"], "shapes": [[1]]}, "names"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "missing"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "abc", "world_size": 2},
     "master_port"),
    ("/destroy_weights_update_group", {"group_name": 5}, "group_name"),
]


@pytest.mark.parametrize("path,body,why", MALFORMED, ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_bodies_get_a_json_400(S, path, body, why):
    raw = body if isinstance(body, bytes) else None
    refused(call(S.addr, path, None if raw else body, raw=raw), 400, match=why)


def test_unknown_paths_and_methods_get_json_errors_and_the_server_is_healthy(S):
    refused(call(S.addr, "/no_such_endpoint", {}), 404)
    refused(call(S.addr, "/generate", method="GET"), 405)
    assert_healthy(S)


# ---- fuzzing -------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=hostile.generate_bodies(VOCAB, CTX))
def test_fuzzed_generate_bodies_are_answered_200_or_400(S, body):
    code, ctype, obj = call(S.addr, "/generate", body)
    assert ctype == "application/json", obj
    if code == 200:
        ids = obj["output_ids"]
        assert all(0 <= t < VOCAB for t in ids) and len(ids) <= CTX
        assert all(x[0] <= 0 for x in obj["meta_info"].get("output_token_logprobs", []))
    else:
        refused((code, ctype, obj), 400)


def test_server_is_healthy_after_the_fuzzing(S):
    assert_healthy(S)


# ---- concurrency, aborts, disconnects ----------------------------------------------------------
def _prefix(got, ref) -> bool:
    n = len(got[0])
    return all(g == r[:n] for g, r in zip(got, ref))


def test_abort_storm_and_pause_cycles_keep_every_answer_a_prefix_of_the_truth(S):
    """Twelve copies of the reference request race aborts (all and by id), pauses and
    continues: each gets a JSON answer whose tokens and log-probs are a prefix of the
    reference (whole, unless aborted), and the server is healthy afterwards."""
    def storm():
        for i in range(6):
            call(S.addr, "/abort_request", {"abort_all": True})
            call(S.addr, "/abort_request", {"rid": f"nope-{i}"})
            call(S.addr, "/pause_generation", {})
            call(S.addr, "/continue_generation", {})
            time.sleep(0.01)

    with cf.ThreadPoolExecutor(14) as ex:
        futs = [ex.submit(call, S.addr, "/generate", REF) for _ in range(12)]
        storms = [ex.submit(storm) for _ in range(2)]
        results = [f.result(timeout=300) for f in futs]
        for f in storms:
            f.result(timeout=300)
    for res in results:
        got = bits(res)
        reason = res[2]["meta_info"]["finish_reason"]["type"]
        assert reason in ("length", "abort") and _prefix(got, S.ref), (reason, got)
        assert reason == "abort" or got == S.ref
    assert_healthy(S)


def _disconnect(addr: str, body: bytes, partial: bool) -> None:
    host, port = addr.split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    head = (f"POST /generate HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s.sendall(head + (body[: len(body) // 2] if partial else body))
    s.close()


def test_client_disconnects_mid_request_leave_the_server_healthy(S):
    body = json.dumps(LONG).encode()
    for i in range(6):
        _disconnect(S.addr, body, partial=bool(i % 2))
    time.sleep(0.2)
    assert_healthy(S)


# ---- weight updates ----------------------------------------------------------------------------
def _two_file_checkpoint(root, params: list, second: dict | bytes) -> str:
    """A checkpoint whose first file sets half of ``params`` ((name, shape) pairs) to new
    values and whose second file is ``second`` (tensors, or raw bytes)."""
    from safetensors.torch import save_file
    os.makedirs(root, exist_ok=True)
    first = {n: torch.full(s, 0.5, dtype=torch.bfloat16) for n, s in params[: len(params) // 2]}
    save_file(first, os.path.join(root, "model-00001-of-00002.safetensors"))
    path2 = os.path.join(root, "model-00002-of-00002.safetensors")
    if isinstance(second, bytes):
        with open(path2, "wb") as f:
            f.write(second)
    else:
        save_file(second, path2)
    return str(root)


def _bad_checkpoints(S, tmp_path) -> list:
    """(path, expected reason) of checkpoints a disk update must refuse as a whole."""
    params = [(n, tuple(p.shape)) for n, p in S.server.worker.engine.model.named_parameters()]
    real, shape = params[-1]
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text("{}")
    return [
        (_two_file_checkpoint(tmp_path / "unknown", params,
                              {"model.bogus.weight": torch.zeros(2, dtype=torch.bfloat16)}), "unknown parameter"),
        (_two_file_checkpoint(tmp_path / "shape", params, {real: torch.zeros(shape[0] + 1, dtype=torch.bfloat16)}),
         "shape"),
        (_two_file_checkpoint(tmp_path / "dtype", params, {real: torch.zeros(shape, dtype=torch.int64)}), "dtype"),
        (_two_file_checkpoint(tmp_path / "corrupt", params, b"\x00\x01 not a safetensors file"), "cannot read"),
        (str(empty), "no *.safetensors"), (str(cfg_only), "no *.safetensors"),
        (str(tmp_path / "missing"), "not a directory"), (str(cfg_only / "config.json"), "not a directory"),
    ]


def test_failed_disk_updates_change_nothing(S, tmp_path):
    """A checkpoint whose first file is fine and whose second names an unknown parameter (or a
    wrong shape, a wrong dtype, an unreadable file), an empty or missing directory: 400 with
    the reason, and the weights (bits), version and digest are exactly the old ones."""
    for path, why in _bad_checkpoints(S, tmp_path):
        refused(call(S.addr, "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True}), 400,
                match=why)
        i = info(S.addr)
        assert (i["weight_version"], i["weights_digest"]) == (S.version, S.digest), path
        assert bits(call(S.addr, "/generate", REF)) == S.ref, f"weights changed by the refused update {path}"
    assert_healthy(S)


def test_failed_update_with_abort_does_not_abort_the_requests_in_flight(S, tmp_path):
    path, _ = _bad_checkpoints(S, tmp_path)[0]
    th, box = in_thread(call, S.addr, "/generate", LONG)
    wait_active(S.addr)
    refused(call(S.addr, "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True}), 400)
    th.join(120)
    assert box["r"][2]["meta_info"]["finish_reason"]["type"] == "length"
    assert bits(box["r"]) == S.long_ref
    assert_healthy(S)


def test_update_with_requests_in_flight_and_no_abort_is_409_then_a_good_update_works(S):
    th, box = in_thread(call, S.addr, "/generate", LONG)
    wait_active(S.addr)
    refused(call(S.addr, "/update_weights_from_disk", {"model_path": S.ckpt, "abort_all_requests": False}), 409,
            match="in flight")
    th.join(120)
    assert bits(box["r"]) == S.long_ref
    code, _, obj = call(S.addr, "/update_weights_from_disk", {"model_path": S.ckpt, "abort_all_requests": True})
    assert code == 200 and obj["success"] and obj["version"] == S.version + 1
    S.version += 1
    assert_healthy(S)


def _xccl_trainer(addr: str, fileroot: str, q_out, q_in) -> None:
    """AReaL's trainer side (rank 0, gloo). One update (between pause and continue) of three
    buckets: the first half of the weights with new values (valid), a bucket with a NaN in a real
    tensor, then a bucket naming an unknown parameter; then, when told, one update of the
    model's original weights in two buckets. Reports each outcome."""
    try:
        import torch.distributed as dist
        from areal.api.alloc_mode import ModelAllocation
        from areal.api.cli_args import InferenceEngineConfig
        from areal.api.io_struct import ParamSpec, WeightUpdateMeta
        from areal.engine.core.distributed import init_custom_process_group
        from areal.engine.sglang_remote import RemoteSGLangEngine
        from areal.utils.network import find_free_ports

        from areal_tik.layers.models import build_model
        cfg = InferenceEngineConfig(experiment_name="tikfault", trial_name="x", backend="sglang:d1p1t1",
                                    setup_timeout=30, request_timeout=60, pause_grace_period=0.0, fileroot=fileroot)
        client = RemoteSGLangEngine(cfg)
        client.initialize(addr=addr, train_data_parallel_size=1)
        meta = WeightUpdateMeta.from_fsdp_xccl(gen_allocation=ModelAllocation.from_str("sglang:d1p1t1", name="rollout"))
        meta.nccl_master_address, meta.nccl_master_port = "127.0.0.1", find_free_ports(1)[0]
        meta.nccl_group_name = "fault_group"
        fut = client.init_weights_update_group(meta)
        pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}",
                                       world_size=2, rank=0, group_name=meta.nccl_group_name)
        fut.result()
        named = [(n, p.detach().to(torch.bfloat16)) for n, p in
                 build_model("tiny-qwen2", dtype=torch.bfloat16, device="cpu").named_parameters()]

        def send(bucket):
            specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split(".")[1]) for n, t in bucket]
            f = client.update_weights_from_distributed(meta, specs)
            for _, t in bucket:
                dist.broadcast(t, src=0, group=pg)
            try:
                f.result()
                return "ok"
            except Exception as e:  # noqa: BLE001 - the refusal is the expected outcome
                return f"refused: {e}"

        half = len(named) // 2
        client.pause_generation()
        q_out.put(send([(n, torch.full_like(t, 0.25)) for n, t in named[:half]]))
        n0, t0 = named[half]
        nan = torch.full_like(t0, 0.5)
        nan.view(-1)[3] = float("nan")
        q_out.put(send([(n0, nan)]))
        q_out.put(send([(named[-1][0], torch.zeros_like(named[-1][1])), ("model.bogus.weight", torch.zeros(4))]))
        client.continue_generation()
        q_out.put("continued")
        assert q_in.get(timeout=120) == "go"
        client.pause_generation()
        q_out.put(send(named[:half]))
        q_out.put(send(named[half:]))
        client.continue_generation()
        dist.destroy_process_group(pg)
        client.destroy()
        q_out.put("done")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback
        q_out.put(f"trainer failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def test_refused_xccl_buckets_change_nothing_and_the_group_stays_usable(S, tmp_path):
    """xccl, all or nothing across the buckets of one update: a valid first bucket, then a bucket
    with a NaN (refused) and one naming an unknown parameter (refused, its broadcasts drained);
    at continue nothing of the update is applied, not even the valid first bucket (the weights,
    version and digest stay the old ones). The next update, through the same group, loads."""
    pytest.importorskip("areal.api")
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_xccl_trainer, args=(S.addr, str(tmp_path), q_out, q_in))
    p.start()
    try:
        assert q_out.get(timeout=240) == "ok"  # staged, not applied
        for _ in range(2):  # AReaL's client reports the status only (the reason is in the server's log)
            res = q_out.get(timeout=240)
            assert res.startswith("refused") and "status=400" in res, res
        assert q_out.get(timeout=120) == "continued"
        i = wait_idle(S.addr)
        assert not i["paused"]
        assert (i["weight_version"], i["weights_digest"]) == (S.version, S.digest), "a refused update changed weights"
        assert bits(call(S.addr, "/generate", REF)) == S.ref
        q_in.put("go")
        assert q_out.get(timeout=120) == "ok" and q_out.get(timeout=120) == "ok"
        assert q_out.get(timeout=120) == "done"
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    S.version += 1  # the valid update: the original weights as a new version
    server_groups = S.server.worker.groups
    if "fault_group" in server_groups:  # the trainer destroyed its side; the server leaves too
        call(S.addr, "/destroy_weights_update_group", {"group_name": "fault_group"})
    assert_healthy(S)
