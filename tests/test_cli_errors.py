"""``areal-tik`` user errors: one clear line on stderr and exit status 2, before anything slow
starts; the traceback only with ``--debug``."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from areal_tik.cli import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")


@pytest.fixture
def no_work(monkeypatch):
    """Make every slow entry point fail loudly: a user error must be caught before them."""
    def boom(*a, **k):
        raise AssertionError("started work despite a bad argument")
    import areal_tik.areal.warmstart as ws
    import areal_tik.ab.runner as ab
    import areal_tik.verify.parity as parity
    import areal_tik.verify.request as request
    import areal_tik.engine.server as server
    import areal_tik.layers.models as models
    for mod, name in ((ab, "run_ab"), (models, "build_model"), (server, "build"), (parity, "run_parity"),
                      (request, "verify_ours"), (ws, "warm_start")):
        monkeypatch.setattr(mod, name, boom)


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


CASES = [
    (["ab", "--config", RECIPE, "--steps", "0"], "--steps"),
    (["ab", "--config", "no/such.yaml"], "no such file"),
    (["ab", "--config", RECIPE, "--arms", "tik"], "--out"),
    (["ab", "--config", RECIPE, "--timeout", "-5"], "--timeout"),
    (["ab", "--config", RECIPE, "--set", "vllm,sglang"], "sglang"),
    (["ab", "--config", RECIPE, "--set", "vllm,tik", "--arms", "baseline", "--out", "/tmp/x"], "outside --set"),
    (["ab", "--config", RECIPE, "--set", "vllm,tik", "--arms", "vllm"], "--out"),
    (["verify", "--regimes", "R9"], "R9"),
    (["verify", "--regimes", ","], "--regimes"),
    (["verify", "--prompts", "0"], "--prompts"),
    (["verify", "--min-prompt-len", "9", "--max-prompt-len", "3"], "--max-prompt-len"),
    (["verify", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["verify", "--max-prompt-len", "1000", "--max-new-tokens", "100"], "positions"),
    (["verify", "--model", "gpt-17"], "preset"),
    (["verify", "--dtype", "int8"], "--dtype"),
    (["verify", "--device", "tpu"], "--device"),
    (["serve", "--model", "nope"], "preset"),
    (["serve", "--model", "tiny-qwen2", "--port", "0"], "--port"),
    (["serve", "--model", "tiny-qwen2", "--port", "70000"], "--port"),
    (["serve", "--model", "tiny-qwen2", "--mem-fraction", "1.5"], "--mem-fraction"),
    (["serve", "--model", "tiny-qwen2", "--max-running-requests", "0"], "--max-running-requests"),
    (["serve", "--model", "tiny-qwen2", "--context-length", "1"], "--context-length"),
    (["serve", "--model", ROOT], "config.json"),
    (["warmstart", "--model", "tiny-qwen2", "--out", "x", "--steps", "0"], "--steps"),
    (["warmstart", "--model", "tiny-qwen2", "--out", "x", "--task", "div"], "--task"),
    (["warmstart", "--model", "tiny-qwen2", "--out", "x", "--lr", "nan"], "--lr"),
    (["train", "--config", "no/such.yaml"], "no such file"),
    (["agent", "status", "--db", "no/such.sqlite"], "--db"),
]


@pytest.mark.parametrize("argv,why", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_user_errors_are_one_line_and_exit_2(argv, why, no_work, capsys):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith(f"areal-tik {argv[0]}: error: ") and why in err[0], err


def test_port_in_use_is_a_user_error(no_work, capsys):
    s = _busy_port()
    try:
        rc = main(["serve", "--model", "tiny-qwen2", "--port", str(s.getsockname()[1])])
    finally:
        s.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "in use" in err[0], err


def test_debug_adds_the_traceback_and_other_failures_are_one_line_exit_1(monkeypatch, capsys):
    assert main(["verify", "--prompts", "0", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("areal-tik verify: error: --prompts")
    import areal_tik.cli.env as env

    def broken(args):
        raise RuntimeError("disk on fire\nsecond line")
    monkeypatch.setattr(env, "collect", lambda: broken(None))
    assert main(["env", "--json"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["areal-tik env: RuntimeError: disk on fire (run with --debug for the traceback)"]


def test_console_entry_point_prints_no_traceback():
    p = subprocess.run([sys.executable, "-m", "areal_tik.cli", "verify", "--regimes", "R1,R9"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["areal-tik verify: error: --regimes: unknown 'R9'; choose from R1, R2, "
                                             "R3, R4, R5"]


def test_verify_vllm_json_sends_vllm_logging_to_stderr(no_work, monkeypatch, capsys):
    """With --json, stdout must hold the JSON document alone: vLLM's log lines (stdout by default) are sent to
    stderr before vLLM is imported; without --json the user's setting is left alone."""
    from areal_tik import vllm_plugin
    monkeypatch.setattr(vllm_plugin, "available", lambda: (False, "vLLM is not installed (test)"))
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "unset below")   # monkeypatch restores the caller's value after
    monkeypatch.delenv("VLLM_LOGGING_STREAM")
    assert main(["verify", "--engine", "vllm"]) == 2
    assert "VLLM_LOGGING_STREAM" not in os.environ
    assert main(["verify", "--engine", "vllm", "--json"]) == 2
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")   # an explicit choice is kept
    assert main(["verify", "--engine", "vllm", "--json"]) == 2
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stdout"
    assert "vLLM is not installed (test)" in capsys.readouterr().err
