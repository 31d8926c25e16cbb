"""Two ``areal-tik ab`` runs of the tiny recipe at once on one machine (slow: ~5 min on 2 busy cores).

Both must succeed with their own working folders: AReaL's fileroot and name_resolve records under each
report folder (a shared name_resolve tree lets one run clear or read the other's records: the same
experiment and trial names), and a warm start neither had yet trained once between them (a file lock
in the cache both use) and loaded by every arm of both."""
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

pytestmark = [pytest.mark.areal, pytest.mark.slow]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
LIMIT_S = 1200


def test_two_ab_runs_at_once_both_succeed(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT")}
    env.update(XDG_CACHE_HOME=str(cache), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    # a warm start of its own (few steps): this test's cache starts empty, so both runs race to make it
    spec = "actor.path='warmstart:tiny-qwen2?task=add1&steps=30&batch=32&lr=0.003'"
    extra = os.environ.get("AB_CONCURRENT_EXTRA", "").split()   # e.g. a shared name_resolve root (negative control)
    procs = {}
    t0 = time.monotonic()
    for name in ("one", "two"):
        cmd = [sys.executable, "-m", "areal_tik.cli", "ab", "--config", RECIPE, "--steps", "3", "--out",
               str(tmp_path / name), "--progress", "plain", spec, *extra]
        procs[name] = subprocess.Popen(cmd, stdout=open(tmp_path / f"{name}.out", "w"),
                                       stderr=open(tmp_path / f"{name}.err", "w"), env=env, cwd=ROOT,
                                       start_new_session=True)
    try:
        rcs = {n: p.wait(timeout=max(1.0, LIMIT_S - (time.monotonic() - t0))) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)   # this test's run only (its own session)
    print(f"both done in {time.monotonic() - t0:.0f} s")
    for name in ("one", "two"):
        err = (tmp_path / f"{name}.err").read_text()
        assert rcs[name] == 0, f"{name}: exit {rcs[name]}\n{err[-3000:]}"
        rep = json.load(open(tmp_path / name / "report.json"))
        assert rep["n_steps"] == 3 and rep["arms"] == ["baseline", "tik"]
        assert rep["tik"]["audit_mismatch_tokens"] == 0 and rep["tik"]["steps_skipped"] == 2
        for arm in ("baseline", "tik"):
            log = (tmp_path / name / arm / "train.log").read_text()
            assert f"working folder {tmp_path / name / 'runs'}" in log
            assert os.path.isdir(tmp_path / name / "runs" / "name_resolve")
            assert f"model ready: {cache}/areal_tik/warmstart/tiny-qwen2-add1-" in log
    entries = [p for p in (cache / "areal_tik" / "warmstart").iterdir() if p.is_dir()]
    assert len(entries) == 1, entries             # trained once between the two runs
    trained = sum("warm start: training the model once" in (tmp_path / f"{n}.err").read_text() for n in procs)
    assert trained == 1
