"""bench/harness.py and bench/collect_results.py on the CPU: rows reach one data file per GPU kind without
duplicates, and filing a run keeps its summaries, JSON, CSV and figures but none of its raw logs or databases."""
import csv
import json
import os
import sys
import tarfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import harness  # noqa: E402


def test_gpu_slug():
    assert harness.gpu_slug("NVIDIA H200") == "h200"
    assert harness.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert harness.gpu_slug("cpu") == "cpu"


def test_quantiles_of_samples():
    t = harness._quantiles([5.0, 1.0, 3.0, 2.0, 4.0], "events")
    assert (t.p20, t.p50, t.p80, t.ms) == (pytest.approx(1.8), 3.0, pytest.approx(4.2), 3.0)


def test_rows_are_filed_once_per_gpu_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    rec = harness.Recorder("bench_x", str(tmp_path / "out"))
    rec.add("decode B=1 ctx=128", "cuda", "time", harness.Timing(1.0, 2.0, 3.0, "events"), "ms")
    rec.add("decode B=1 ctx=128", "sdpa", "time", 2.5, "ms")
    path = rec.write()
    rows = list(csv.DictReader(open(path)))
    assert [r["provider"] for r in rows] == ["cuda", "sdpa"]
    assert rows[0]["p20"] == "1.0" and rows[0]["p80"] == "3.0" and rows[1]["p20"] == ""
    assert rows[0]["commit"] == "abc1234" and rows[0]["bench"] == "bench_x" and rows[0]["gpu"] == rec.env["gpu"]
    data = tmp_path / "data"
    added = harness.file_rows(path, str(data))
    target = str(data / (harness.gpu_slug(rec.env["gpu"]) + ".csv"))
    assert added == {target: 2}
    assert harness.file_rows(path, str(data)) == {target: 0}  # filing the same run twice adds nothing
    assert len(list(csv.DictReader(open(target)))) == 2


def test_collect_results_keeps_summaries_not_raw_files(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import collect_results
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    stage = tmp_path / "stage"
    (stage / "sub").mkdir(parents=True)
    (stage / "run_meta.json").write_text(json.dumps({"commit": "abc1234"}))
    (stage / "sub" / "result.json").write_text("{}")
    (stage / "summary.md").write_text("# summary\n")
    for raw in ("gpu_tests.log", "agent.sqlite", "probe.diff", "sub/train.log"):
        (stage / raw).write_text("raw")
    rec = harness.Recorder("bench_x", str(stage))
    rec.add("case", "tik", "time", 1.0, "ms")
    rec.write()
    files_at = tmp_path / "files_at"
    files_at.mkdir()
    with tarfile.open(files_at / "results.tgz", "w:gz") as t:
        t.add(stage, arcname=".")
    (files_at / "loose.json").write_text("{}")
    results, data = tmp_path / "results", tmp_path / "data"
    assert collect_results.main([str(files_at), "--command", "bash bench/gpu_check.sh x", "--label", "t",
                                 "--results-dir", str(results), "--data-dir", str(data)]) == 0
    (run,) = os.listdir(results)
    assert run.endswith("_abc1234_t")
    kept = sorted(os.path.relpath(os.path.join(r, f), results / run) for r, _, fs in os.walk(results / run) for f in fs)
    assert kept == ["COMMAND.md", "loose.json", "rows.csv", "run_meta.json", "sub/result.json", "summary.md"]
    assert "bash bench/gpu_check.sh x" in (results / run / "COMMAND.md").read_text()
    assert len(os.listdir(data)) == 1


def test_cudagraph_timing_waits_for_the_callers_inputs(monkeypatch):
    """triton's do_bench_cudagraph calls fn on a fresh stream that does not wait for the current one: time_ms must
    synchronize first, or fn may read inputs the caller has not finished writing (a faulting paged-attention
    probe on the H200 read half-written block tables this way)."""
    import contextlib

    import torch
    import triton.testing as tt
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def fake_bench(fn, rep, quantiles):
        calls.append("bench")
        return [1.0] * len(quantiles)
    monkeypatch.setattr(tt, "do_bench_cudagraph", fake_bench)
    t = harness.time_ms(lambda: None, "cudagraph", rep_ms=5)
    assert calls == ["synchronize", "bench"] and t.p50 == 1.0
