"""The rollout server's edge checks, without a server: every body either parses into values
the engine accepts, or is refused with a status and a one-line reason."""
from __future__ import annotations

import math
import os
import sys

import pytest
from hypothesis import given, settings

from areal_tik.engine.server.request_validation import (Limits, RequestError, parse_abort, parse_disk_update,
                                                 parse_distributed_update, parse_generate, parse_group_init)
from areal_tik.engine.sequence import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
import hostile  # noqa: E402  (tests/engine/hostile.py: hypothesis strategies)

LIM = Limits(vocab_size=100, max_model_len=16)


def test_areal_requests_parse_unchanged():
    """What AReaL's client sends (generation and scoring requests) goes through as before."""
    body = {"input_ids": [1, 2, 3], "image_data": None, "return_logprob": True, "stream": False,
            "sampling_params": {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 8, "temperature": 1.0,
                                "stop_token_ids": [2, None], "ignore_eos": False, "skip_special_tokens": True,
                                "frequency_penalty": 0.0}}
    r = parse_generate(body, LIM)
    assert r.input_ids == [1, 2, 3] and r.rid is None and r.return_logprob and not r.want_input_logprobs
    assert r.sampling == dict(temperature=1.0, top_p=1.0, top_k=100000000, max_new_tokens=8, stop_token_ids=[2],
                              ignore_eos=False, seed=None)
    score = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
             "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 0, "stream": False}
    r = parse_generate(score, LIM)
    assert r.want_input_logprobs and r.logprob_start_len == 2 and r.sampling["temperature"] == 0.0
    assert parse_group_init({"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1,
                             "world_size": 2, "backend": "gloo", "group_name": "g"})["master_port"] == 29500
    assert parse_disk_update({"model_path": "/ckpt", "abort_all_requests": True}) == ("/ckpt", True)
    assert parse_abort({"abort_all": True}) == (True, None) and parse_abort({"rid": "r1"}) == (False, "r1")
    d = parse_distributed_update({"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g"})
    assert d["names"] == ["w"] and d["group_name"] == "g" and d["abort"] is False


@pytest.mark.parametrize("body,why", [
    ({"input_ids": [1, 100]}, "vocabulary"), ({"input_ids": [1] * 16}, "context length"),
    ({"input_ids": [1.0]}, "integer"), ({"input_ids": [False]}, "integer"),
    ({"input_ids": [1], "sampling_params": {"temperature": math.nan}}, "finite"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": "7"}}, "integer"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "n other than 1"),
    ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "constrained"),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 2}}, "min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": 10 ** 400}}, "finite"),
    ({"input_ids": [10 ** 4000]}, "<huge> is outside"), ({"input_ids": [1] * 10 ** 6}, "context length"),
    ({"input_ids": [1], "rid": "r" * 10 ** 5}, "at most 512"),
])
def test_refusals_name_the_field(body, why):
    with pytest.raises(RequestError) as ei:
        parse_generate(body, LIM)
    msg = ei.value.message
    assert ei.value.status == 400 and why in msg and "\n" not in msg and len(msg) < 300, msg


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(body=hostile.generate_bodies(100, 16))
def test_fuzzed_bodies_parse_to_engine_ready_values_or_a_one_line_400(body):
    try:
        r = parse_generate(body, LIM)
    except RequestError as e:
        assert e.status == 400 and e.message and "\n" not in e.message
        return
    assert 1 <= len(r.input_ids) < LIM.max_model_len
    assert all(type(t) is int and 0 <= t < LIM.vocab_size for t in r.input_ids)
    sp = SamplingParams(**r.sampling)  # the engine's own checks accept what the edge let through
    assert math.isfinite(sp.temperature) and 0 < sp.top_p <= 1 and sp.max_new_tokens >= 0
    assert sp.seed is None or 0 <= sp.seed < 2 ** 64
    assert r.rid is None or (isinstance(r.rid, str) and r.rid)
    assert r.logprob_start_len is None or -1 <= r.logprob_start_len <= len(r.input_ids)


def test_sampling_params_refuse_what_the_engine_cannot_sample():
    for kw in ({"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}, {"seed": 1.5},
               {"seed": "1"}, {"max_new_tokens": 2.0}, {"top_k": True}, {"stop_token_ids": [1.5]}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


AREAL_SAMPLING = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 8, "temperature": 1.0,
                  "stop_token_ids": [2, None], "ignore_eos": False, "skip_special_tokens": True,
                  "frequency_penalty": 0.0}


@pytest.mark.parametrize("key,value,why", [
    ("min_p", 0.05, "sampling_params.min_p is not supported"),
    ("logit_bias", {"5": 10.0}, "sampling_params.logit_bias is not supported"),
    ("presence_penalty", 0.3, "presence_penalty"), ("repetition_penalty", 1.2, "repetition_penalty"),
    ("custom_params", {"x": 1}, "custom_params"), ("min_tokens", 3, "min_tokens is not a key"),
    ("temperture", 0.5, "temperture is not a key"), ("top_a", 0.1, "top_a is not a key"),
])
def test_sampling_keys_that_would_change_the_distribution_are_refused(key, value, why):
    """A sampling key the server does not implement is a one-line 400, not silently ignored, also
    next to everything AReaL's client sends."""
    with pytest.raises(RequestError) as ei:
        parse_generate({"input_ids": [1], "sampling_params": {**AREAL_SAMPLING, key: value}}, LIM)
    assert ei.value.status == 400 and why in ei.value.message and "\n" not in ei.value.message, ei.value.message


def test_neutral_values_and_every_key_areal_sends_are_accepted():
    neutral = {"min_p": 0.0, "logit_bias": {}, "presence_penalty": 0, "repetition_penalty": 1.0, "n": 1,
               "min_new_tokens": 0, "stop": [], "regex": None, "custom_params": None, "no_stop_trim": True,
               "spaces_between_special_tokens": False, "seed": 4}
    r = parse_generate({"input_ids": [1], "sampling_params": {**AREAL_SAMPLING, **neutral}}, LIM)
    assert r.sampling == dict(temperature=1.0, top_p=1.0, top_k=100000000, max_new_tokens=8, stop_token_ids=[2],
                              ignore_eos=False, seed=4)
    r = parse_generate({"input_ids": [1], "sampling_params": {**AREAL_SAMPLING, "logit_bias": None}}, LIM)
    assert r.sampling["seed"] is None


def test_the_documented_key_table_is_the_one_the_server_applies():
    """docs/interfaces.md lists every sampling key the server accepts, as request_validation does."""
    import re

    from areal_tik.engine.server.request_validation import SAMPLING_KEYS
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "interfaces.md")).read()
    rows = dict((m.group(1), (m.group(2), m.group(3).strip()))
                for m in re.finditer(r"^\| `(\w+)` \| ([\w ]+) \| (.*)\|$", doc, flags=re.M))
    assert rows == SAMPLING_KEYS
