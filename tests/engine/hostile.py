"""Hypothesis strategies for hostile ``/generate`` bodies (a test helper, no tests here).

:func:`generate_bodies` draws a valid body (prompt in the vocabulary and under the context
length, 0-3 new tokens, valid optional sampling fields) and then replaces up to three of
its parts (the body, the prompt, one token, ``sampling_params``, any field) by hostile
values: NaN, infinities, huge or negative numbers, bools, strings, nested containers. Many
bodies stay valid (no part replaced), so the engine runs under the fuzzing too.
"""
from __future__ import annotations

import math

from hypothesis import strategies as st

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), c, max_size=3)),
                      max_leaves=8)
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 10 ** 30, -(10 ** 30), -1, 2 ** 64, 1e-300, 1.5, True,
                           False, "", "1", [], {}, [[]], None])
HOSTILE = st.one_of(SPECIAL, SCALARS, VALUES)

SP_FIELDS = {
    "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), st.floats(1e-3, 2.0)),
    "top_p": st.floats(0.05, 1.0), "top_k": st.integers(-1, 600), "sampling_seed": st.integers(0, 2 ** 63),
    "stop_token_ids": st.lists(st.integers(0, 100), max_size=2), "ignore_eos": st.booleans(),
    "frequency_penalty": st.just(0.0), "n": st.just(1),
}
TOP_FIELDS = {"return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 3), "stream": st.just(False),
              "rid": st.text(min_size=1, max_size=8), "logprob_start_len": st.integers(-1, 1)}


@st.composite
def generate_bodies(draw, vocab: int, max_len: int):
    """A /generate body for a server with ``vocab`` tokens and context length ``max_len``."""
    if draw(st.integers(0, 9)) == 9:
        return draw(VALUES)  # not even an object, most of the time
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=min(8, max_len - 1)))
    sp = {"max_new_tokens": draw(st.integers(0, 3))}
    sp.update({k: draw(s) for k, s in SP_FIELDS.items() if draw(st.booleans())})
    body = {"input_ids": ids, "sampling_params": sp}
    body.update({k: draw(s) for k, s in TOP_FIELDS.items() if draw(st.booleans())})
    for _ in range(draw(st.sampled_from([1, 0, 2, 1, 3]))):
        where = draw(st.sampled_from(["sp", "token", "top", "sp", "input_ids", "sp", "sampling_params", "top"]))
        bad = draw(HOSTILE)
        if where == "token" and isinstance(body.get("input_ids"), list) and body["input_ids"]:
            body["input_ids"][draw(st.integers(0, len(body["input_ids"]) - 1))] = bad
        elif where in ("sp", "top"):
            keys = list(SP_FIELDS) + ["max_new_tokens", "stop"] if where == "sp" else list(TOP_FIELDS) + ["image_data"]
            key = draw(st.sampled_from(keys))
            if key == "max_new_tokens" and bad is None:
                continue  # the default (128 tokens) is valid, just slow
            target = body["sampling_params"] if where == "sp" and isinstance(body.get("sampling_params"), dict) else body
            target[key] = bad
        elif where in ("input_ids", "sampling_params"):
            body[where] = bad
    return body
