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


def test_serve_seed_seeds_the_requests_without_their_own_seed():
    """``serve --seed`` reaches the engine: a request without ``sampling_seed`` draws its seed from it
    (two seeds, two different generations of the same unseeded request on the same weights), and a
    preset's random weights are seeded with it."""
    from areal_tik.engine import SamplingParams
    from areal_tik.layers.weights_digest import model_digest

    def engine(seed):
        server = build(ServerConfig(model="tiny-qwen2", max_running_requests=2, context_length=64, precompile=False,
                                    seed=seed), device="cpu")
        return server.worker.engine

    a, b = engine(7), engine(8)
    assert a.config.seed == 7 and b.config.seed == 8
    assert model_digest(a.model) != model_digest(b.model)
    b.model.load_state_dict(a.model.state_dict())  # the same weights: only the drawn seeds differ
    assert model_digest(a.model) == model_digest(b.model)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    assert a.generate([[3, 4, 5]], sp)[0].output_ids != b.generate([[3, 4, 5]], sp)[0].output_ids
