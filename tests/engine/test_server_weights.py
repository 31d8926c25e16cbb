"""Weight updates the rollout server must refuse without harm: a checkpoint with a NaN or an
infinity (what a diverged trainer writes), and a checkpoint whose ``model.safetensors`` is a
FIFO (opening it would block the loader forever; ``/health`` must keep answering). Each is
refused with a one-line 400 naming the cause, and the version, digest and bits stay the old ones.

One real ``tiny-qwen2`` server (tik kernels, CPU) serves the module.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest
import torch

from areal_tik.engine.server import ServerConfig, build

sys.path.insert(0, os.path.dirname(__file__))
from http_helpers import bits, call, free_port, in_thread, info, refused, serving, wait_idle  # noqa: E402

REF = {"input_ids": [3, 5, 7, 9], "return_logprob": True,
       "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}


@pytest.fixture(scope="module")
def S():
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=free_port(), max_running_requests=4,
                       context_length=64, precompile=False)
    server = build(cfg, device="cpu")
    params = {n: p.detach().clone() for n, p in server.worker.engine.model.named_parameters()}  # before serving
    with serving(server) as addr:
        i0 = info(addr)
        yield types.SimpleNamespace(addr=addr, params=params, version=i0["weight_version"],
                                    digest=i0["weights_digest"], ref=bits(call(addr, "/generate", REF)))


def assert_unchanged(S) -> None:
    i = wait_idle(S.addr, timeout=30)
    assert (i["weight_version"], i["weights_digest"]) == (S.version, S.digest), "a refused update changed weights"
    assert bits(call(S.addr, "/generate", REF)) == S.ref


def _checkpoint(root, params: dict, name: str | None = None, value: float = 0.0):
    """``params`` (a little changed) saved as an HF safetensors directory, ``name``'s first value set to ``value``."""
    from safetensors.torch import save_file
    os.makedirs(root, exist_ok=True)
    tensors = {n: (t.float() * 1.01).to(t.dtype) for n, t in params.items()}
    if name is not None:
        tensors[name].view(-1)[0] = value
    save_file(tensors, os.path.join(root, "model.safetensors"))
    return str(root)


@pytest.mark.parametrize("name,value", [("model.norm.weight", float("nan")), ("lm_head.weight", float("inf"))])
def test_a_checkpoint_with_a_non_finite_value_is_refused_naming_the_tensor(S, tmp_path, name, value):
    path = _checkpoint(tmp_path / "ckpt", S.params, name, value)
    msg = refused(call(S.addr, "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True}), 400,
                  match=name)
    assert "NaN or infinite" in msg, msg
    assert_unchanged(S)


# opens the FIFO for writing after a delay, only if a reader waits on it (else it would block for good),
# and writes bytes that are no safetensors file: unblocks a loader stuck on the FIFO
_UNBLOCK = """
import errno, os, sys, time
time.sleep(float(sys.argv[2]))
try:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK)
except OSError as e:
    sys.exit(0 if e.errno == errno.ENXIO else 1)
os.write(fd, b"not a safetensors file")
os.close(fd)
"""


def test_a_fifo_named_model_safetensors_is_refused_up_front_and_health_keeps_answering(S, tmp_path):
    root = tmp_path / "fifo_ckpt"
    root.mkdir()
    os.mkfifo(root / "model.safetensors")
    # a server that opens the FIFO blocks (and, with the GIL held, this whole process) until a writer
    # comes: this helper is that writer, 8 s from now, so the test ends either way
    helper = subprocess.Popen([sys.executable, "-c", _UNBLOCK, str(root / "model.safetensors"), "8"])
    try:
        t0 = time.perf_counter()
        th, box = in_thread(call, S.addr, "/update_weights_from_disk",
                            {"model_path": str(root), "abort_all_requests": True})
        for _ in range(5):
            code, _, obj = call(S.addr, "/health", method="GET", timeout=2)
            assert code == 200 and obj["status"] == "ok"
            assert time.perf_counter() - t0 < 4, "/health stopped answering during the update"
            time.sleep(0.1)
        th.join(30)
        assert time.perf_counter() - t0 < 4, "the update blocked on the FIFO"
        refused(box["r"], 400, match="model.safetensors is a FIFO, not a regular file")
    finally:
        helper.wait(30)
    assert_unchanged(S)
