"""The rollout-engine registry (``areal_tik.areal.engines``): nothing outside it branches on an engine's name,
and docs/rollout-engines.md ("How to add a rollout engine") works as written: a throwaway engine registered from a
test is what the trainer, the SPMD entry point, the config checks, ``areal-tik verify``, the A/B and the rollout
bench then use."""
from __future__ import annotations

import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGISTRY = os.path.join("areal_tik", "areal", "engines.py")
ENGINE_NAMES = {"tik", "vllm", "sglang", "vllm-stock"}
ENGINE_ONLY = ENGINE_NAMES - {"tik"}                       # "tik" is a kernels value as well as our engine's name
ENGINE_WORDS = re.compile(r"kind|engine|server|backend|rollout", re.I)
OTHER_AXES = re.compile(r"kernel|arm", re.I)               # the kernel axis (tik | default) and A/B / bench arm names


def _subject(node) -> str:
    """The name a compared expression is known by: ``x.kind`` -> kind, ``d["kernels"]`` -> kernels,
    ``s.get("kernels")`` -> kernels, ``getattr(a, "engine", ...)`` -> engine, ``f(...).strip()`` -> strip."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else _subject(node.value)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) > 1:
            return _subject(node.args[1])
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            return node.args[0].value
        return _subject(node.func)
    return ""


def _strings(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def engine_name_comparisons(source: str, path: str = "<src>") -> list[str]:
    """Every comparison (==, !=, in, not in) of an expression with engine names, unless the expression is on the
    kernel axis or names an arm: ``kind == "vllm"``, ``engine in ("tik", "vllm")``, ``backend == "sglang"``."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, operands, operands[1:]):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            names, other = (_strings(b), a) if _strings(b) else (_strings(a), b)
            hits = names & ENGINE_NAMES
            subject = _subject(other)
            if not hits or OTHER_AXES.search(subject):
                continue
            if hits & ENGINE_ONLY or len(hits) > 1 or ENGINE_WORDS.search(subject):
                found.append(f"{path}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_engine_name_comparison_outside_the_registry():
    files = [p for pattern in ("areal_tik/**/*.py", "bench/**/*.py")
             for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)]
    assert len(files) > 100
    found = [hit for p in sorted(files) if os.path.relpath(p, ROOT) != REGISTRY
             for hit in engine_name_comparisons(open(p).read(), os.path.relpath(p, ROOT))]
    assert not found, "look the engine up in areal_tik.areal.engines instead:\n" + "\n".join(found)


def test_the_comparison_check_can_fail():
    src = ('if kind == "vllm": pass\nif cfg.rollout_engine in ("tik", "vllm"): pass\n'
           'if str(c.rollout.backend).split(":")[0].strip() != "sglang": pass\nif server == "tik": pass\n'
           'if getattr(args, "engine", "tik") != "tik": pass\n'
           'if settings.kernels == "tik": pass\nif s.get("kernels") != "tik": pass\nif arm == "vllm": pass\n')
    found = engine_name_comparisons(src)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "4", "5"], found


# ---- docs/rollout-engines.md, step by step, with a throwaway engine ----------------------------------------

RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")


@pytest.fixture
def toy(tmp_path):
    """Step 1-3 of the doc: hooks (plain callables here) and the registration; removed again afterwards."""
    pytest.importorskip("areal.api")
    from areal_tik.areal import engines
    calls = {}

    class ToyClient:
        pass

    class ToyOffline:
        def __init__(self, model_dir, kernels, **options):
            calls["offline"] = (model_dir, kernels, options)

    def server_args(config, settings, parallel):
        calls["server_args"] = settings.kernels
        return {"toy": True}

    def launch(config, settings, log_dir):
        calls["launch"] = log_dir
        return "a process", "127.0.0.1:1"

    def verify(req, progress):
        calls["verify"] = req
        return {"passed": True, "regimes": {"toy": {"passed": True, "n_tokens": 3, "n_mismatch": 0,
                                                    "max_abs_diff": 0.0}}}

    engine = engines.register(engines.RolloutEngine(
        name="toy", rollout_backend="sglang", kernels=("tik", "default"), summary="a throwaway engine",
        server_log="toy_server.log", client=ToyClient, server_args=server_args, launch=launch,
        check_config=lambda config: calls.setdefault("check_config", config.actor.kernel_backend),
        verify=verify, offline=ToyOffline))
    yield engine, calls, ToyClient, ToyOffline
    engines.unregister("toy")
    engines.unregister("toy_stock")


def _load(tmp_path, *overrides):
    from areal_tik.areal.train import load_config
    return load_config(["--config", RECIPE, f"stats_logger.fileroot={tmp_path}", f"cluster.fileroot={tmp_path}",
                        *overrides])


def test_a_registered_engine_is_used_everywhere(toy, tmp_path, monkeypatch, capsys):
    import dataclasses
    import importlib
    import json
    import sys

    from areal_tik.ab import runner
    from areal_tik.areal import engines
    from areal_tik.areal.config import ConfigError
    from areal_tik.areal.train import launch_rollout_server
    from areal_tik.areal.trainer import rollout_client
    from areal_tik.cli import main
    engine, calls, client, offline = toy
    # step 4, training: the key names it; the config checks, the trainer and the SPMD entry point use its hooks
    c = _load(tmp_path, "actor.kernel_backend=tik", "++actor.tik.rollout_engine=toy")
    assert engines.for_config(c) is engine and calls["check_config"] == "tik"
    assert rollout_client(c, None) == (client, {"toy": True}) and calls["server_args"] == "tik"
    assert launch_rollout_server(c, str(tmp_path / "logs")) == ("a process", "127.0.0.1:1")
    assert calls["launch"] == str(tmp_path / "logs")
    assert engines.for_config(_load(tmp_path, "actor.kernel_backend=tik")).name == "tik"   # registered last: not chosen
    with pytest.raises(ConfigError, match="rollout_engine"):     # it speaks sglang's family, not vllm's
        _load(tmp_path, "actor.kernel_backend=tik", "rollout.backend=vllm:d1p1t1", "++actor.tik.rollout_engine=toy")
    # step 2: an engine that does not list tik kernels is refused for a tik run
    engines.register(dataclasses.replace(engine, name="toy_stock", kernels=("default",)))
    with pytest.raises(ConfigError, match="toy_stock"):
        _load(tmp_path, "actor.kernel_backend=tik", "++actor.tik.rollout_engine=toy_stock")
    # parity: areal-tik verify --engine toy runs its entry
    capsys.readouterr()
    assert main(["verify", "--engine", "toy", "--json"]) == 0
    assert calls["verify"].kernels == "tik" and json.loads(capsys.readouterr().out)["engine"] == "toy"
    # the A/B: an arm wired to it names it, keeps the recipe's family, and its server log is watched
    monkeypatch.setitem(runner.ARM_WIRING, "vllm_tik", ("toy", "tik"))
    ov = runner.arm_overrides("vllm_tik", RECIPE)
    assert "++actor.tik.rollout_engine=toy" in ov and not any(o.startswith("rollout.backend") for o in ov)
    assert engines.for_config(_load(tmp_path, *ov)) is engine
    log = tmp_path / "out" / "runs" / "exp" / "vllm_tik" / "toy_server.log"
    log.parent.mkdir(parents=True)
    log.write_text("started\n")
    assert list(runner._server_logs(str(tmp_path / "out"), "vllm_tik", None)) == [str(log)]
    # the rollout bench: an arm wired to it runs its offline generator
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    bench = importlib.import_module("bench_rollout")
    monkeypatch.setitem(bench.ARM_WIRING, "engine", ("toy", "tik", {"async_decode": True, "seeded": True}))
    gen, seeds = bench._generator("engine", "/a/model", 64)
    assert isinstance(gen, offline) and seeds([[1], [2]]) == [200006, 200007]
    assert calls["offline"] == ("/a/model", "tik", {"max_model_len": 64, "max_num_seqs": bench.MAX_NUM_SEQS,
                                                    "async_decode": True})
    sys.modules.pop("bench_rollout", None)


def test_an_engine_without_launch_is_refused_in_spmd_mode(tmp_path):
    """AReaL's SGLang client only connects in SPMD mode: the entry point refuses to run it without a server
    instead of letting the trainer wait for one nobody starts."""
    pytest.importorskip("areal.api")
    from areal_tik.areal.train import launch_rollout_server
    c = _load(tmp_path, "++actor.tik.rollout_engine=sglang")
    with pytest.raises(SystemExit, match="sglang rollout engine .*AREAL_LLM_SERVER_ADDRS"):
        launch_rollout_server(c, str(tmp_path))
