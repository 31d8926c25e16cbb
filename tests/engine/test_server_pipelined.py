"""The rollout server with the pipelined decode (its default) answers exactly what it answers without it
(``--disable-overlap-schedule``): concurrent requests, then a disk weight update that aborts the requests in
flight, then the same requests again. Decode graphs are emulated on a CPU (tests/engine/conftest.py), so the
pipeline really runs there; the pipelined server's ``pipelined_steps`` counter shows it did (and the other's
shows it did not)."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import sys
import time

import pytest

from areal_tik.engine.server import ServerConfig, build

sys.path.insert(0, os.path.dirname(__file__))
from http_helpers import bits, call, free_port as _free_port, serving, wait_idle  # noqa: E402

pytestmark = pytest.mark.usefixtures("graphs")

REQS = [{"input_ids": [3 + i, 5, 7 + 2 * i], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 10 + 3 * i, "temperature": 1.0, "sampling_seed": 100 + i,
                             "ignore_eos": True}} for i in range(6)]


def _serve(stack: contextlib.ExitStack, overlap: bool):
    """A tiny-qwen2 server with or without the pipelined decode, running until ``stack`` closes: (engine, addr)."""
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=_free_port(), max_running_requests=8,
                       context_length=64, precompile=False, disable_overlap_schedule=not overlap)
    server = build(cfg, device="cpu")
    return server.worker.engine, stack.enter_context(serving(server))


def _answers(addr: str) -> list:
    with cf.ThreadPoolExecutor(len(REQS)) as ex:
        futs = [ex.submit(call, addr, "/generate", r) for r in REQS]
        return [bits(f.result(timeout=300)) for f in futs]


def _is_prefix(a, b) -> bool:
    return all(x == y[:len(x)] for x, y in zip(a, b))


def test_pipelined_server_answers_what_the_unpipelined_server_answers(tmp_path):
    with contextlib.ExitStack() as stack:
        ref_eng, ref_addr = _serve(stack, overlap=False)
        pip_eng, pip_addr = _serve(stack, overlap=True)
        assert ref_eng.config.async_decode is False and pip_eng.config.async_decode is True
        truth = _answers(ref_addr)
        assert _answers(pip_addr) == truth
        assert pip_eng.stats()["pipelined_steps"] > 0 and ref_eng.stats()["pipelined_steps"] == 0

        # a disk update (the same weights, a new version) that aborts the requests in flight
        ckpt = tmp_path / "ckpt"
        pip_eng.model.save_pretrained(ckpt)
        with cf.ThreadPoolExecutor(len(REQS)) as ex:
            futs = [ex.submit(call, pip_addr, "/generate", r) for r in REQS]
            time.sleep(0.2)
            code, _, obj = call(pip_addr, "/update_weights_from_disk",
                                {"model_path": str(ckpt), "abort_all_requests": True})
            assert code == 200 and obj.get("success") is True, obj
            cut = [f.result(timeout=300) for f in futs]
        for res, full in zip(cut, truth):
            got = bits(res)
            reason = res[2]["meta_info"]["finish_reason"]["type"]
            assert reason in ("length", "abort") and _is_prefix(got, full), (reason, got)
            assert reason == "abort" or got == full
        wait_idle(pip_addr)
        assert _answers(pip_addr) == truth     # same weights after the update: the same bits
