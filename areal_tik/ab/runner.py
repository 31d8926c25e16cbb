"""End-to-end throughput A/B of rollout engines and the recompute skip, same recipe, seed and data.

Each arm is one ``python -m areal_tik.areal.train`` process (AReaL's real trainer):

- ``vllm``: stock vLLM through AReaL's vLLM path (``rollout.backend=vllm:...``,
  ``actor.kernel_backend=default``: recompute every step): the reference users run;
- ``vllm_loglinear``: ``vllm`` with ``actor.prox_logp_method=loglinear`` (AReaL's approximation of the
  proximal log-probs for the decoupled loss, no recompute forward; asynchronous recipes);
- ``baseline``: ``areal-tik serve`` on default kernels, recompute every step (diagnostic: our
  engine without our kernels; the reference when there is no ``vllm`` arm);
- ``tik``: ``areal-tik serve`` on tik kernels (recompute skipped when docs/design.md section 6
  allows, audits on step 0 and every ``actor.tik.audit_interval`` steps);
- ``tik_ipc``: ``tik`` with the trainer's weights handed to the server through a shared buffer
  (``actor.tik.weight_transfer=ipc``, disk mode: no checkpoint written or read; one GPU);
- ``vllm_tik``: vLLM with the tik plugin, tik kernels, the same skip rule;
- ``vllm_tik_ipc``: ``vllm_tik`` with the shared-buffer weight transfer, as ``tik_ipc``.

The trainer appends one JSON line per step (``--step-log``): AReaL's committed stats
(``timeperf/rollout``, ``timeperf/recompute_logp``, ``timeperf/train_step``,
``timeperf/update_weights`` ...), the wall time between step commits, and the actor's
per-batch record (tokens, reward, skip decision, audit / comparison counts).

The arms run here or in separate calls (each arm's record and step log stay in ``out``);
:func:`areal_tik.ab.analysis.analyze` turns the logs into the report and
:func:`areal_tik.ab.report.write_report` writes ``report.json``, ``steps.csv``, ``summary.md``,
``step_time.png`` and ``reward.png``.
"""
from __future__ import annotations

import functools
import glob
import importlib.metadata as md
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import yaml

from areal_tik.ab.analysis import ARM_ENGINES, ARMS, analyze, load_steps, server_intervals
from areal_tik.ab.arm_log import LogFollower, failure_excerpt, startup_phases
from areal_tik.ab.describe import machine_label
from areal_tik.ab.progress import ArmProgress
from areal_tik.ab.report import REPORT_FILES, write_report
from areal_tik.areal import engines
from areal_tik.dispatch.fingerprint import environment

DEFAULT_SET = ("baseline", "tik")     # runs anywhere (no vLLM needed): the CPU quick start
# what makes each arm: (its rollout engine in areal_tik.areal.engines, its kernels)
ARM_WIRING = {"vllm": ("vllm", "default"), "vllm_loglinear": ("vllm", "default"), "baseline": ("tik", "default"),
              "tik": ("tik", "tik"), "tik_ipc": ("tik", "tik"), "vllm_tik": ("vllm", "tik"),
              "vllm_tik_ipc": ("vllm", "tik")}

__all__ = ["run_arm", "run_ab", "load_arm", "arm_overrides", "arm_engine", "parse_arms", "DEFAULT_SET", "ARM_WIRING",
           "ArmFailed"]


class ArmFailed(RuntimeError):
    """An arm's trainer exited with an error: the message is one line, ``excerpt`` the log lines that say
    why and ``log`` the log's path."""

    def __init__(self, arm: str, returncode: int, log: str, excerpt: list[str]):
        last = next((x for x in reversed(excerpt) if x.strip()), "no output")
        super().__init__(f"the {arm} arm failed (exit {returncode}): {last.strip()}")
        self.arm, self.returncode, self.log, self.excerpt = arm, returncode, log, excerpt


def _recipe_rollout_backend(config: str) -> str:
    """``rollout.backend`` of the recipe (e.g. ``sglang:d1p1t1``); ``sglang:d1p1t1`` when it names none."""
    try:
        with open(config) as f:
            val = ((yaml.safe_load(f) or {}).get("rollout") or {}).get("backend")
    except (OSError, ValueError, AttributeError):
        val = None
    return str(val) if val else "sglang:d1p1t1"


def arm_overrides(arm: str, config: str) -> list[str]:
    """What makes an arm (:data:`ARM_WIRING`): ``actor.kernel_backend``, ``rollout.backend=<its engine's client
    family>:<the recipe's layout>`` when the recipe names another family (the same data-parallel layout as the
    recipe's servers), and ``actor.tik.rollout_engine``; ``vllm_loglinear`` also
    ``actor.prox_logp_method=loglinear`` (AReaL's approximation of the proximal log-probs); ``tik_ipc`` and
    ``vllm_tik_ipc`` also the disk mode with ``actor.tik.weight_transfer=ipc``."""
    engine, kernels = engines.get(ARM_WIRING[arm][0]), ARM_WIRING[arm][1]
    out = [f"actor.kernel_backend={kernels}"]
    family, _, layout = _recipe_rollout_backend(config).partition(":")
    if family != engine.rollout_backend:
        out.append(f"rollout.backend={engine.rollout_backend}:{layout or 'd1p1t1'}")
    if arm == "vllm_loglinear":
        out.append("actor.prox_logp_method=loglinear")
    if arm.endswith("_ipc"):
        out += ["actor.weight_update_mode=disk", "++actor.tik.weight_transfer=ipc"]
    return out + [f"++actor.tik.rollout_engine={engine.name}"]   # ++: set whether or not the recipe lists the key


def _runs_dir(out: str, runs_dir: str | None) -> str:
    return os.path.abspath(runs_dir) if runs_dir else os.path.join(os.path.abspath(out), "runs")


def _arm_cmd(config: str, arm: str, steps: int, out: str, overrides: list[str], runs_dir: str | None = None) -> list[str]:
    return [sys.executable, "-m", "areal_tik.areal.train", "--config", os.path.abspath(config),
            *arm_overrides(arm, config), f"total_train_steps={steps}", f"trial_name={arm}",
            f"cluster.fileroot={_runs_dir(out, runs_dir)}",
            "--step-log", os.path.join(os.path.abspath(out), arm, "steps.jsonl"), *overrides]


def _copy_server_log(out: str, arm: str, runs_dir: str | None) -> None:
    """``<fileroot>/<experiment>/<arm>/{tik,vllm}_server.log`` -> ``<out>/<arm>/`` (the runs
    dir may live outside the report dir, e.g. off a device's small result folder)."""
    for p in _server_logs(out, arm, runs_dir):
        try:
            shutil.copyfile(p, os.path.join(out, arm, os.path.basename(p)))
        except OSError:
            pass


# a server that logs one of these answers every request with an error from then on (areal-tik serve; vLLM)
SERVER_FATAL = ("engine.step failed", "EngineCore encountered a fatal error", "EngineDeadError")


def _server_logs(out: str, arm: str, runs_dir: str | None) -> dict[str, int]:
    """The arm's rollout server logs now and their sizes (the server appends: a log from an
    earlier run in the same runs dir must not count against this one)."""
    sizes = {}
    logs = {e.server_log for e in engines.all_engines() if e.server_log}     # each rollout engine's server log
    for p in sorted(q for name in logs for q in glob.glob(os.path.join(_runs_dir(out, runs_dir), "*", arm, name))):
        try:
            sizes[p] = os.path.getsize(p)
        except OSError:
            pass
    return sizes


def _server_failure(out: str, arm: str, runs_dir: str | None, offsets: dict[str, int]) -> str | None:
    """The first fatal line the arm's rollout server logged past ``offsets`` (per log: bytes
    already scanned, or there before this run), if any; ``offsets`` advances to the last whole
    line read, so each poll reads only what is new (AReaL's client retries failed generations
    until the arm's timeout, so without this check a broken server costs the whole budget)."""
    for p in _server_logs(out, arm, runs_dir):
        try:
            with open(p, "rb") as f:
                f.seek(offsets.get(p, 0))
                data = f.read()
        except OSError:
            continue
        lines = data.decode(errors="replace").splitlines(keepends=True)
        for i, line in enumerate(lines):
            if any(k in line for k in SERVER_FATAL):
                return "".join(lines[i:i + 60])
        offsets[p] = offsets.get(p, 0) + data.rfind(b"\n") + 1  # a partly written last line is read again
    return None


def run_arm(config: str, arm: str, steps: int, out: str, overrides: list[str] = (), on_step=None,
            timeout: float | None = None, env: dict | None = None, runs_dir: str | None = None,
            partial_ok: bool = False, teardown_grace_s: float = 30.0, on_phase=None) -> dict:
    """Run one arm to completion; ``on_step(arm, n_done)`` after every logged step, ``on_phase(arm, text)``
    for every start-up phase its trainer stamps in ``train.log``. A trainer that exits with an error
    raises :class:`ArmFailed`; the result's ``load_avg`` is the machine's mean 1-minute load meanwhile.

    ``timeout``: seconds before the arm is killed; then ``TimeoutError``, or with ``partial_ok``
    the steps logged so far are returned with ``timed_out: True`` (a device call has a hard
    wall-clock limit: a partial A/B beats none). ``runs_dir``: AReaL's ``cluster.fileroot``
    (model dirs, checkpoints; default ``<out>/runs``). Once all ``steps`` are logged the process
    gets ``teardown_grace_s`` to exit, then it is killed and the arm counts as complete
    (``teardown_killed``): on 2x H200 with xccl both trainers hung ~2 min after their last step."""
    os.makedirs(os.path.join(out, arm), exist_ok=True)
    log = os.path.join(out, arm, "steps.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = _arm_cmd(config, arm, steps, out, list(overrides), runs_dir)
    run_env = {k: v for k, v in os.environ.items() if k not in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT")}
    run_env.update(env or {})
    t0 = time.perf_counter()
    timed_out = teardown_killed = False
    server_failure = None
    scanned = _server_logs(out, arm, runs_dir)  # what earlier runs appended is not this run's failure
    t_all_logged = None
    train_log = os.path.join(out, arm, "train.log")
    follower, loads = LogFollower(train_log), []
    with open(train_log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
        seen = 0
        polls = 0
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if hasattr(os, "getloadavg"):
                    loads.append(os.getloadavg()[0])
                n = sum(1 for _ in open(log)) if os.path.exists(log) else 0
                if n != seen and on_step:
                    on_step(arm, n)
                seen = n
                for phase in startup_phases(follower.new_text()) if on_phase else ():
                    on_phase(arm, phase)   # after the steps: a step logged before a later stamp shows first
                if n >= steps:
                    t_all_logged = t_all_logged or time.perf_counter()
                    if time.perf_counter() - t_all_logged > teardown_grace_s:
                        teardown_killed = True
                        break
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    timed_out = n < steps
                    teardown_killed = not timed_out
                    break
                polls += 1
                if n < steps and polls % 10 == 0 and (server_failure := _server_failure(out, arm, runs_dir, scanned)):
                    break
        finally:
            if proc.poll() is None:  # timeout or interrupt: the trainer and its rollout server (same group)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
                proc.wait()
    _copy_server_log(out, arm, runs_dir)
    rows = load_steps(log) if os.path.exists(log) else []
    if server_failure:
        raise RuntimeError(f"{arm} arm stopped: its rollout server failed (see {out}/{arm}/*_server.log):\n"
                           f"{server_failure}")
    if timed_out:
        if not partial_ok:
            raise TimeoutError(f"{arm} arm ran past {timeout}s; see {out}/{arm}/train.log")
    elif proc.returncode != 0 and not teardown_killed:
        with open(train_log, errors="replace") as f:
            raise ArmFailed(arm, proc.returncode, train_log, failure_excerpt(f.read()))
    if on_step:
        on_step(arm, len(rows))
    return {"cmd": cmd, "wall_s": time.perf_counter() - t0, "steps": rows, "timed_out": timed_out,
            "teardown_killed": teardown_killed, "load_avg": sum(loads) / len(loads) if loads else None}


def _arm_record_path(out: str, arm: str) -> str:
    return os.path.join(out, arm, "arm.json")


def _write_arm_record(out: str, arm: str, rec: dict) -> None:
    os.makedirs(os.path.join(out, arm), exist_ok=True)
    with open(_arm_record_path(out, arm), "w") as f:
        json.dump(rec, f, indent=2)


def _environment_here() -> dict:
    """This machine's environment (GPU, versions), recorded with each arm run here; no GPU when it cannot be read."""
    try:
        return environment()
    except Exception:  # noqa: BLE001
        return {"gpu": None}


def _shared(config: str, overrides) -> dict:
    """What both arms of one A/B must share: the recipe and the overrides given to both."""
    return {"config": os.path.abspath(config), "overrides": list(overrides)}


def load_arm(out: str, arm: str) -> dict | None:
    """An arm run by an earlier ``run_ab(arms=...)`` call: its record and step log, or None.

    The record is written when the arm starts (``complete: false``) and rewritten when it
    ends, so an arm whose process or device call was killed still loads, as a partial
    (timed-out) arm with the steps it logged."""
    rec, log = _arm_record_path(out, arm), os.path.join(out, arm, "steps.jsonl")
    if not os.path.exists(rec):
        return None
    with open(rec) as f:
        res = json.load(f)
    res["steps"] = load_steps(log) if os.path.exists(log) else []
    if not res.get("complete", True):
        res["timed_out"] = True
    return res


def arm_engine(arm: str) -> str:
    """The arm's rollout engine in words, with the installed version of an engine from another package (vLLM)."""
    text = ARM_ENGINES.get(arm, arm)
    pkg = engines.get(ARM_WIRING[arm][0]).package if arm in ARM_WIRING else None
    if pkg:
        try:
            text += f"; {pkg} {md.version(pkg)}"
        except md.PackageNotFoundError:
            text += f"; {pkg} not installed here"
    return text


def parse_arms(spec: str, universe=ARMS) -> tuple[str, ...]:
    """``"vllm,tik"`` -> ("vllm", "tik") in :data:`ARMS` order; a one-line ``ValueError`` on an unknown arm."""
    names = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in names if x not in universe]
    if bad:
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(universe)}")
    return tuple(a for a in ARMS if a in names)


def run_ab(config: str, steps: int, out: str, overrides: list[str] = (), progress: bool | str = True,
           timeout: float | None = None, runs_dir: str | None = None, partial_ok: bool = False,
           arms: tuple[str, ...] = DEFAULT_SET, arm_set: tuple[str, ...] | None = None) -> dict:
    """Run the ``arms`` of the comparison ``arm_set`` (default: ``baseline`` and ``tik``, or the
    ``arms`` when they name another), analyze, write the report directory; return the report.

    The set is ordered as :data:`ARMS`; its first arm is the reference (``vllm`` when present, else
    ``baseline``). ``arms`` may name some of the set (or none): the others are read from ``out``
    (``<arm>/arm.json`` + ``<arm>/steps.jsonl``, written by earlier calls), so the arms can run in
    separate processes or device calls. While an arm is still missing, nothing is analyzed and the
    return value says which (``{"pending": [...]}``). Arms are only compared when they ran the same
    recipe with the same overrides (``ValueError`` otherwise, before anything runs), and an arm is not
    run against a loaded reference that logged no step. Running the reference without the rest of the
    set starts a new set: the other arms' records in ``out`` are no longer paired with it.

    ``progress``: how the arms' progress shows on stderr, a mode of :class:`~areal_tik.ab.progress.ArmProgress`
    (``auto``, ``bar``, ``plain``, ``none``); True is ``auto``, False ``none``.

    With ``partial_ok`` an arm that runs past ``timeout`` keeps the steps it logged; when the
    reference stopped early the other arms are asked for the same number of steps (the report
    compares equal step counts anyway)."""
    unknown = [a for a in (*arms, *(arm_set or ())) if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if arm_set is None:
        arm_set = DEFAULT_SET if all(a in DEFAULT_SET for a in arms) else tuple(arms)
    arm_set = tuple(a for a in ARMS if a in arm_set)
    if not arm_set:
        raise ValueError("the comparison names no arm")
    outside = [a for a in arms if a not in arm_set]
    if outside:
        raise ValueError(f"arm(s) {outside} are not in the comparison {list(arm_set)}")
    ref = arm_set[0]
    os.makedirs(out, exist_ok=True)
    to_run = [a for a in arm_set if a in arms]
    if ref in to_run:  # a new reference starts a new set (the old arms' logs stay)
        for a in arm_set:
            if a not in to_run and os.path.exists(_arm_record_path(out, a)):
                os.remove(_arm_record_path(out, a))
    results = {a: r for a in arm_set if a not in arms and (r := load_arm(out, a)) is not None}
    here = _shared(config, overrides)
    for a, r in results.items():
        theirs = r.get("shared")
        if to_run and theirs is not None and theirs != here:
            raise ValueError(f"the {a} arm in {out} ran {theirs}, this call asks for {here}: start a new pair "
                             f"(run the {ref} arm again or use another --out)")
        if to_run and not r["steps"]:
            raise RuntimeError(f"the {a} arm in {out} logged no step (see {out}/{a}/train.log); run it again first")

    environment_here = functools.cache(_environment_here)   # read once per call, only when an arm needs it

    def arm_steps(a):
        if a != ref and results.get(ref, {}).get("timed_out"):
            return max(1, len(results[ref]["steps"]))
        return steps

    def one(a, prog):
        n = arm_steps(a)
        engine = arm_engine(a)
        _write_arm_record(out, a, {"cmd": _arm_cmd(config, a, n, out, list(overrides), runs_dir), "wall_s": None,
                                   "timed_out": None, "complete": False, "steps_requested": n, "shared": here,
                                   "engine": engine})
        prog.start(a, n)
        try:
            res = run_arm(config, a, n, out, overrides, on_step=prog.step, timeout=timeout, runs_dir=runs_dir,
                          partial_ok=partial_ok, on_phase=prog.phase)
        except BaseException:
            prog.end(a, ok=False)
            raise
        prog.end(a)
        res["engine"] = engine
        results[a] = res
        _write_arm_record(out, a, {"cmd": res["cmd"], "wall_s": res["wall_s"], "timed_out": res["timed_out"],
                                   "teardown_killed": res.get("teardown_killed", False), "load_avg": res.get("load_avg"),
                                   "complete": True, "steps_requested": n, "shared": here, "engine": engine,
                                   "environment": environment_here()})

    if to_run:  # a report from an earlier set no longer describes these arms
        for f in REPORT_FILES:
            if os.path.exists(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
    mode = progress if isinstance(progress, str) else "auto" if progress else "none"
    with ArmProgress({a: arm_steps(a) for a in to_run}, mode) as prog:
        for a in to_run:
            one(a, prog)
    pending = [a for a in arm_set if a not in results]
    if pending:
        done = {a: len(r["steps"]) for a, r in results.items()}
        return {"pending": pending, "done": done, "files": [],
                "summary_md": f"arm(s) {', '.join(pending)} not run yet in {out}; done: "
                              + (", ".join(f"{a} ({n} steps)" for a, n in done.items()) or "none")}
    if not all(results[a]["steps"] for a in arm_set):
        raise RuntimeError(f"an arm logged no step (killed, failed or past its timeout); see {out}/<arm>/train.log: "
                           + ", ".join(f"{a}: {len(results[a]['steps'])} steps" for a in arm_set))
    shared = {a: results[a].get("shared") for a in arm_set if results[a].get("shared") is not None}
    if len({json.dumps(v, sort_keys=True) for v in shared.values()}) > 1:
        raise ValueError(f"the arms in {out} ran different recipes/overrides: "
                         + "; ".join(f"{a} {v}" for a, v in shared.items()))
    report = analyze({a: results[a]["steps"] for a in arm_set})
    if not to_run and shared:   # a report rebuilt from earlier calls: what those arms ran, not this call's flags
        overrides = shared[ref]["overrides"] if ref in shared else next(iter(shared.values()))["overrides"]
    meta = {"config": config, "steps": steps, "overrides": list(overrides), "arms": list(arm_set),
            "cmds": {a: results[a]["cmd"] for a in arm_set},
            **{f"cmd_{a}": results[a]["cmd"] for a in arm_set},
            "engines": {a: results[a].get("engine") or ARM_ENGINES[a] for a in arm_set},
            "arm_wall_s": {a: results[a]["wall_s"] for a in arm_set},
            "arm_load": {a: results[a].get("load_avg") for a in arm_set},
            "timed_out": {a: results[a]["timed_out"] for a in arm_set},
            "teardown_killed": {a: bool(results[a].get("teardown_killed")) for a in arm_set},
            "arms_run_here": list(to_run),
            "server_intervals": {a: server_intervals(out, a) for a in arm_set}}
    # the machine the arms ran on, as each recorded it (a report rebuilt elsewhere still names their GPU); arms
    # recorded before this was kept, or run here, take this machine's
    envs = {a: results[a].get("environment") or environment_here() for a in arm_set}
    meta["environment"] = envs[ref]
    labels = {a: machine_label({"environment": e}) for a, e in envs.items()}
    if len(set(labels.values())) > 1:
        meta["machine"] = "different machines: " + ", ".join(f"{a} on {m}" for a, m in labels.items())
    written = write_report(report, out, meta)
    report["summary_md"] = written["summary"]
    report["files"] = written["files"]
    return report
