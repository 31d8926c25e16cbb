"""`areal-tik serve` engine flags reach the engine the server builds (on and off)."""
import argparse

import pytest

from areal_tik.cli import serve
from areal_tik.engine.server import ServerConfig, build


@pytest.mark.parametrize("flag, field, engine_has_it", [
    ("--disable-radix-cache", "disable_radix_cache", lambda eng: not eng.block_manager.prefix_sharing),
    ("--disable-overlap-schedule", "disable_overlap_schedule", lambda eng: not eng.config.async_decode),
])
def test_serve_flag_reaches_the_engine(flag, field, engine_has_it):
    ap = argparse.ArgumentParser()
    serve.add_parser(ap.add_subparsers())
    assert getattr(ap.parse_args(["serve", "--model", "tiny-qwen2", flag]), field) is True
    assert getattr(ap.parse_args(["serve", "--model", "tiny-qwen2"]), field) is False
    for on in (False, True):
        server = build(ServerConfig(model="tiny-qwen2", max_running_requests=4, context_length=64, precompile=False,
                                    **{field: on}), device="cpu")
        assert engine_has_it(server.worker.engine) is on
