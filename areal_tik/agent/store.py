"""SQLite store of the optimization IR: queries and transactions. Persistence only, no policy.

The schema and its add-only migration are :mod:`areal_tik.agent.schema`. :meth:`Store.open`
sets WAL journaling and a busy timeout, then creates missing tables and indexes and adds the
columns an older file lacks. Readers may open with ``read_only=True`` (a ``mode=ro`` URI:
writes raise ``sqlite3.OperationalError``).

Every agent step writes inside one :meth:`Store.transaction` (``BEGIN IMMEDIATE``), so
a killed process leaves the file at the end of its last complete step. Transient
"database is locked" errors are retried (:func:`db_retry`).
"""
from __future__ import annotations

import contextlib
import functools
import json as _json
import os
import sqlite3
import time
from typing import Iterator, Type, TypeVar

from areal_tik.agent import schema
from areal_tik.agent.records import (Branch, CheckResult, Contract, Decision, Edge, KernelVersion, Measurement,
                                     Opportunity, ProposerCall, Record, Run, Workload, canonical_json)

__all__ = ["Store", "db_retry"]

R = TypeVar("R", bound=Record)


def db_retry(fn=None, *, attempts: int = 8, delay: float = 0.05):
    """Retry ``fn`` on transient ``database is locked/busy`` errors with backoff."""
    if fn is None:
        return functools.partial(db_retry, attempts=attempts, delay=delay)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        for i in range(attempts):
            try:
                return fn(*a, **kw)
            except sqlite3.OperationalError as e:
                msg = str(e).lower()
                if ("locked" not in msg and "busy" not in msg) or i == attempts - 1:
                    raise
                time.sleep(delay * (2 ** i))
    return wrapper


class Store:
    """One SQLite file holding any number of runs."""

    def __init__(self, path: str, read_only: bool = False, busy_timeout_ms: int = 30000):
        self.path = os.path.abspath(path)
        self.read_only = read_only
        if read_only:
            if not os.path.exists(self.path):
                raise FileNotFoundError(self.path)
            self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=busy_timeout_ms / 1000,
                                        isolation_level=None, check_same_thread=False)
        else:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.conn = sqlite3.connect(self.path, timeout=busy_timeout_ms / 1000, isolation_level=None,
                                        check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        self._depth = 0
        if not read_only:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self._create_tables()

    @classmethod
    def open(cls, path: str, read_only: bool = False) -> "Store":
        return cls(path, read_only=read_only)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- schema (areal_tik.agent.schema) ----------------------------------------------
    @db_retry
    def _create_tables(self) -> None:
        with self.transaction():
            schema.create(self.conn)

    def _migrate(self) -> list[str]:
        """Add every schema column an older file lacks. Only adds; returns what it added."""
        return schema.migrate(self.conn)

    def journal_mode(self) -> str:
        return self.conn.execute("PRAGMA journal_mode").fetchone()[0]

    def busy_timeout(self) -> int:
        return int(self.conn.execute("PRAGMA busy_timeout").fetchone()[0])

    # ---- transactions -------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator["Store"]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (rollback on error). Nested calls join the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        for i in range(8):
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e).lower() or i == 7:
                    raise
                time.sleep(0.05 * 2 ** i)
        self._depth = 1
        try:
            yield self
        except BaseException:
            self._depth = 0
            self.conn.execute("ROLLBACK")
            raise
        self._depth = 0
        self.conn.execute("COMMIT")

    # ---- generic ------------------------------------------------------------------------
    def _insert(self, rec: R, or_ignore: bool = False) -> R:
        row = rec.to_row()
        row.pop("id", None)
        if hasattr(rec, "created") and not row.get("created"):
            row["created"] = time.time()
            rec.created = row["created"]
        cols = ", ".join(f'"{c}"' for c in row)
        qs = ", ".join("?" for _ in row)
        verb = "INSERT OR IGNORE" if or_ignore else "INSERT"
        with self.transaction():
            cur = self.conn.execute(f'{verb} INTO "{rec.TABLE}" ({cols}) VALUES ({qs})', list(row.values()))
            if or_ignore and cur.rowcount == 0:
                return None  # type: ignore[return-value]
            rec.id = cur.lastrowid
        return rec

    def _update(self, table: str, id_: int, **fields) -> None:
        if not fields:
            return
        sets = ", ".join(f'"{k}" = ?' for k in fields)
        with self.transaction():
            self.conn.execute(f'UPDATE "{table}" SET {sets} WHERE id = ?', [*fields.values(), id_])

    def _select(self, cls: Type[R], where: str = "1", params: tuple = (), order: str = "id") -> list[R]:
        rows = self.conn.execute(f'SELECT * FROM "{cls.TABLE}" WHERE {where} ORDER BY {order}', params).fetchall()
        return [cls.from_row(r) for r in rows]

    def _one(self, cls: Type[R], where: str, params: tuple) -> R | None:
        r = self._select(cls, where, params)
        return r[0] if r else None

    # ---- runs ---------------------------------------------------------------------------
    def add_run(self, run: Run) -> Run:
        return self._insert(run)

    def run(self, name_or_id) -> Run | None:
        if isinstance(name_or_id, int):
            return self._one(Run, "id = ?", (name_or_id,))
        return self._one(Run, "name = ?", (name_or_id,))

    def runs(self) -> list[Run]:
        return self._select(Run)

    def update_run(self, run_id: int, **fields) -> None:
        for k in ("env", "config"):
            if k in fields:
                fields[k + "_json"] = canonical_json(fields.pop(k))
        self._update("runs", run_id, **fields)

    # ---- kernel versions and edges ------------------------------------------------------
    def add_version(self, v: KernelVersion) -> KernelVersion:
        return self._insert(v)

    def version(self, vid: int) -> KernelVersion | None:
        return self._one(KernelVersion, "id = ?", (vid,))

    def version_by_hash(self, run_id: int, h: str) -> KernelVersion | None:
        return self._one(KernelVersion, "run_id = ? AND hash = ?", (run_id, h))

    def versions(self, run_id: int, status: str | None = None) -> list[KernelVersion]:
        if status is None:
            return self._select(KernelVersion, "run_id = ?", (run_id,))
        return self._select(KernelVersion, "run_id = ? AND status = ?", (run_id, status))

    def set_version_status(self, vid: int, status: str, weighted_latency_us: float | None = None) -> None:
        f = {"status": status}
        if weighted_latency_us is not None:
            f["weighted_latency_us"] = weighted_latency_us
        self._update("kernel_versions", vid, **f)

    def add_edge(self, e: Edge) -> Edge:
        return self._insert(e, or_ignore=True)

    def edges(self, run_id: int) -> list[Edge]:
        return self._select(Edge, "run_id = ?", (run_id,))

    def lineage(self, vid: int) -> list[int]:
        """Version ids from ``vid`` back to the root along 'derived' edges."""
        out, cur, seen = [], vid, set()
        while cur is not None and cur not in seen:
            seen.add(cur)
            out.append(cur)
            r = self.conn.execute("SELECT parent_id FROM edges WHERE child_id = ? AND relation = 'derived'",
                                  (cur,)).fetchone()
            cur = r[0] if r else None
        return out

    # ---- contract and workloads ---------------------------------------------------------
    def freeze_contract(self, c: Contract) -> Contract:
        if self.contract(c.run_id) is not None:
            raise ValueError(f"run {c.run_id} already has a frozen contract")
        c.frozen_at = c.frozen_at or time.time()
        return self._insert(c)

    def contract(self, run_id: int) -> Contract | None:
        return self._one(Contract, "run_id = ?", (run_id,))

    def add_workload(self, w: Workload) -> Workload:
        return self._insert(w)

    def workloads(self, run_id: int) -> list[Workload]:
        return self._select(Workload, "run_id = ?", (run_id,))

    # ---- evidence -----------------------------------------------------------------------
    def add_check(self, c: CheckResult) -> CheckResult:
        return self._insert(c)

    def checks(self, vid: int) -> list[CheckResult]:
        return self._select(CheckResult, "version_id = ?", (vid,))

    def add_measurement(self, m: Measurement) -> Measurement:
        return self._insert(m)

    def measurements(self, vid: int | None = None, run_id: int | None = None,
                     session: str | None = None) -> list[Measurement]:
        where, p = [], []
        for col, val in (("version_id", vid), ("run_id", run_id), ("session", session)):
            if val is not None:
                where.append(f"{col} = ?")
                p.append(val)
        return self._select(Measurement, " AND ".join(where) or "1", tuple(p))

    # ---- opportunities ------------------------------------------------------------------
    def add_opportunity(self, o: Opportunity) -> Opportunity | None:
        """Insert unless (run, parent, key) exists; returns None for a duplicate."""
        return self._insert(o, or_ignore=True)

    def opportunity(self, oid: int) -> Opportunity | None:
        return self._one(Opportunity, "id = ?", (oid,))

    def opportunities(self, run_id: int, status: str | None = None, parent_id: int | None = None) -> list[Opportunity]:
        where, p = ["run_id = ?"], [run_id]
        if status is not None:
            where.append("status = ?")
            p.append(status)
        if parent_id is not None:
            where.append("parent_id = ?")
            p.append(parent_id)
        return self._select(Opportunity, " AND ".join(where), tuple(p), order="priority DESC, id")

    def opportunity_outcomes(self, run_id: int) -> dict[str, list[tuple[str, dict]]]:
        """opportunity key -> [(decision action, decision data)] of the candidates it produced."""
        rows = self.conn.execute(
            "SELECT o.key, d.action, d.data_json FROM opportunities o "
            "JOIN kernel_versions v ON v.opportunity_id = o.id JOIN decisions d ON d.version_id = v.id "
            "WHERE o.run_id = ? AND d.action IN ('reject', 'keep', 'promote', 'branch') ORDER BY d.id",
            (run_id,)).fetchall()
        out: dict = {}
        for k, a, dj in rows:
            out.setdefault(k, []).append((a, _json.loads(dj) if dj else {}))
        return out

    def set_opportunity_status(self, oid: int, status: str) -> None:
        self._update("opportunities", oid, status=status, closed=time.time() if status != "open" else None)

    # ---- branches -----------------------------------------------------------------------
    def add_branch(self, b: Branch) -> Branch:
        b.updated = b.updated or time.time()
        return self._insert(b)

    def branch(self, bid: int) -> Branch | None:
        return self._one(Branch, "id = ?", (bid,))

    def branches(self, run_id: int, status: str | None = None) -> list[Branch]:
        if status is None:
            return self._select(Branch, "run_id = ?", (run_id,))
        return self._select(Branch, "run_id = ? AND status = ?", (run_id, status))

    def update_branch(self, bid: int, **fields) -> None:
        fields["updated"] = time.time()
        self._update("branches", bid, **fields)

    # ---- decisions and proposer calls ---------------------------------------------------
    def add_decision(self, d: Decision) -> Decision:
        return self._insert(d)

    def decisions(self, run_id: int, version_id: int | None = None) -> list[Decision]:
        if version_id is None:
            return self._select(Decision, "run_id = ?", (run_id,))
        return self._select(Decision, "run_id = ? AND version_id = ?", (run_id, version_id))

    def add_proposer_call(self, c: ProposerCall) -> ProposerCall:
        return self._insert(c)

    def proposer_calls(self, run_id: int) -> list[ProposerCall]:
        return self._select(ProposerCall, "run_id = ?", (run_id,))

    def tokens_used(self, run_id: int) -> int:
        r = self.conn.execute("SELECT COALESCE(SUM(total_tokens), 0) FROM proposer_calls WHERE run_id = ?",
                              (run_id,)).fetchone()
        return int(r[0])

    def last_step(self, run_id: int) -> int:
        r = self.conn.execute("SELECT COALESCE(MAX(step), 0) FROM kernel_versions WHERE run_id = ?",
                              (run_id,)).fetchone()
        return int(r[0])
