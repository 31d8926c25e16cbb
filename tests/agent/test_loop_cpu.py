"""A full agent loop on the CPU: interpreter checks, tiny workloads, SIMULATED timer."""
import json

import pytest

from areal_tik.agent import roles
from areal_tik.agent.evaluator import Evaluator
from areal_tik.agent.export import ExportRefused, export_best
from areal_tik.agent.loop import Budget, run_loop
from areal_tik.agent.plot import plot_lineage
from areal_tik.agent.proposers import OfflineProposer
from areal_tik.agent.store import Store
from areal_tik.cli import main as cli_main


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    store = Store(str(d / "ir.sqlite"))
    ev = Evaluator(str(d / "work"), timeout_s=300)
    try:
        run = roles.initialize(store, ev, OfflineProposer(), "cpu", "linear", "tiny", "simulated")
        assert run.status == "initialized" and run.noise_floor >= 0.01
        summ = run_loop(store, "cpu", OfflineProposer(), ev, Budget(max_candidates=10))
    finally:
        ev.close()
    return d, store, summ


def test_loop_records_a_consistent_ir(loop_run):
    d, store, summ = loop_run
    run = store.run("cpu")
    assert summ["SIMULATED"] and summ["timer"] == "simulated"
    assert summ["status"] == "stopped" and summ["stop_reason"].startswith("budget")
    vs = store.versions(run.id)
    assert len(vs) == 11 and not store.versions(run.id, "pending")
    # one audit decision per candidate, with a reason
    for v in vs[1:]:
        ds = [x for x in store.decisions(run.id, v.id) if x.action in ("reject", "keep", "promote", "branch")]
        assert len(ds) == 1 and ds[0].reason
        assert store.checks(v.id)
        assert store.opportunity(v.opportunity_id).status == "consumed"
    # every measurement of this run is labelled simulated
    ms = store.measurements(run_id=run.id)
    assert ms and all(m.simulated for m in ms)
    assert summ["decisions"].get("promote", 0) >= 1, summ["decisions"]
    best = store.version(run.best_version)
    assert best.status == "verified" and best.id != run.root_version
    assert summ["final"]["speedup"] > 1.0
    heads = {b.head_version for b in store.branches(run.id)}
    assert all(store.version(h).status == "verified" for h in heads)
    assert summ["tokens"] == 0


def test_simulated_results_are_never_exported(loop_run, tmp_path):
    d, store, _ = loop_run
    with pytest.raises(ExportRefused, match="SIMULATED"):
        export_best(store, "cpu", out_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())
    assert cli_main(["agent", "export", "--db", store.path, "--name", "cpu", "--out-dir", str(tmp_path)]) == 2


def test_plot_and_cli_views(loop_run, capsys):
    d, store, _ = loop_run
    png = plot_lineage(store, "cpu", str(d / "lineage.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["agent", "status", "--db", store.path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["run"] == "cpu" and out[0]["SIMULATED"] is True
    assert cli_main(["agent", "show", "--db", store.path, "--name", "cpu", "--version", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"]["id"] == 2 and shown["checks"]
