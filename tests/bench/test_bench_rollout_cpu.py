"""bench/bench_rollout.py end to end on the CPU (our engine's arms and the parity step, tiny model): the driver,
the repeats, staggered arrivals and the trainer comparison the GPU runs rely on. One bench run serves every test."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_rollout.py"), "--out", str(out),
                        "--model", "tiny-qwen2", "--arms", "engine", "engine_async", "parity",
                        "--workloads", "2x8x4", "4x9x6", "4x9x6@1", "--repeats", "2"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out, json.load(open(out / "rollout.json"))


def test_engine_arm_and_parity_on_cpu(rollout):
    out, res = rollout
    rows = res["arms"]["engine"]["workloads"]
    assert set(rows) == {"B2_8to4", "B4_9to6", "B4_9to6_arr1"}
    for name, row in rows.items():
        assert len(row["seconds_per_repeat"]) == 2 and row["all_full_length"] and row["prompts_match"]
        assert row["seconds"] in row["seconds_per_repeat"]
    assert set(res["arms"]["engine_async"]["workloads"]) == set(rows)
    for arm in ("engine", "engine_async"):
        par = res["parity"][arm]
        assert par["B2_8to4"]["n_tokens"] == 8 and par["B4_9to6"]["n_tokens"] == par["B4_9to6_arr1"]["n_tokens"] == 24
        assert all(v["n_mismatch"] == 0 for v in par.values())
    assert not any(f.endswith("_outputs.pt") for f in os.listdir(out))     # raw generations removed


def test_staggered_arrivals_give_the_same_bits_on_cpu(rollout):
    """``BxPROMPTxNEW@K`` admits K requests per engine step (steps mix prefill and decode) with the prompts and
    seeds of the all-at-once row: our engine's outputs are the same bits whichever way they arrive and whether
    decode is pipelined (the rows' digests against the unpipelined all-at-once row)."""
    _, res = rollout
    ref = res["arms"]["engine"]["workloads"]["B4_9to6"]["outputs_sha1"]
    for arm in ("engine", "engine_async"):
        rows = res["arms"][arm]["workloads"]
        assert rows["B4_9to6_arr1"]["arrivals_per_step"] == 1 and rows["B4_9to6"]["arrivals_per_step"] == 0
        assert rows["B4_9to6"]["outputs_sha1"] == ref and rows["B4_9to6_arr1"]["outputs_sha1"] == ref, arm
    assert res["arms"]["engine"]["workloads"]["B2_8to4"]["outputs_sha1"] != ref   # the digest sees the outputs


def test_work_folder_keeps_one_models_arms(tmp_path):
    """Arms gathered over several invocations come from one model: a run of another model (or checkpoint folder)
    in the same work folder removes the earlier arms' files instead of reporting them beside its own."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_rollout as br
    from types import SimpleNamespace
    work = tmp_path / "w"
    work.mkdir()
    first = SimpleNamespace(work=str(work), model="qwen2.5-1.5b", model_dir=str(tmp_path / "m15"))
    br._claim_work_folder(first)
    for f in ("tik.json", "tik_pw.json", "parity.json", "tik_outputs.pt", "notes.txt"):
        (work / f).write_text("{}")
    br._claim_work_folder(first)                                  # the same model again: everything kept
    assert {"tik.json", "tik_pw.json", "parity.json"} <= set(os.listdir(work))
    br._claim_work_folder(SimpleNamespace(work=str(work), model="qwen2.5-7b", model_dir=str(tmp_path / "m7")))
    assert sorted(os.listdir(work)) == ["notes.txt", "work_model.json"]
    assert json.load(open(work / "work_model.json"))["model"] == "qwen2.5-7b"


@pytest.fixture
def generator_calls(monkeypatch):
    """bench_rollout with every engine replaced by a recorder: the list of keyword sets ``_generator`` built."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_rollout as br
    from areal_tik.areal import engines
    calls = []

    class Fake:
        def need(self, what):
            return lambda model_dir, **kw: calls.append(kw) or object()
    monkeypatch.setattr(engines, "get", lambda name: Fake())
    return br, calls


def test_stock_arms_on_vllm_dummy_weights(generator_calls):
    """--stock-weights dummy: stock vLLM arms get load_format=dummy and no preset (speed only); vLLM + tik and our
    engine keep building the preset (the trainer's weights, for parity); the default builds the preset everywhere."""
    br, calls = generator_calls
    for arm in ("stock", "stock_nolp", "tik", "engine_async"):
        br._generator(arm, "/m", 128, weights_preset="qwen3-30b-a3b", stock_weights="dummy")
    dummy = [c.get("load_format") == "dummy" and "weights_preset" not in c for c in calls]
    assert dummy == [True, True, False, False]
    assert all(c["weights_preset"] == "qwen3-30b-a3b" for c in calls[2:])
    br._generator("stock", "/m", 128, weights_preset="qwen3-30b-a3b")
    assert calls[-1]["weights_preset"] == "qwen3-30b-a3b" and "load_format" not in calls[-1]


def test_engine_memory_reaches_our_engine_arms_only(generator_calls):
    """--engine-memory replaces our engine arms' KV share (the wiring's 0.5); vLLM arms keep their own settings."""
    br, calls = generator_calls
    for arm in ("engine", "engine_async", "stock", "tik"):
        br._generator(arm, "/m", 128, weights_preset="qwen3-30b-a3b", engine_memory=0.8)
    assert [c.get("gpu_memory_utilization") for c in calls] == [0.8, 0.8, None, None]
    br._generator("engine_async", "/m", 128, weights_preset="qwen3-30b-a3b")
    assert calls[-1]["gpu_memory_utilization"] == br.ARM_WIRING["engine_async"][2]["gpu_memory_utilization"]


def test_failed_arm_keeps_its_reason(tmp_path):
    """An arm whose process fails leaves why in rollout.json (its last lines beside its rc) and its whole output in
    the work folder's <arm>.log. Here: a vLLM arm where vLLM is not installed."""
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: this failure needs a machine without it")
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_rollout.py"), "--out", str(out),
                        "--work", str(work), "--model", "tiny-qwen2", "--arms", "stock", "--workloads", "2x8x4",
                        "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    step = json.load(open(out / "rollout.json"))["steps"]["stock"]
    assert step["rc"] == 1 and "stock" not in json.load(open(out / "rollout.json"))["arms"]
    assert "No module named 'vllm'" in step["output_tail"][-1]
    assert "No module named 'vllm'" in (work / "stock.log").read_text()
    assert "No module named 'vllm'" in r.stdout          # still shown on the console as it happens


def test_timed_out_arm_is_killed_with_its_children(tmp_path):
    """An arm past its timeout is killed (its process group) and reported as "timeout" with its last lines; the
    driver goes on and writes rollout.json (here an engine arm given one second)."""
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_rollout.py"), "--out", str(out),
                        "--work", str(work), "--model", "tiny-qwen2", "--arms", "engine", "--workloads", "2x8x4",
                        "--repeats", "1", "--arm-timeout", "1"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.load(open(out / "rollout.json"))
    assert res["steps"]["engine"]["rc"] == "timeout" and "engine" not in res["arms"]
    assert isinstance(res["steps"]["engine"]["output_tail"], list)
    assert "arm engine rc timeout" in r.stdout
