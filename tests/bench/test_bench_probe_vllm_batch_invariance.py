"""bench/probes/probe_vllm_batch_invariance.py's comparison (the GPU part needs vLLM): tokens compared up to a
request's first differing token, log-probs bit for bit."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probes"))
from probe_vllm_batch_invariance import compare  # noqa: E402


def test_equal_requests_are_invariant():
    a = [([1], [5, 6, 7], [-1.0, -2.0, -3.0]), ([2], [8], [-0.5])]
    r = compare(a, [tuple(x) for x in a])
    assert r["invariant"] and r["tokens_compared"] == 4 and r["lp_mismatch_tokens"] == 0


def test_a_log_prob_one_ulp_off_and_a_divergent_token_are_counted():
    import numpy as np
    lp = float(np.float32(-2.0))
    off = float(np.nextafter(np.float32(-2.0), np.float32(0)))
    alone = [([1], [5, 6, 7], [-1.0, lp, -3.0]), ([2], [8, 9], [-0.5, -0.7])]
    batched = [([1], [5, 6, 7], [-1.0, off, -3.0]), ([2], [8, 4], [-0.5, -0.1])]
    r = compare(alone, batched)
    assert not r["invariant"] and r["lp_mismatch_tokens"] == 1 and r["divergent_requests"] == 1
    assert r["first_divergence"] == [1] and r["tokens_compared"] == 4 and 0 < r["max_abs_diff"] < 1e-6
