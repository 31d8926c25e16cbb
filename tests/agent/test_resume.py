"""Kill the agent mid-run (SIGKILL of a subprocess), resume, and lose/duplicate nothing."""
import os
import signal
import subprocess
import sys
import time

from areal_tik.agent import roles
from areal_tik.agent.evaluator import Evaluator
from areal_tik.agent.loop import Budget, run_loop
from areal_tik.agent.proposers import OfflineProposer
from areal_tik.agent.store import Store

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _snapshot(store, run_id):
    return {v.id: (v.hash, v.step) for v in store.versions(run_id)}


def test_kill_and_resume(tmp_path):
    db = str(tmp_path / "ir.sqlite")
    store = Store(db)
    ev = Evaluator(str(tmp_path / "agent_work"), timeout_s=300)
    try:
        roles.initialize(store, ev, OfflineProposer(), "kr", "linear", "tiny", "simulated")
    finally:
        ev.close()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "areal_tik.cli", "agent", "run", "--db", db, "--name", "kr",
                             "--max-candidates", "40", "--no-live"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ro = Store(db, read_only=True)
    run_id = ro.run("kr").id
    deadline = time.time() + 150
    killed_with_pending = False
    try:
        while time.time() < deadline:
            n_done = len([v for v in ro.versions(run_id) if v.status != "pending"])
            pend = ro.versions(run_id, "pending")
            if n_done >= 4 and pend:        # kill in the middle of an audit
                killed_with_pending = True
                break
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # the agent and its evaluator worker
    finally:
        proc.wait()
    assert killed_with_pending, "did not catch the run mid-audit"
    before = _snapshot(ro, run_id)
    pending_before = [v.id for v in ro.versions(run_id, "pending")]
    decisions_before = [(d.id, d.action, d.version_id) for d in ro.decisions(run_id)]
    ro.close()

    ev = Evaluator(str(tmp_path / "agent_work"), timeout_s=300)
    try:
        summ = run_loop(store, "kr", OfflineProposer(), ev, Budget(max_candidates=3))
    finally:
        ev.close()
    after = _snapshot(store, run_id)
    # nothing lost: every version recorded before the kill is still there, unchanged
    assert all(after[i] == h for i, h in before.items())
    # the interrupted candidate was audited on resume, not proposed again
    for vid in pending_before:
        assert store.version(vid).status in ("verified", "failed")
    assert len({h for h, _ in after.values()}) == len(after)              # no duplicate kernels
    steps = [s for _, s in after.values()]
    assert len(set(steps)) == len(steps)                                  # one version per step
    assert [(d.id, d.action, d.version_id) for d in store.decisions(run_id)][: len(decisions_before)] == decisions_before
    for v in store.versions(run_id)[1:]:
        audits = [d for d in store.decisions(run_id, v.id) if d.action in ("reject", "keep", "promote", "branch")]
        assert len(audits) == 1, (v.id, audits)
    consumed = store.opportunities(run_id, status="consumed")
    assert len(consumed) == len(store.proposer_calls(run_id))              # each consumed hypothesis has its call
    # the resumed invocation audited exactly 3 candidates, the interrupted one(s) included
    assert summ["status"] == "stopped"
    assert len(after) == len(before) + 3 - len(pending_before)
