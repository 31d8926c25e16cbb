"""bench/tune_linear.merge_winners: a measured winner replaces only its own M bucket of a tuned table, and the result
still parses as a table (bench/probes/probe_decode_linear.py writes tables this way)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from areal_tik.kernels.linear import selection  # noqa: E402
from bench.tune_linear import merge_winners, same_bits_as_incumbent, set_bucket  # noqa: E402


def test_set_bucket_splits_replaces_and_merges():
    b = [[8, "a"], [128, "b"], [None, "c"]]
    assert set_bucket(b, 64, "x") == [[8, "a"], [64, "x"], [128, "b"], [None, "c"]]   # split inside a bucket
    assert set_bucket(b, 128, "x") == [[8, "a"], [128, "x"], [None, "c"]]              # replace at its bound
    assert set_bucket(b, 128, "c") == [[8, "a"], [None, "c"]]                           # merge with the next one
    assert set_bucket(b, 4, "a") == b                                                   # same config: unchanged
    assert set_bucket(b, 9999, "x") == [[8, "a"], [128, "b"], [9999, "x"], [None, "c"]]
    assert b == [[8, "a"], [128, "b"], [None, "c"]]                                     # input untouched


def test_merge_winners_keeps_other_rules_and_parses():
    table = json.load(open(selection.TUNED_TABLE_PATH))
    rules = table["archs"]["sm_90"]["rules"]
    N, K = rules[0]["N"], rules[0]["K"]
    merged = merge_winners(table, "sm_90", {(N, K, 64): "dec64_n16_s8", (12345, 64, 16): "dec16_n16"}, by="test")
    parsed = selection.parse_tuned_table(json.dumps(merged))["sm_90"]
    assert selection.tuned_config_name(64, N, K, "sm_90", {"sm_90": parsed}) == "dec64_n16_s8"
    before = selection.parse_tuned_table(json.dumps(table))["sm_90"]
    for M in (1, 65, 100000):  # the other buckets of that rule keep their configs
        if M > 64:
            assert selection.tuned_config_name(M, N, K, "sm_90", {"sm_90": parsed}) == \
                selection.tuned_config_name(M, N, K, "sm_90", {"sm_90": before})
    for r in rules[1:]:        # the other rules are unchanged
        assert parsed[(r["N"], r["K"])] == before[(r["N"], r["K"])]
    assert selection.tuned_config_name(16, 12345, 64, "sm_90", {"sm_90": parsed}) == "dec16_n16"
    assert json.load(open(selection.TUNED_TABLE_PATH)) == table   # the table on disk is not touched
    assert merged["archs"]["sm_90"]["merged"][-2:] == [
        dict(N=N, K=K, M=64, config="dec64_n16_s8", by="test"), dict(N=12345, K=64, M=16, config="dec16_n16", by="test")]


def test_merge_winners_rejects_unknown_config_on_parse():
    table = json.load(open(selection.TUNED_TABLE_PATH))
    r = table["archs"]["sm_90"]["rules"][0]
    merged = merge_winners(table, "sm_90", {(r["N"], r["K"], 64): "no_such_config"}, by="test")
    with pytest.raises(ValueError, match="unknown config"):
        selection.parse_tuned_table(json.dumps(merged))


def test_same_bits_as_incumbent_checks_whole_output_and_row_subsets():
    """The tuners' bit check (interpreter here): a config equal to the incumbent passes; a reference off by one bit
    in the whole output, or in a row the subset launches recompute, fails."""
    import torch
    from areal_tik.kernels import linear as L
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(40, 64, generator=g) * 0.125).to(torch.bfloat16)
    ref = L.linear_fwd(x, w, config="dec16_n16")
    assert same_bits_as_incumbent(x, w, ref, "dec64_n16_s8")
    for row in (0, 3, 5):   # row 0: the one-row launch; 3: only the whole output; 5: the last-3-rows launch
        bad = ref.clone()
        bad.view(torch.int16)[row, 2] ^= 1
        assert not same_bits_as_incumbent(x, w, bad, "dec64_n16_s8"), row
