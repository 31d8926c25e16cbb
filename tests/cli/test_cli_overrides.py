"""Overrides are checked against the recipe before anything starts: a key the recipe lacks is one line
on stderr naming it and the closest key the recipe has, exit status 2, in a few seconds (the recipe's
YAML only, AReaL not imported); a value AReaL's loader refuses stops ``ab`` before any arm starts."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from areal_tik.areal.overrides import OverrideError, check_keys, closest_key, recipe_keys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")


def _cli(*argv, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "areal_tik.cli", *argv], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    return p, time.perf_counter() - t0


@pytest.mark.parametrize("cmd", ["ab", "train"])
def test_override_typo_exits_2_in_under_5_s_naming_the_key(cmd, tmp_path):
    p, seconds = _cli(cmd, "--config", RECIPE, "gconfig.max_new_token=8", *(["--out", str(tmp_path / "r")]
                                                                            if cmd == "ab" else []))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert seconds < 5, f"{seconds:.1f} s"
    assert len(lines) == 1 and lines[0].startswith(f"areal-tik {cmd}: error: "), p.stderr
    assert "gconfig.max_new_token=8" in lines[0] and "did you mean gconfig.max_new_tokens?" in lines[0]
    assert not (tmp_path / "r").exists()          # no arm started, no report folder


def test_check_keys_reads_hydras_rules_from_the_recipe():
    keys = recipe_keys(RECIPE)
    assert {"gconfig.max_new_tokens", "actor.tik.audit_interval", "actor.tik", "cluster.fileroot"} <= keys
    check_keys(RECIPE, ["actor.kernel_backend=tik", "actor.tik.audit_interval=3", "train_dataset.path='a?n=2'",
                        "++gconfig.new_key=1", "~saver", "+actor.new_key=2"])
    with pytest.raises(OverrideError, match=r"has no key actor\.tik\.audit_intervl; did you mean "
                                            r"actor\.tik\.audit_interval\?"):
        check_keys(RECIPE, ["actor.tik.audit_intervl=3"])
    with pytest.raises(OverrideError, match=r"already has gconfig\.n_samples; drop the '\+'"):
        check_keys(RECIPE, ["+gconfig.n_samples=2"])
    with pytest.raises(OverrideError, match=r"write \+foo\.bar=1"):
        check_keys(RECIPE, ["foo.bar=1"])
    with pytest.raises(OverrideError, match="not key=value"):
        check_keys(RECIPE, ["gconfig.n_samples"])
    with pytest.raises(OverrideError, match="names no key before '='"):
        check_keys(RECIPE, ["=broken"])
    assert closest_key("n_samples", keys) == "gconfig.n_samples"   # a bare leaf finds its section


@pytest.mark.areal
def test_bad_value_stops_ab_before_any_arm(tmp_path):
    """A key the recipe has with a value AReaL's typed config refuses: one line naming the key, exit 2,
    nothing started (the arms would have failed after their start-up)."""
    out = tmp_path / "r"
    p, seconds = _cli("ab", "--config", RECIPE, "--out", str(out), "--progress", "none", "gconfig.max_new_tokens=abc")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == ["areal-tik ab: error: the baseline arm's config: Value 'abc' of type "
                                             "'str' could not be converted to Integer (gconfig.max_new_tokens)"]
    assert not out.exists() and p.stdout == ""


@pytest.mark.areal
def test_train_bad_value_exits_2():
    p, _ = _cli("train", "--config", RECIPE, "actor.kernel_backend=tikk")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == ("areal-tik train: error: actor.kernel_backend must be one of "
                                                 "('default', 'tik'), got 'tikk'")
