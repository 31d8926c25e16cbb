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
