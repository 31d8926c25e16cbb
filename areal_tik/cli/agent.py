"""``areal-tik agent init|run|status|show|export``: the optimization agent's command line.

Thin over :mod:`areal_tik.agent`. The only place the agent reads environment variables
(the LLM proposer's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, the openai client's own); the
LLM proposer's model is ``--model``, required with ``--proposer llm``.

    areal-tik agent init   --db runs/agent.sqlite --name lin1 --op linear --preset qwen2.5-1.5b
    areal-tik agent init   --db runs/agent.sqlite --name rms1 --op rms_norm   # root: a csrc kernel (GPU)
    areal-tik agent run    --db runs/agent.sqlite --name lin1 --proposer offline --minutes 8
    areal-tik agent status --db runs/agent.sqlite [--json]
    areal-tik agent show   --db runs/agent.sqlite --name lin1 [--version ID] [--plot lineage.png]
    areal-tik agent export --db runs/agent.sqlite --name lin1
"""
from __future__ import annotations

import json
import os
import sqlite3

from areal_tik.agent.store import Store
from areal_tik.agent.tasks import TASKS
from areal_tik.agent import proposers, roles
from areal_tik.agent.evaluator import Evaluator
from areal_tik.agent.loop import Budget, run_loop
from areal_tik.agent.roles import summarize
from areal_tik.agent.plot import plot_lineage
from areal_tik.agent.export import ExportRefused, export_best
from areal_tik.cli.errors import UsageError
from areal_tik.dispatch.fingerprint import environment
from areal_tik.cli.output import print_json

DEFAULT_DB = "runs/agent.sqlite"


def _need_db(db: str) -> None:
    if not os.path.isfile(db):
        raise UsageError(f"--db {db!r}: no such file; give the SQLite file of an earlier 'areal-tik agent init'")


def _store(db: str, read_only: bool = False):
    """The agent's store in ``db``; a file that is not one is a user error."""
    try:
        store = Store(db, read_only=read_only)
        store.runs()  # a file that is no SQLite database (or not this one) fails at its first query
        return store
    except sqlite3.Error as e:
        raise UsageError(f"--db {db!r} is not an agent database ({e}); give the file of 'areal-tik agent init'") \
            from None


def _need_run(store, db: str, name: str):
    run = store.run(name)
    if run is None:
        raise UsageError(f"no run {name!r} in {db}; 'areal-tik agent status --db {db}' lists them "
                         "('areal-tik agent init' starts one)")
    return run


def _need_task(op: str, preset: str) -> None:
    if op not in TASKS:
        raise UsageError(f"--op {op!r}: no agent task for it; choose from {', '.join(sorted(TASKS))}")
    presets = TASKS[op].presets
    if preset not in presets:
        raise UsageError(f"--preset {preset!r}: not a workload preset of --op {op}; choose from "
                         f"{', '.join(sorted(presets))}")


def _replay_script(path: str | None) -> list:
    if not path:
        raise UsageError("--proposer replay: give --script (a JSON list of {source, meta, description})")
    if not os.path.isfile(path):
        raise UsageError(f"--script {path!r}: no such file")
    try:
        with open(path) as f:
            script = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"--script {path!r} is not valid JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(script, list):
        raise UsageError(f"--script {path!r} holds a JSON {type(script).__name__}; give a list of "
                         "{source, meta, description}")
    return script


def _workdir(db: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(db)), "agent_work")


def _proposer(args):
    if args.proposer == "llm":
        cfg = proposers.LLMConfig(
            base_url=args.base_url or os.environ.get("OPENAI_BASE_URL"),
            model=args.model or "",
            api_key=os.environ.get("OPENAI_API_KEY"), token_budget=args.token_budget)
        if not cfg.model:
            raise UsageError("llm proposer: give --model")
        return proposers.LLMProposer(cfg)
    if args.proposer == "replay":
        return proposers.ReplayProposer(_replay_script(args.script))
    return proposers.OfflineProposer()


def _timer(choice: str) -> str:
    import torch  # lazy: torch is heavy and every CLI command imports this module
    if choice == "auto":
        return "gpu" if torch.cuda.is_available() else "simulated"
    if choice == "gpu" and not torch.cuda.is_available():
        raise UsageError("--timer gpu needs a CUDA GPU; use --timer simulated or auto")
    return choice


def cmd_init(args) -> int:
    _need_task(args.op, args.preset)
    timer = _timer(args.timer)
    proposer = _proposer(args)
    env = environment()
    store = _store(args.db)
    ev = Evaluator(_workdir(args.db), timeout_s=args.timeout)
    try:
        run = roles.initialize(store, ev, proposer, args.name, args.op, args.preset, timer,
                               device=(env.get("gpu") or {}).get("name", "cpu"), env=env)
    finally:
        ev.close()
    s = roles.summarize(store, run.id)
    print(f"run {run.name!r}: {run.status}; root {s['root']}; noise floor {run.noise_floor}; timer {timer.upper()}")
    return 0 if run.status == "initialized" else 1


class _Live:
    """Rich live display of the loop's events."""

    def __init__(self, name: str):
        from rich.console import Console  # lazy: rich is heavy and every CLI command imports this module
        self.console = Console()
        self.rows: list = []
        self.name = name
        self.stats = {"candidates": 0, "promoted": 0, "rejected": 0, "kept": 0, "best_gain": 0.0}

    def table(self):
        from rich.table import Table  # lazy: rich is heavy and every CLI command imports this module
        t = Table(title=f"areal-tik agent: {self.name}  " + "  ".join(f"{k}={v if not isinstance(v, float) else f'{v:+.1%}'}"
                                                                        for k, v in self.stats.items()))
        for c in ("step", "version", "opportunity", "outcome"):
            t.add_column(c)
        for r in self.rows[-15:]:
            t.add_row(*r)
        return t

    def __call__(self, ev: dict, live=None):
        if ev["type"] == "act":
            self.rows.append([str(ev["step"]), str(ev.get("version", "")), ev.get("opportunity", ev["status"])[:70],
                              ev["status"]])
        elif ev["type"] == "audit":
            self.stats["candidates"] += 1
            a = ev.get("action", "?")
            key = {"promote": "promoted", "merge": "promoted", "reject": "rejected"}.get(a, "kept")
            self.stats[key] += 1
            out = a + (f" {ev['gain']:+.2%}" if "gain" in ev else "") + (f" [{ev.get('check')}]" if a == "reject" else "")
            if self.rows and self.rows[-1][1] == str(ev.get("version")):
                self.rows[-1][3] = out
            else:
                self.rows.append([str(ev.get("step", "")), str(ev.get("version")), "(resumed)", out])
        elif ev["type"] in ("lineage", "stop", "final"):
            self.rows.append(["", "", f"{ev['type']}: " + ", ".join(f"{k}={v}" for k, v in ev.items()
                                                                    if k not in ("type", "per_workload"))[:90], ""])
        if live is not None:
            live.update(self.table())


def cmd_run(args) -> int:
    from rich.live import Live  # lazy: rich is heavy and every CLI command imports this module
    _need_db(args.db)
    proposer = _proposer(args)
    store = _store(args.db)
    _need_run(store, args.db, args.name)
    ev = Evaluator(_workdir(args.db), timeout_s=args.timeout)
    budget = Budget(max_candidates=args.max_candidates, minutes=args.minutes, tokens=args.token_budget_run,
                    stagnation=args.stagnation)
    view = _Live(args.name)
    try:
        if args.no_live:
            summ = run_loop(store, args.name, proposer, ev, budget,
                            on_event=lambda e: print(json.dumps(e, default=str)))
        else:
            with Live(view.table(), console=view.console, refresh_per_second=4) as live:
                summ = run_loop(store, args.name, proposer, ev, budget, on_event=lambda e: view(e, live))
    finally:
        ev.close()
    fin = summ.get("final") or {}
    label = "SIMULATED " if summ["SIMULATED"] else ""
    print(f"stopped: {summ['stop_reason']}; best version {summ['best']['id']}; {label}speedup vs root "
          f"{fin.get('speedup', float('nan')):.3f}x")
    return 0


def cmd_status(args) -> int:
    _need_db(args.db)
    store = _store(args.db, read_only=True)
    sums = [summarize(store, r.id) for r in store.runs() if not args.name or r.name == args.name]
    if args.json:
        print_json(sums)
        return 0
    # lazy: rich is heavy and every CLI command imports this module
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"agent runs in {args.db}")
    for c in ("run", "op", "timer", "status", "versions", "verified/failed", "best", "speedup", "noise", "tokens"):
        t.add_column(c)
    for s in sums:
        sp = (s.get("final") or {}).get("speedup")
        t.add_row(s["run"], s["op"], ("[red]SIMULATED[/red]" if s["SIMULATED"] else "gpu"), str(s["status"]),
                  str(s["versions"]), f"{s['by_status'].get('verified', 0)}/{s['by_status'].get('failed', 0)}",
                  str(s["best"]["id"] if s["best"] else "-"), f"{sp:.3f}x" if sp else "-",
                  f"{s['noise_floor']:.2%}" if s["noise_floor"] else "-", str(s["tokens"]))
    Console().print(t)
    return 0


def cmd_show(args) -> int:
    _need_db(args.db)
    store = _store(args.db, read_only=True)
    run = _need_run(store, args.db, args.name)
    if args.plot:
        print(plot_lineage(store, args.name, args.plot))
    if args.version is not None:
        v = store.version(args.version)
        if v is None:
            raise UsageError(f"--version {args.version}: no such version in {args.db}")
        out = {"version": v.to_dict(), "checks": [c.to_dict() for c in store.checks(v.id)],
               "decisions": [d.to_dict() for d in store.decisions(run.id, v.id)],
               "measurements": [m.to_dict() for m in store.measurements(v.id)], "lineage": store.lineage(v.id)}
        if not args.source:
            out["version"]["source"] = f"<{len(v.source)} chars; --source to print>"
    else:
        out = summarize(store, run.id)
        out["decision_log"] = [f"[{d.step}] {d.action} v{d.version_id}: {d.reason}" for d in store.decisions(run.id)]
    print_json(out)
    return 0


def cmd_export(args) -> int:
    _need_db(args.db)
    store = _store(args.db, read_only=True)
    _need_run(store, args.db, args.name)
    try:
        r = export_best(store, args.name, out_dir=args.out_dir)
    except ExportRefused as e:
        raise UsageError(f"export refused: {e}") from None
    print(json.dumps(r, indent=1))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("agent", help="optimization agent: init | run | status | show | export",
                       description="The kernel optimisation agent: proposes kernel versions, checks each one (bitwise "
                                   "regimes, float64 bound, poisoned outputs) in a separate process, times it against "
                                   "the incumbent and keeps the evidence in a SQLite file. init, then run; status and "
                                   "show read the file; export writes the best verified version into the package.")
    asub = p.add_subparsers(dest="agent_cmd", metavar="ACTION")

    def common(q, name=True):
        q.add_argument("--db", default=DEFAULT_DB, help="SQLite file holding the runs")
        if name:
            q.add_argument("--name", default="run", help="run name")

    def proposer_args(q):
        q.add_argument("--proposer", choices=["offline", "llm", "replay"], default="offline",
                       help="offline: known moves and transformations, no tokens; llm: an OpenAI-compatible model; "
                            "replay: a scripted list (tests)")
        q.add_argument("--base-url", default=None, help="llm: OpenAI-compatible base URL (else OPENAI_BASE_URL)")
        q.add_argument("--model", default=None, help="llm: model name (required with --proposer llm)")
        q.add_argument("--token-budget", type=int, default=2_000_000, help="llm: total tokens for the run")
        q.add_argument("--script", default=None, help="replay: JSON list of {source, meta, description}")
        q.add_argument("--timeout", type=float, default=600.0, help="seconds per evaluation before the worker is killed")

    q = asub.add_parser("init", help="qualify the root, freeze contract + workloads, measure the noise floor",
                        description="Start a run: check the root kernel, freeze the contract and the workloads, "
                                    "measure the timing noise floor.")
    common(q)
    proposer_args(q)
    q.add_argument("--op", default="linear",
                   help="linear (naive Triton root) or rms_norm (root: csrc/tik_elementwise.cu, cuda_inline; GPU only)")
    q.add_argument("--preset", default="qwen2.5-1.5b", help="workload preset (qwen2.5-1.5b, tiny)")
    q.add_argument("--timer", choices=["auto", "gpu", "simulated"], default="auto",
                   help="gpu: CUDA events; simulated: a cost model (CPU tests); auto: gpu when there is one")
    q.set_defaults(func=cmd_init)

    q = asub.add_parser("run", help="run (or resume) the loop",
                        description="Propose, check and time kernel versions until a budget or stagnation stops it; "
                                    "resumes where the run stopped.")
    common(q)
    proposer_args(q)
    q.add_argument("--max-candidates", type=int, default=None, help="stop after this many candidates (default: no limit)")
    q.add_argument("--minutes", type=float, default=None, help="stop after this many minutes (default: no limit)")
    q.add_argument("--token-budget-run", type=int, default=None, help="stop after this many tokens in this invocation")
    q.add_argument("--stagnation", type=int, default=16, help="stop after this many candidates in a row without a gain")
    q.add_argument("--no-live", action="store_true", help="print events as JSON lines instead of the live table")
    q.set_defaults(func=cmd_run)

    q = asub.add_parser("status", help="table of runs", description="One row per run in the file: candidates, "
                                                                     "promotions, best speed-up, tokens spent.")
    common(q, name=False)
    q.add_argument("--name", default=None, help="only this run (default: every run)")
    q.add_argument("--json", action="store_true", help="print JSON instead of the table")
    q.set_defaults(func=cmd_status)

    q = asub.add_parser("show", help="summary and decision log, or one version's evidence",
                        description="A run's summary and decision log, or, with --version, one kernel version's "
                                    "checks and timings.")
    common(q)
    q.add_argument("--version", type=int, default=None, help="show this kernel version's evidence")
    q.add_argument("--source", action="store_true", help="with --version: print its source too")
    q.add_argument("--plot", default=None, help="write the lineage plot (PNG) here")
    q.set_defaults(func=cmd_show)

    q = asub.add_parser("export", help="write the best verified version into areal_tik/kernels/exported/",
                        description="Write the run's best verified kernel version, with its provenance, where the "
                                    "package loads it.")
    common(q)
    q.add_argument("--out-dir", default=None, help="write here instead (default: areal_tik/kernels/exported/)")
    q.set_defaults(func=cmd_export)
    p.set_defaults(func=lambda a: (p.print_help(), 0)[1], agent_cmd=None)
