"""The tik server's HTTP contract, driven by AReaL's real SGLang client classes over 127.0.0.1.

Two engines behind the server:
- ``ScriptedEngine``: a deterministic stand-in (token t+1 after t, log-prob -0.25*(k+1),
  one token per step with a small delay) that tests the HTTP layer on its own: shapes,
  content type, pause -> abort with partial output -> AReaL's client re-posts and
  resumes, weight update version bump, input log-probs;
- the real ``LLMEngine`` on a patched ``tiny-qwen2`` (skipped until the engine lands):
  AReaL's ``agenerate`` log-probs equal ``areal_tik.dispatch.ops`` recomputation bit for bit.
"""
import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request
import json

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal.api import ModelRequest  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.api.io_struct import WeightUpdateMeta  # noqa: E402
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend  # noqa: E402
from areal.infra.utils.http import arequest_with_retry  # noqa: E402

from areal_tik.engine.sequence import SamplingParams  # noqa: E402
from areal_tik.engine.server import EngineWorker, ServerConfig, TikServer, run_server  # noqa: E402

pytestmark = pytest.mark.areal


class _Out:
    def __init__(self, rid, prompt, ids, lps, reason, version):
        self.request_id, self.prompt_ids, self.output_ids = rid, prompt, ids
        self.output_logprobs, self.finish_reason, self.version = lps, reason, version


class ScriptedEngine:
    """Stand-in for LLMEngine (HTTP-layer test only): deterministic tokens, slow steps."""

    def __init__(self, vocab=100, delay=0.02):
        self.vocab, self.delay, self.version = vocab, delay, 0
        self.reqs = {}
        self.loaded = []

    def add_request(self, rid, ids, params):
        self.reqs[rid] = dict(prompt=list(ids), out=[], lps=[], params=params)

    def step(self):
        time.sleep(self.delay)
        outs = []
        for rid, r in list(self.reqs.items()):
            last = (r["out"] or r["prompt"])[-1]
            tok = (last + 1) % self.vocab
            r["out"].append(tok)
            r["lps"].append(-0.25 * len(r["out"]))
            p = r["params"]
            reason = None
            if tok in p.stop_token_ids and not p.ignore_eos:
                reason = "stop"
            elif len(r["out"]) >= p.max_new_tokens:
                reason = "length"
            if reason:
                del self.reqs[rid]
            outs.append(_Out(rid, r["prompt"], list(r["out"]), list(r["lps"]), reason, self.version))
        return outs

    def abort(self, rid):
        r = self.reqs.pop(rid, None)
        return None if r is None else _Out(rid, r["prompt"], r["out"], r["lps"], "abort", self.version)

    def update_weights(self, path, version):
        self.loaded.append(path)
        self.version = version

    def score(self, ids, temperature):
        return [-0.5 * (i + 1) for i in range(len(ids) - 1)]


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture
def scripted_server():
    eng = ScriptedEngine()
    cfg = ServerConfig(model="scripted", kernels="tik", port=_free_port())
    server = TikServer(EngineWorker(eng, SamplingParams, model_info=lambda: {"weights_digest": f"d{eng.version}"}),
                       cfg, {"kernels": "tik", "kernel_fingerprint": "fp-test",
                             "logprobs": "log_softmax(logits.float()/T)[token], unfiltered"})
    ready, stop = threading.Event(), threading.Event()
    th = threading.Thread(target=run_server, args=(server, ready, stop), daemon=True)
    th.start()
    assert ready.wait(30)
    yield eng, f"127.0.0.1:{cfg.port}"
    stop.set()
    th.join(15)


def _client(addr, tmp_path):
    cfg = InferenceEngineConfig(experiment_name="tiktest", trial_name="srv", backend="sglang:d1p1t1",
                                setup_timeout=30, request_timeout=30, pause_grace_period=0.0,
                                fileroot=str(tmp_path))
    eng = RemoteSGLangEngine(cfg)
    eng.initialize(addr=addr, train_data_parallel_size=1)
    return eng


def _get(addr, path):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
        assert r.headers.get_content_type() == "application/json"
        return json.loads(r.read())


def _post(addr, path, payload):
    async def go():
        import aiohttp
        async with aiohttp.ClientSession() as s:
            return await arequest_with_retry(session=s, addr=addr, endpoint=path, payload=payload,
                                             method="POST", max_retries=1, timeout=30)
    return asyncio.run(go())


def test_health_info_and_generate_through_areal_client(scripted_server, tmp_path):
    eng, addr = scripted_server
    assert _get(addr, "/health")["status"] == "ok"
    info = _get(addr, "/get_server_info")
    assert info["kernels"] == "tik" and info["kernel_fingerprint"] == "fp-test" and info["weight_version"] == 0
    assert _get(addr, "/model_info")["model_path"] == "scripted"

    client = _client(addr, tmp_path)
    try:
        g = GenerationHyperparameters(max_new_tokens=5, temperature=1.0, stop_token_ids=[13])
        resp = asyncio.run(client.agenerate(ModelRequest(rid="a", input_ids=[7, 8, 9], gconfig=g)))
        assert resp.output_tokens == [10, 11, 12, 13] and resp.stop_reason == "stop"
        assert resp.output_logprobs == [-0.25, -0.5, -0.75, -1.0]
        resp = asyncio.run(client.agenerate(ModelRequest(rid="b", input_ids=[1], gconfig=g.new(stop_token_ids=[]))))
        assert resp.output_tokens == [2, 3, 4, 5, 6] and resp.stop_reason == "length"
        assert resp.output_versions == [0] * 5
    finally:
        client.destroy()


def test_raw_shapes_and_input_logprobs(scripted_server):
    _, addr = scripted_server
    r = _post(addr, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0,
                                  "top_k": int(1e8), "top_p": 1.0}, "return_logprob": True, "stream": False})
    m = r["meta_info"]
    assert m["output_token_logprobs"] == [[-0.25, 5, None], [-0.5, 6, None]]
    assert m["finish_reason"]["type"] == "length" and m["prompt_tokens"] == 2 and m["completion_tokens"] == 2
    # AReaL's scoring request (SGLangBackend.build_score_request) -> parse_score_response
    b = SGLangBackend()
    req = b.build_score_request([1, 2, 3, 4, 5], target_len=3, with_lora=False, version=0)
    res = _post(addr, req.endpoint, req.payload)
    assert b.parse_score_response(res, 3) == [-1.0, -1.5, -2.0]
    assert res["meta_info"]["input_token_logprobs"][0][1] == 2
    bad = urllib.request.Request(f"http://{addr}/generate", data=json.dumps({"input_ids": [1], "sampling_params": {
        "frequency_penalty": 0.5}}).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(bad, timeout=10)
    assert ei.value.code == 400 and ei.value.headers.get_content_type() == "application/json"


def test_pause_abort_resume_and_weight_update(scripted_server, tmp_path):
    eng, addr = scripted_server
    client = _client(addr, tmp_path)
    try:
        g = GenerationHyperparameters(max_new_tokens=40, temperature=1.0)

        async def gen():
            return await client.agenerate(ModelRequest(rid="long", input_ids=[0], gconfig=g))

        box = {}
        th = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(gen())))
        th.start()
        time.sleep(0.3)  # some tokens generated at version 0
        client.pause()  # workflow executor paused: the client waits before re-posting
        client.pause_generation()  # server aborts in-flight requests with their partial output
        info = _get(addr, "/get_server_info")
        assert info["paused"] and info["active_requests"] == 0
        meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "w1"))
        for req in SGLangBackend().build_disk_weight_update_requests(meta).requests:
            res = _post(addr, req.endpoint, req.payload)
            assert res["success"] and res["version"] == 1
        assert eng.loaded == [str(tmp_path / "w1")]
        client.set_version(1)
        client.continue_generation()
        client.resume()
        th.join(30)
        resp = box["r"]
        assert resp.output_tokens == [(i + 1) % 100 for i in range(40)]  # resumed seamlessly
        assert resp.stop_reason == "length"
        vs = resp.output_versions
        assert vs[0] == 0 and vs[-1] == 1 and vs == sorted(vs)  # mixed-version trajectory, as AReaL records it
        assert _get(addr, "/get_server_info")["weight_version"] == 1
        assert _get(addr, "/get_server_info")["weights_digest"] == "d1"
        assert _post(addr, "/flush_cache", {})["success"]
    finally:
        client.destroy()


def test_real_engine_logprobs_match_ops(tmp_path):
    engine_mod = pytest.importorskip("areal_tik.engine")
    if not hasattr(engine_mod, "LLMEngine"):
        pytest.skip("areal_tik.engine.LLMEngine not available yet")
    import torch

    from areal_tik.dispatch import ops
    from areal_tik.engine.server import build
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=_free_port())
    server = build(cfg, device="cpu", dtype="bfloat16")
    ready, stop = threading.Event(), threading.Event()
    th = threading.Thread(target=run_server, args=(server, ready, stop), daemon=True)
    th.start()
    assert ready.wait(60)
    addr = f"127.0.0.1:{cfg.port}"
    client = _client(addr, tmp_path)
    try:
        g = GenerationHyperparameters(max_new_tokens=6, temperature=1.0, top_k=int(1e8), top_p=1.0)

        async def many():
            return await asyncio.gather(*[client.agenerate(ModelRequest(rid=f"r{i}", input_ids=[5, 6 + i, 7],
                                                                        gconfig=g.new())) for i in range(3)])
        resps = asyncio.run(many())
        info = _get(addr, "/get_server_info")
        assert info["kernels"] == "tik" and len(info["weights_digest"]) == 16
        model = server.worker.engine.model if hasattr(server.worker.engine, "model") else None
        for r in resps:
            seq = r.input_tokens + r.output_tokens
            lps = server.worker.engine.score(seq, 1.0)[len(r.input_tokens) - 1:]
            assert torch.equal(torch.tensor(lps, dtype=torch.float32),
                               torch.tensor(r.output_logprobs, dtype=torch.float32)), (lps, r.output_logprobs)
        # a weight update reports the rollout interval before it (engine busy time, requests, tokens)
        ckpt = tmp_path / "ckpt"
        server.worker.engine.model.save_pretrained(ckpt)
        res = _post(addr, "/update_weights_from_disk", {"model_path": str(ckpt), "abort_all_requests": True})
        iv = res["previous_interval"]
        assert iv["requests"] == 3 and iv["tokens"] == sum(len(r.output_tokens) for r in resps)
        assert iv["engine_steps"] >= 6 and iv["engine_busy_s"] > 0
        assert 0 < iv["engine_busy_s"] <= iv["first_request_to_last_finish_s"] + 1e-3
        # the prefill ran eager, the decode steps through (emulated-on-CPU or real) graphs or eager
        assert 1 <= iv["eager_steps"] <= iv["engine_steps"] and 0 < iv["eager_s"] <= iv["engine_busy_s"] + 1e-9
        assert 0 < iv["max_step_ms"] <= 1e3 * iv["engine_busy_s"] + 1e-6
        assert iv["jit_compiles"] >= 0 and iv["graphs_captured"] >= 0
        res2 = _post(addr, "/update_weights_from_disk", {"model_path": str(ckpt), "abort_all_requests": True})
        assert res2["previous_interval"] == {"engine_busy_s": 0.0, "engine_steps": 0, "tokens": 0, "requests": 0,
                                             "first_request_to_last_finish_s": None, "eager_steps": 0, "eager_s": 0.0,
                                             "max_step_ms": 0.0, "graphs_captured": 0, "jit_compiles": 0,
                                             "jit_compile_s": 0.0, "jit_kernels": {}, "jit_specs": []}
        del model, ops
    finally:
        client.destroy()
        stop.set()
        th.join(15)


def _xccl_join(addr: str, fileroot: str, device: str):
    """AReaL's trainer side of xccl, rank 0, in its own process (a process holds one rank of a named
    group): AReaL's client posts /init_weights_update_group while AReaL's group helper opens the
    group. Returns (client, meta, group)."""
    import torch
    from areal.api.alloc_mode import ModelAllocation
    from areal.engine.core.distributed import init_custom_process_group
    from areal.infra.platforms import current_platform
    from areal.utils.network import find_free_ports

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    client = _client(addr, fileroot)
    meta = WeightUpdateMeta.from_fsdp_xccl(gen_allocation=ModelAllocation.from_str("sglang:d1p1t1", name="rollout"))
    meta.nccl_master_address, meta.nccl_master_port = "127.0.0.1", find_free_ports(1)[0]
    meta.nccl_group_name = "update_weight_group"
    fut = client.init_weights_update_group(meta)
    pg = init_custom_process_group(backend=current_platform.communication_backend,
                                   init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}",
                                   world_size=2, rank=0, group_name=meta.nccl_group_name)
    fut.result()
    return client, meta, pg


def _xccl_send_bucket(client, meta, pg, named: list) -> None:
    """One bucket as FSDPEngine sends it: the request, then a broadcast per tensor, in order."""
    import torch.distributed as dist
    from areal.api.io_struct import ParamSpec

    specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split(".")[1]) for n, t in named]
    fut = client.update_weights_from_distributed(meta, specs)
    for _, t in named:
        dist.broadcast(t, src=0, group=pg)
    fut.result()


def _xccl_trainer(addr: str, fileroot: str, buckets: list, updates: int, device: str, q) -> None:
    """``updates`` weight updates of the given buckets, each between pause and continue."""
    try:
        import torch

        client, meta, pg = _xccl_join(addr, fileroot, device)
        for u in range(updates):
            client.pause_generation()
            for bucket in buckets:
                _xccl_send_bucket(client, meta, pg, [
                    (n, (torch.arange(int(torch.tensor(s).prod())).reshape(s) * (u + 1)).to(getattr(torch, d)).to(device))
                    for n, d, s in bucket])
            client.continue_generation()
        _leave_group(addr, meta, pg)
        client.destroy()
        q.put("ok")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback
        q.put(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _leave_group(addr: str, meta, pg) -> None:
    """The trainer's teardown as the tik actor does it: the server leaves the group while this side
    destroys it (NCCL's teardown is collective: alone, the trainer's destroy waited forever)."""
    import time

    import torch.distributed as dist

    from areal_tik.areal.actor import servers_leave_groups
    th = threading.Thread(target=servers_leave_groups, args=([addr], [meta.nccl_group_name]))
    t0 = time.perf_counter()
    th.start()
    dist.destroy_process_group(pg)
    th.join(60)
    assert not th.is_alive() and time.perf_counter() - t0 < 60, "weight update group teardown hung"


def _xccl_updates(scripted_server, tmp_path, trainer_device, server_device):
    """AReaL's xccl mode against the server: the group is joined through /init_weights_update_group,
    each bucket arrives bit-exact, and one update (two buckets between pause and continue) is
    loaded as one, at continue, advancing the version once."""
    import multiprocessing as mp

    import torch
    eng, addr = scripted_server
    eng.device = server_device
    loaded = []
    eng.update_weights = lambda src, version: (loaded.append((version, dict(src))), setattr(eng, "version", version))
    buckets = [[("w.a", "bfloat16", [3, 5]), ("w.b", "float32", [7])], [("w.c", "bfloat16", [2, 2, 2])]]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_xccl_trainer, args=(addr, str(tmp_path), buckets, 2, trainer_device, q))
    p.start()
    try:
        res = q.get(timeout=120)
    finally:
        p.join(30)
    assert res == "ok", res
    assert [v for v, _ in loaded] == [1, 2]  # two buckets per update, loaded together at continue
    for version, got in loaded:
        assert sorted(got) == sorted(n for b in buckets for n, _, _ in b)
        for n, d, s in (x for b in buckets for x in b):
            want = (torch.arange(int(torch.tensor(s).prod())).reshape(s) * version).to(getattr(torch, d))
            assert got[n].device == torch.device(server_device) and got[n].dtype == want.dtype, n
            assert torch.equal(got[n].cpu(), want), n
    assert _get(addr, "/get_server_info")["weight_version"] == 2
    # the trainer's teardown made the server leave the group: a bucket for it is now refused
    req = urllib.request.Request(f"http://{addr}/update_weights_from_distributed", method="POST",
                                 data=json.dumps({"names": ["w.a"], "dtypes": ["bfloat16"], "shapes": [[3, 5]],
                                                  "group_name": "update_weight_group"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=30)
    assert ei.value.code == 400 and "init_weights_update_group" in json.loads(ei.value.read())["message"]


def test_xccl_weight_update_buckets_gloo(scripted_server, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("AReaL's client asks for nccl on a CUDA machine: test_xccl_weight_update_buckets_nccl")
    _xccl_updates(scripted_server, tmp_path, "cpu", "cpu")


@pytest.mark.gpu
def test_xccl_weight_update_buckets_nccl(scripted_server, tmp_path):
    """The same over NCCL: trainer on cuda:0, server receiving on cuda:1 (the A/B's 2-GPU layout)."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the two ranks on two GPUs")
    _xccl_updates(scripted_server, tmp_path, "cuda:0", "cuda:1")


def test_xccl_requests_without_a_group_fail_cleanly(scripted_server):
    _, addr = scripted_server
    for path, payload in (("/update_weights_from_distributed",
                           {"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[2]], "group_name": "nope"}),
                          ("/update_weights_from_distributed", {"names": "x"}),
                          ("/destroy_weights_update_group", {"group_name": "nope"}),
                          ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                          "rank_offset": 0, "world_size": 2, "backend": "gloo",
                                                          "group_name": "g"})):
        req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=30)
        assert ei.value.code == 400
        body = json.loads(ei.value.read())
        assert body["success"] is False and body["message"]


def _tiny_weights(scale_seed: int):
    """(name, bf16 tensor) for every tiny-qwen2 parameter, drawn from a seeded CPU generator."""
    import torch

    from areal_tik.layers.models import build_model
    g = torch.Generator().manual_seed(scale_seed)
    model = build_model("tiny-qwen2", dtype=torch.float32, device="cpu")
    return [(n, (torch.randn(p.shape, generator=g) * 0.05).to(torch.bfloat16)) for n, p in model.named_parameters()]


def _xccl_engine_trainer(addr: str, fileroot: str, device: str, q_out, q_in) -> None:
    """Trainer side for the real-engine test: join, let the test generate (CUDA-graph capture with
    the NCCL group alive), then send every tiny-qwen2 parameter in two buckets."""
    try:
        client, meta, pg = _xccl_join(addr, fileroot, device)
        q_out.put("joined")
        assert q_in.get(timeout=120) == "send"
        named = [(n, t.to(device)) for n, t in _tiny_weights(7)]
        client.pause_generation()
        half = len(named) // 2
        for bucket in (named[:half], named[half:]):
            _xccl_send_bucket(client, meta, pg, bucket)
        client.continue_generation()
        client.destroy()
        q_out.put("ok")
    except BaseException as e:  # noqa: BLE001
        import traceback
        q_out.put(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _xccl_real_engine(tmp_path, trainer_device, server_device):
    """The real engine behind the server, AReaL's trainer side in another process: decoding after
    the group exists (on CUDA, the NCCL watchdog thread must not break graph capture), then a
    two-bucket update whose result has the sender's exact bits (weights digest)."""
    import multiprocessing as mp

    from areal_tik.layers.weights_digest import digest
    from areal_tik.engine.server import build
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=_free_port(), max_running_requests=8,
                       context_length=256)
    server = build(cfg, device=server_device)
    ready, stop = threading.Event(), threading.Event()
    th = threading.Thread(target=run_server, args=(server, ready, stop), daemon=True)
    th.start()
    assert ready.wait(120)
    addr = f"127.0.0.1:{cfg.port}"
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_xccl_engine_trainer, args=(addr, str(tmp_path), trainer_device, q_out, q_in))
    p.start()
    try:
        assert q_out.get(timeout=180) == "joined"
        gen = {"input_ids": [3, 5, 7, 9], "sampling_params": {"max_new_tokens": 12, "temperature": 1.0},
               "return_logprob": True}
        r = _post(addr, "/generate", gen)
        assert len(r["output_ids"]) == 12  # graph capture + replay with the NCCL watchdog running
        before = _get(addr, "/get_server_info")
        q_in.put("send")
        assert q_out.get(timeout=180) == "ok"
        after = _get(addr, "/get_server_info")
        assert after["weight_version"] == before["weight_version"] + 1
        assert after["weights_digest"] == digest(_tiny_weights(7)) != before["weights_digest"]
        assert len(_post(addr, "/generate", gen)["output_ids"]) == 12
    finally:
        p.join(30)
        stop.set()
        th.join(30)


def test_xccl_real_engine_gloo(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("AReaL's client asks for nccl on a CUDA machine: test_xccl_real_engine_nccl")
    _xccl_real_engine(tmp_path, "cpu", "cpu")


@pytest.mark.gpu
def test_xccl_real_engine_nccl(tmp_path):
    """Server on cuda:1 (CUDA graphs), trainer side on cuda:0: the A/B's 2-GPU layout."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the two ranks on two GPUs")
    _xccl_real_engine(tmp_path, "cuda:0", "cuda:1")


def test_server_info_digest_runs_in_the_engine_thread():
    """/get_server_info computes the weights digest in the engine thread (the only one touching
    the model, with the engine's CUDA device current), not in the HTTP event loop's thread."""
    eng = ScriptedEngine()
    seen = []
    cfg = ServerConfig(model="scripted", kernels="tik", port=_free_port())
    worker = EngineWorker(eng, SamplingParams,
                          model_info=lambda: seen.append(threading.current_thread().name) or {"weights_digest": "d"})
    server = TikServer(worker, cfg, {"kernels": "tik"})
    ready, stop = threading.Event(), threading.Event()
    th = threading.Thread(target=run_server, args=(server, ready, stop), daemon=True)
    th.start()
    assert ready.wait(30)
    try:
        assert _get(f"127.0.0.1:{cfg.port}", "/get_server_info")["weights_digest"] == "d"
        assert seen == ["tik-engine"]
    finally:
        stop.set()
        th.join(15)
