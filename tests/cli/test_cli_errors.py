"""``areal-tik`` user errors: one clear line on stderr and exit status 2, before anything slow
starts; the traceback only with ``--debug``."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from areal_tik.cli import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
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


# user errors of train, agent and serve that need files: "{tmp}" is a folder holding them (the `files` fixture)
FILE_CASES = [
    (["train", "--config", "{tmp}/notyaml.txt"], "is not a .yaml file"),
    (["train", "--config", "{tmp}/bad.yaml"], "is not valid YAML (line 2, column 1): expected"),
    (["train", "--config", "{tmp}/empty.yaml"], "holds no mapping"),
    (["train", "--config", "{tmp}/list.yaml"], "holds no mapping"),
    (["train", "--config", "{tmp}/minimal.yaml"], "trial_name"),
    (["train", "--config", RECIPE, "actor.kernel_backend=bogus"], "actor.kernel_backend"),
    (["train", "--config", RECIPE, "no_such_key=1"], "no_such_key"),
    (["train", "--config", RECIPE, "actor.optimizer.lr=abc"], "actor.optimizer.lr"),
    (["train", "--config", RECIPE, "=broken"], "override"),
    (["train", "--config", RECIPE, "actor.tik.backend=attention=fa3"], "override 'actor.tik.backend=attention=fa3'"),
    (["train", "--config", RECIPE, "actor.weight_update_mode=bogus"], "actor.weight_update_mode"),
    (["train", "--config", RECIPE, "actor.tik.mismatch_policy=bogus"], "actor.tik.mismatch_policy"),
    (["train", "--config", RECIPE, "actor.kernel_backend=tik", "actor.tik.backend=bogus"], "'bogus'"),
    (["agent", "init", "--db", "{tmp}/new.sqlite", "--op", "nope", "--timer", "simulated"], "--op 'nope'"),
    (["agent", "init", "--db", "{tmp}/new.sqlite", "--preset", "nope", "--timer", "simulated"], "--preset 'nope'"),
    (["agent", "run", "--db", "{tmp}/none.sqlite"], "--db"),
    (["agent", "run", "--db", "{tmp}/agent.sqlite", "--name", "nope"], "no run 'nope'"),
    (["agent", "run", "--db", "{tmp}/agent.sqlite", "--proposer", "replay", "--script", "{tmp}/bad.json"],
     "is not valid JSON"),
    (["agent", "run", "--db", "{tmp}/agent.sqlite", "--proposer", "replay", "--script", "{tmp}/list.yaml"],
     "is not valid JSON"),
    (["agent", "status", "--db", "{tmp}/notyaml.txt"], "is not an agent database"),
    (["agent", "export", "--db", "{tmp}/agent.sqlite", "--name", "nope"], "no run 'nope'"),
    (["serve", "--model", "tiny-qwen2", "--backend", "attention=fa3"], "--backend attention=fa3: "),
]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "notyaml.txt").write_text("hello, not a recipe\n")
    (tmp_path / "bad.yaml").write_text("not: [valid\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "minimal.yaml").write_text("experiment_name: x\n")
    (tmp_path / "bad.json").write_text("{not json")
    from areal_tik.agent.store import Store
    Store(str(tmp_path / "agent.sqlite")).close()  # an agent database without runs
    return tmp_path


@pytest.mark.parametrize("argv,why", FILE_CASES, ids=lambda v: " ".join(v)[:80] if isinstance(v, list) else None)
def test_train_agent_and_serve_user_errors_are_one_line_and_exit_2(argv, why, files, no_work, capsys):
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith(f"areal-tik {argv[0]}: error: ") and why in err[0], err
    assert not os.path.exists(files / "none.sqlite"), "a missing --db was created"


def test_an_option_ignored_with_the_others_is_warned_about(no_work, capsys):
    """--backend with --kernels default would change nothing: the server says so, once, on stderr."""
    rc = main(["serve", "--model", "tiny-qwen2", "--kernels", "default", "--backend", "attention=fa3",
               "--port", str(_free_port())])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and "started work despite a bad argument" in err[-1], err  # no_work: the build was reached
    assert err[0] == ("areal-tik serve: warning: --backend is ignored with --kernels default (the model runs HF's "
                      "own kernels)"), err
    main(["serve", "--model", "tiny-qwen2", "--kernels", "tik", "--port", str(_free_port())])
    assert "warning" not in capsys.readouterr().err


def _free_port() -> int:
    s = _busy_port()
    port = s.getsockname()[1]
    s.close()
    return port


def test_train_refuses_a_backend_that_cannot_run_the_model_before_starting():
    """``actor.tik.backend=attention=fa3`` where fa3 cannot keep its contract (no GPU here; head dim 64 on
    a GPU): exit 2 with one line naming the key, before a model is built or a server launched (it used
    to surface as 'areal-tik serve exited with status 2', exit 1). A subprocess: AReaL's own log lines
    (its config warnings) go to the real stderr, ours is the last line."""
    p = subprocess.run([sys.executable, "-m", "areal_tik.cli", "train", "--config", RECIPE, "actor.kernel_backend=tik",
                        "actor.tik.backend='attention=fa3'", "trial_name=cli_fa3"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("areal-tik train: error: actor.tik.backend=attention=fa3: "), p.stderr
    assert "startup: model dir ready" not in p.stderr, p.stderr
