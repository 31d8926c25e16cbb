"""What the person waiting on ``areal-tik ab`` sees: each arm's clock from its own start, the start-up
phases its trainer stamps, plain lines when stderr is not a terminal, and, when an arm fails, the lines
that say why and where its log is (arm processes faked by small scripts; the runner is the real one)."""
import io
import json
import sys
import types

import pytest

from areal_tik.ab import runner as ab
from areal_tik.ab.arm_log import failure_excerpt, startup_phases
from areal_tik.ab.progress import ArmProgress, resolve_mode
from areal_tik.cli import ab as cli_ab
from areal_tik.cli import main

CFG = "recipes/tiny.yaml"


def _script(log, steps, fail=False):
    """An arm process: stamps two start-up phases, logs ``steps`` steps, then exits (or raises)."""
    row = json.dumps({"global_step": 0, "wall_s": 1.0, "stats": {}, "tik": [{"gen_tokens": 4}]})
    body = ["import sys, time",
            "print('areal-tik startup: model dir ready at +0.1 s', file=sys.stderr, flush=True)",
            "time.sleep(0.6)",
            "print('areal-tik startup: rollout server up at 127.0.0.1:1 at +0.7 s', file=sys.stderr, flush=True)",
            "time.sleep(0.6)",
            f"f = open({str(log)!r}, 'a')"]
    body += [f"f.write({row!r} + '\\n'); f.flush(); time.sleep(0.6)"] * steps
    if fail:
        body += ["print('INFO a line of noise', flush=True)",
                 "def load(): raise ValueError('the data set has no prompts (train_dataset.path)')",
                 "load()"]
    return [sys.executable, "-c", "\n".join(body)]


def test_plain_progress_clocks_each_arm_from_its_own_start(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("areal_tik.ab.progress.time.perf_counter", lambda: now[0])
    out = io.StringIO()
    with ArmProgress({"baseline": 2, "tik": 2}, "plain", stream=out) as p:
        p.start("baseline")
        now[0] = 150.0
        p.step("baseline", 1)
        p.end("baseline")
        p.start("tik")
        now[0] = 190.0
        p.phase("tik", "model dir ready")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[ab] baseline +   0.0 s  started (arm 1 of 2, 2 steps)")
    assert lines[1] == "[ab] baseline +  50.0 s  step 0 (warm-up) done: 1/2 steps"
    assert lines[3].startswith("[ab] tik      +   0.0 s  started (arm 2 of 2")      # not +50 s: its own clock
    assert lines[4] == "[ab] tik      +  40.0 s  model dir ready"
    assert resolve_mode("auto", io.StringIO()) == "plain"                           # not a terminal


def test_run_arm_reports_startup_phases_and_steps(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(ab, "_arm_cmd", lambda *a, **k: _script(out / "tik" / "steps.jsonl", 2))
    events = []
    res = ab.run_arm(CFG, "tik", 2, str(out), runs_dir=str(tmp_path / "runs"), timeout=60,
                     on_step=lambda a, n: events.append(("step", n)), on_phase=lambda a, t: events.append(("phase", t)))
    assert len(res["steps"]) == 2
    assert [e for e in events if e[0] == "phase"] == [("phase", "model dir ready"),
                                                      ("phase", "rollout server up at 127.0.0.1:1")]
    assert events.index(("phase", "rollout server up at 127.0.0.1:1")) < events.index(("step", 1))


def test_failed_arm_names_its_reason_and_its_log(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr(ab, "_arm_cmd", lambda *a, **k: _script(out / "baseline" / "steps.jsonl", 0, fail=True))
    monkeypatch.setattr(cli_ab, "check_composed", lambda args: types.SimpleNamespace(
        actor=types.SimpleNamespace(path="preset:tiny-qwen2")))
    rc = main(["ab", "--config", CFG, "--out", str(out), "--progress", "plain", "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 1
    log = out / "baseline" / "train.log"
    assert ("areal-tik ab: the baseline arm failed (exit 1): ValueError: the data set has no prompts "
            "(train_dataset.path)") in err
    assert '", line 8, in load' in err and err.count("ValueError: the data set") == 2   # the message, the excerpt and f"(full log: {log})" in err and "a line of noise" not in err
    assert "[ab] baseline" in err and "failed" in err.splitlines()[-4]


def test_failure_excerpt_and_phases_from_a_real_looking_log():
    text = ("\x1b[33mWARNING something\x1b[0m\nareal-tik startup: model dir ready at +0.4 s\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    raise X\n"
            "hydra.errors.ConfigCompositionException: Could not override 'a.b'.\nTo append use +a.b=1\n\n"
            "INFO teardown\n")
    assert failure_excerpt(text) == ['  File "x.py", line 3, in f', "    raise X",
                                     "hydra.errors.ConfigCompositionException: Could not override 'a.b'.",
                                     "To append use +a.b=1"]
    assert startup_phases(text) == ["model dir ready"]
    assert failure_excerpt("a\n\nb\nc\n", max_lines=2) == ["b", "c"]     # no exception: the last lines


@pytest.mark.parametrize("mode", ["bar", "none"])
def test_other_modes_run_the_same_calls(mode):
    out = io.StringIO()
    with ArmProgress({"tik": 1}, mode, stream=out) as p:
        p.start("tik")
        p.phase("tik", "model dir ready")
        p.step("tik", 1)
        p.end("tik")
    assert (out.getvalue() == "") == (mode == "none")
