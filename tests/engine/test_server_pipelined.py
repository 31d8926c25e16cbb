"""The rollout server with the pipelined decode (its default) answers exactly what it answers without it
(``--disable-overlap-schedule``): concurrent requests, then a disk weight update that aborts the requests in
flight, then the same requests again. Decode graphs are emulated on a CPU (tests/engine/conftest.py), so the
pipeline really runs there; the pipelined server's ``pipelined_steps`` counter shows it did (and the other's
shows it did not)."""
from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
import time

import pytest

from areal_tik.engine.server import ServerConfig, build, run_server

sys.path.insert(0, os.path.dirname(__file__))
from test_server_faults import _free_port, bits, call, wait_idle  # noqa: E402

pytestmark = pytest.mark.usefixtures("graphs")

REQS = [{"input_ids": [3 + i, 5, 7 + 2 * i], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 10 + 3 * i, "temperature": 1.0, "sampling_seed": 100 + i,
                             "ignore_eos": True}} for i in range(6)]


class _Served:
    def __init__(self, overlap: bool):
        self.cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=_free_port(), max_running_requests=8,
                                context_length=64, precompile=False, disable_overlap_schedule=not overlap)
        self.server = build(self.cfg, device="cpu")
        self.ready, self.stop = threading.Event(), threading.Event()
        self.th = threading.Thread(target=run_server, args=(self.server, self.ready, self.stop), daemon=True)
        self.th.start()
        assert self.ready.wait(120)
        self.addr = f"127.0.0.1:{self.cfg.port}"

    def answers(self) -> list:
        with cf.ThreadPoolExecutor(len(REQS)) as ex:
            futs = [ex.submit(call, self.addr, "/generate", r) for r in REQS]
            return [bits(f.result(timeout=300)) for f in futs]

    def pipelined_steps(self) -> int:
        return self.server.worker.engine.stats()["pipelined_steps"]

    def close(self):
        self.stop.set()
        self.th.join(30)


def _is_prefix(a, b) -> bool:
    return all(x == y[:len(x)] for x, y in zip(a, b))


def test_pipelined_server_answers_what_the_unpipelined_server_answers(tmp_path):
    ref, pip = _Served(overlap=False), _Served(overlap=True)
    try:
        assert ref.server.worker.engine.config.async_decode is False
        assert pip.server.worker.engine.config.async_decode is True
        truth = ref.answers()
        assert pip.answers() == truth
        assert pip.pipelined_steps() > 0 and ref.pipelined_steps() == 0

        # a disk update (the same weights, a new version) that aborts the requests in flight
        ckpt = tmp_path / "ckpt"
        pip.server.worker.engine.model.save_pretrained(ckpt)
        with cf.ThreadPoolExecutor(len(REQS)) as ex:
            futs = [ex.submit(call, pip.addr, "/generate", r) for r in REQS]
            time.sleep(0.2)
            code, _, obj = call(pip.addr, "/update_weights_from_disk",
                                {"model_path": str(ckpt), "abort_all_requests": True})
            assert code == 200 and obj.get("success") is True, obj
            cut = [f.result(timeout=300) for f in futs]
        for res, full in zip(cut, truth):
            got = bits(res)
            reason = res[2]["meta_info"]["finish_reason"]["type"]
            assert reason in ("length", "abort") and _is_prefix(got, full), (reason, got)
            assert reason == "abort" or got == full
        wait_idle(pip.addr)
        assert pip.answers() == truth     # same weights after the update: the same bits
    finally:
        ref.close()
        pip.close()
