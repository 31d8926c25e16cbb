"""``/update_weights_from_ipc``: a trainer process shares one buffer of every weight (``engine/weight_ipc``; on the
CPU a ``/dev/shm`` file, on a GPU a CUDA IPC handle) and the rollout server loads its views: after the update the
server's parameters equal the exporter's tensors bit for bit (another process wrote them), the version advances
once per update, a second update with the same key reuses the mapping (the handle need not be sent again), and
bad requests (a wrong handle, a view outside the buffer, an unknown name, a non-loopback peer) are refused in one
line with the weights, version and digest unchanged. One real ``tiny-qwen2`` server (tik kernels, CPU)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from areal_tik.engine.server import ServerConfig, build
from areal_tik.engine.weight_ipc import IPCError, SharedWeights, check_layout, export_buffer, import_buffer

sys.path.insert(0, os.path.dirname(__file__))
from http_helpers import bits, call, free_port, info, refused, serving, wait_idle  # noqa: E402

REF = {"input_ids": [3, 5, 7, 9], "return_logprob": True,
       "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}

# the trainer side, in its own process: the weights of a seed, shared; one request per line on stdout, a new seed
# per line on stdin (refill, the request without the handle), "exit" to end
EXPORTER = r"""
import json, sys, torch, torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
from areal_tik.engine.weight_ipc import SharedWeights
spec = json.loads(sys.argv[1])
def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, (torch.randn(s, generator=g) * 0.05).float()) for n, s in spec]
sw = SharedWeights(weights(0), torch.bfloat16, "cpu")
first = True
for line in sys.stdin:
    if line.strip() == "exit":
        break
    sw.fill(weights(int(line)))
    print(json.dumps(sw.request(with_handle=first)), flush=True)
    first = False
"""


def expected(spec, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.05).float().to(torch.bfloat16) for n, s in spec}


class Exporter:
    def __init__(self, spec):
        env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.p = subprocess.Popen([sys.executable, "-c", EXPORTER, json.dumps(spec)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def request(self, seed: int) -> dict:
        self.p.stdin.write(f"{seed}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.write("exit\n")
        self.p.stdin.flush()
        self.p.wait(timeout=30)


@pytest.fixture(scope="module")
def S():
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=free_port(), max_running_requests=4,
                       context_length=64, precompile=False)
    server = build(cfg, device="cpu")
    model = server.worker.engine.model
    spec = [(n, list(p.shape)) for n, p in model.named_parameters()]
    exp = Exporter(spec)
    with serving(server) as addr:
        yield types.SimpleNamespace(addr=addr, server=server, model=model, spec=spec, exp=exp)
    exp.close()


def snapshot(S):
    i = wait_idle(S.addr, timeout=30)
    return i["weight_version"], i["weights_digest"], bits(call(S.addr, "/generate", REF))


def test_updates_from_another_process_land_bit_for_bit_and_reuse_the_mapping(S):
    v0 = info(S.addr)["weight_version"]
    first = S.exp.request(1)
    assert "handle" in first and first["handle"]["kind"] == "shm"
    res = call(S.addr, "/update_weights_from_ipc", first)
    assert res[0] == 200 and res[2]["version"] == v0 + 1, res
    want = expected(S.spec, 1)
    for n, p in S.model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n
    d1 = info(S.addr)["weights_digest"]
    second = S.exp.request(2)                       # the same buffer, refilled: no handle this time
    assert "handle" not in second
    res = call(S.addr, "/update_weights_from_ipc", second)
    assert res[0] == 200 and res[2]["version"] == v0 + 2, res
    want = expected(S.spec, 2)
    assert all(torch.equal(p.detach(), want[n]) for n, p in S.model.named_parameters())
    assert info(S.addr)["weights_digest"] != d1      # negative control: other weights, another digest


def test_bad_requests_are_refused_and_change_nothing(S):
    good = S.exp.request(3)
    assert call(S.addr, "/update_weights_from_ipc", good)[0] == 200
    before = snapshot(S)
    layout = good["layout"]
    outside = [[layout[0][0], layout[0][1], 10 ** 12]] + layout[1:]
    unknown = [["model.layers.0.not_a_weight", [4], 0]] + layout[1:]
    cases = [
        (dict(good, key="other"), "not mapped here"),                                    # a new key, no handle
        (dict(good, key="other", handle={"kind": "tcp", "dtype": "bfloat16", "numel": 1, "offset": 0,
                                         "size_bytes": 2}), "handle.kind"),
        (dict(good, key="other", handle={"kind": "shm", "dtype": "bfloat16", "numel": 10, "offset": 0,
                                         "size_bytes": 2, "manager": "", "filename": ""}), "pass the buffer"),
        (dict(good, key="other", handle={"kind": "shm", "dtype": "bfloat16", "numel": 1, "offset": 0,
                                         "size_bytes": 2, "manager": "eA==", "filename": "L2V0Yy9wYXNzd2Q="}),
         "torch shared-memory file"),
        (dict(good, layout=outside), "pass the buffer"),
        (dict(good, layout=unknown), "not_a_weight"),
        (dict(good, layout="all"), "layout must be a list"),
        (dict(good, layout=[["x", [2], -1]]), "layout[0]"),
    ]
    for body, match in cases:
        refused(call(S.addr, "/update_weights_from_ipc", body), 400, match=match)
        assert snapshot(S) == before, match
    assert call(S.addr, "/update_weights_from_ipc", dict(good))[0] == 200    # the mapping survived the refusals


def test_only_loopback_peers_may_send_a_handle(S):
    async def ask(remote):
        req = types.SimpleNamespace(remote=remote)
        return await S.server.update_weights_from_ipc(req)
    r = asyncio.run(ask("10.1.2.3"))
    assert r.status == 403 and "loopback" in json.loads(r.body)["message"]


def test_handles_and_layouts_are_checked_in_one_line():
    t = torch.zeros(8, dtype=torch.bfloat16)
    h = export_buffer(t)
    assert import_buffer(h).shape == (8,)
    for bad, match in (({**h, "dtype": "int8"}, "handle.dtype"), ({**h, "numel": -1}, "handle.numel"),
                       ({**h, "filename": "!!"}, "base64"), ({**h, "offset": True}, "handle.offset")):
        with pytest.raises(IPCError, match=match):
            import_buffer(bad)
    with pytest.raises(IPCError, match="layout"):
        check_layout([], 8)
    with pytest.raises(IPCError, match=r"layout\[0\]"):
        check_layout([["w", [3, 3], 0]], 8)
    with pytest.raises(IPCError, match="no floating-point"):
        SharedWeights([("ids", torch.zeros(3, dtype=torch.int64))], torch.bfloat16, "cpu")
    sw = SharedWeights([("a", torch.ones(2)), ("b", torch.ones(3))], torch.bfloat16, "cpu")
    with pytest.raises(IPCError, match="not given"):
        sw.fill([("a", torch.ones(2))])


@pytest.mark.gpu
def test_gpu_cuda_ipc_handle_maps_in_another_process():
    """A CUDA buffer's handle opened in another process on the same GPU: the importer sees the exporter's values
    and the exporter sees the importer's writes (one allocation)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    buf = torch.arange(1024, device="cuda", dtype=torch.float32)
    h = export_buffer(buf)
    code = ("import json,sys,torch; from areal_tik.engine.weight_ipc import import_buffer;"
            "b=import_buffer(json.loads(sys.stdin.read())); print(float(b.sum())); b[0]=-1.0;"
            "torch.cuda.synchronize()")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(h), capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout.strip()) == float(sum(range(1024)))
    torch.cuda.synchronize()
    assert buf[0].item() == -1.0
