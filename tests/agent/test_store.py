"""The IR store on its own, in a temporary file, no API keys, no kernels."""
import sqlite3

import pytest

from areal_tik.agent.records import (
    Branch, CheckResult, Contract, Decision, Edge, KernelVersion, Measurement, Opportunity, ProposerCall, Run,
    Workload, content_hash,
)
from areal_tik.agent.schema import SCHEMA
from areal_tik.agent.store import Store


def _fill(s: Store):
    run = s.add_run(Run(name="r", op="linear", kind="triton", timer="simulated", env={"gpu": None}))
    s.freeze_contract(Contract(run_id=run.id, op="linear", spec={"rtol": 1e-2}))
    w = s.add_workload(Workload(run_id=run.id, name="qkv_m16", shape={"M": 16, "N": 64, "K": 32}, weight=8.0))
    root = s.add_version(KernelVersion(run_id=run.id, op="linear", kind="triton", source="src0", meta={"b": 1}))
    child = s.add_version(KernelVersion(run_id=run.id, op="linear", kind="triton", source="src1", meta={"b": 2},
                                       parent_id=root.id, step=1))
    s.add_edge(Edge(run_id=run.id, parent_id=root.id, child_id=child.id))
    return run, w, root, child


def test_schema_wal_busy_timeout_and_roundtrip(tmp_path):
    s = Store(str(tmp_path / "ir.sqlite"))
    assert s.journal_mode() == "wal"
    assert s.busy_timeout() >= 1000
    run, w, root, child = _fill(s)
    assert s.run("r").id == run.id and s.run(run.id).env == {"gpu": None}
    assert s.contract(run.id).spec == {"rtol": 1e-2}
    with pytest.raises(ValueError):
        s.freeze_contract(Contract(run_id=run.id, op="linear", spec={"rtol": 1.0}))
    assert s.version(child.id).meta == {"b": 2}
    assert root.hash == content_hash("triton", "linear", "src0", {"b": 1}) != child.hash
    assert s.lineage(child.id) == [child.id, root.id]
    # duplicate content is refused by the unique (run, hash) index
    with pytest.raises(sqlite3.IntegrityError):
        s.add_version(KernelVersion(run_id=run.id, op="linear", kind="triton", source="src0", meta={"b": 1}))
    s.add_check(CheckResult(run_id=run.id, version_id=child.id, check="accuracy", passed=False, detail={"rel": 0.5}))
    assert s.checks(child.id)[0].passed is False and s.checks(child.id)[0].detail == {"rel": 0.5}
    s.add_measurement(Measurement(run_id=run.id, version_id=child.id, workload_id=w.id, session="s1",
                                  latency_us=3.5, samples=[3.4, 3.5], simulated=True))
    m = s.measurements(child.id)[0]
    assert m.simulated is True and m.samples == [3.4, 3.5]
    o = s.add_opportunity(Opportunity(run_id=run.id, parent_id=root.id, key="k", kind="meta", description="d",
                                      priority=5.0))
    assert s.add_opportunity(Opportunity(run_id=run.id, parent_id=root.id, key="k", kind="meta", description="d")) is None
    s.set_opportunity_status(o.id, "consumed")
    assert s.opportunity(o.id).status == "consumed" and s.opportunity(o.id).closed
    b = s.add_branch(Branch(run_id=run.id, name="main", base_version=root.id, head_version=root.id))
    s.update_branch(b.id, head_version=child.id, status="merged")
    assert s.branch(b.id).head_version == child.id and s.branch(b.id).status == "merged"
    s.add_decision(Decision(run_id=run.id, step=1, action="reject", reason="accuracy: bad", version_id=child.id,
                            data={"check": "accuracy"}))
    assert s.decisions(run.id, child.id)[0].data == {"check": "accuracy"}
    s.add_proposer_call(ProposerCall(run_id=run.id, step=1, proposer="llm", prompt_tokens=10, completion_tokens=5,
                                     total_tokens=15))
    s.add_proposer_call(ProposerCall(run_id=run.id, step=2, proposer="llm", total_tokens=7))
    assert s.tokens_used(run.id) == 22
    for rec in (s.version(child.id), s.opportunity(o.id), s.branch(b.id), s.run(run.id)):
        assert type(rec).from_dict(rec.to_dict()) == rec
    s.close()


def test_transaction_rolls_back_whole_step(tmp_path):
    s = Store(str(tmp_path / "ir.sqlite"))
    run, w, root, child = _fill(s)
    with pytest.raises(RuntimeError):
        with s.transaction():
            s.add_decision(Decision(run_id=run.id, step=2, action="keep", reason="x"))
            s.set_version_status(child.id, "verified")
            raise RuntimeError("killed mid-step")
    assert s.decisions(run.id) == [] and s.version(child.id).status == "pending"


def test_read_only_open_and_concurrent_reader(tmp_path):
    p = str(tmp_path / "ir.sqlite")
    s = Store(p)
    _fill(s)
    ro = Store(p, read_only=True)
    assert ro.run("r") is not None
    with pytest.raises(sqlite3.OperationalError):
        ro.add_run(Run(name="x", op="linear", kind="triton", timer="gpu"))
    # the writer keeps writing while a reader is open (WAL)
    s.add_run(Run(name="r2", op="linear", kind="triton", timer="gpu"))
    assert ro.run("r2") is not None
    with pytest.raises(FileNotFoundError):
        Store(str(tmp_path / "missing.sqlite"), read_only=True)


def test_migrations_only_add_columns(tmp_path):
    p = str(tmp_path / "old.sqlite")
    con = sqlite3.connect(p)   # an "old" file: runs lacks most columns, one extra legacy column
    con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE, legacy TEXT)")
    con.execute("INSERT INTO runs(name, legacy) VALUES ('old', 'keep me')")
    con.commit()
    con.close()
    s = Store(p)
    cols = [r["name"] for r in s.conn.execute("PRAGMA table_info(runs)")]
    assert "legacy" in cols and all(c in cols for c, _ in SCHEMA["runs"])
    assert s.conn.execute("SELECT legacy FROM runs WHERE name='old'").fetchone()[0] == "keep me"
    assert s._migrate() == []          # idempotent
    s.close()
    Store(p).close()                   # reopening is a no-op
