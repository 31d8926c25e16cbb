"""bench/bench_rollout.py end to end on the CPU (our engine's arm and the parity step, tiny model): the driver,
the repeats and the trainer comparison the GPU runs rely on."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_arm_and_parity_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_rollout.py"), "--out", str(tmp_path),
                        "--model", "tiny-qwen2", "--arms", "engine", "engine_async", "parity", "--workloads", "2x8x4", "3x5x3",
                        "--repeats", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.load(open(tmp_path / "rollout.json"))
    rows = res["arms"]["engine"]["workloads"]
    assert set(rows) == {"B2_8to4", "B3_5to3"}
    for name, row in rows.items():
        assert len(row["seconds_per_repeat"]) == 2 and row["all_full_length"] and row["prompts_match"]
        assert row["seconds"] in row["seconds_per_repeat"]
    assert set(res["arms"]["engine_async"]["workloads"]) == {"B2_8to4", "B3_5to3"}
    for arm in ("engine", "engine_async"):
        par = res["parity"][arm]
        assert par["B2_8to4"]["n_tokens"] == 8 and par["B3_5to3"]["n_tokens"] == 9
        assert all(v["n_mismatch"] == 0 for v in par.values())
    assert not any(f.endswith("_outputs.pt") for f in os.listdir(tmp_path))     # raw generations removed


def test_staggered_arrivals_give_the_same_bits_on_cpu(tmp_path):
    """``BxPROMPTxNEW@K`` admits K requests per engine step (steps mix prefill and decode); the prompts and seeds are
    those of the all-at-once row, so our engine's outputs must be the same bits (the rows' digests), unpipelined
    and pipelined, and the trainer agrees with every token."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_rollout.py"), "--out", str(tmp_path),
                        "--model", "tiny-qwen2", "--arms", "engine", "engine_async", "parity",
                        "--workloads", "4x9x6", "4x9x6@1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.load(open(tmp_path / "rollout.json"))
    for arm in ("engine", "engine_async"):
        rows = res["arms"][arm]["workloads"]
        assert set(rows) == {"B4_9to6", "B4_9to6_arr1"}
        assert rows["B4_9to6_arr1"]["arrivals_per_step"] == 1 and rows["B4_9to6"]["arrivals_per_step"] == 0
        assert rows["B4_9to6"]["outputs_sha1"] == rows["B4_9to6_arr1"]["outputs_sha1"]
        assert all(v["n_mismatch"] == 0 and v["n_tokens"] == 24 for v in res["parity"][arm].values())
    assert res["arms"]["engine"]["workloads"]["B4_9to6"]["outputs_sha1"] == \
        res["arms"]["engine_async"]["workloads"]["B4_9to6"]["outputs_sha1"]
