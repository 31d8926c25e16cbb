"""The SQLite schema of the optimization IR, in one place (:data:`SCHEMA`, :data:`INDEXES`), and
its add-only migration: :func:`create` makes missing tables and indexes, :func:`migrate` only
ever *adds* columns that an older file lacks (checked with ``PRAGMA table_info``); nothing is
renamed or dropped. :class:`areal_tik.agent.store.Store` runs both when it opens a file.
"""
from __future__ import annotations

import sqlite3

__all__ = ["SCHEMA", "SCHEMA_VERSION", "INDEXES", "create", "migrate"]

SCHEMA_VERSION = 1

# table -> ordered (column, declaration). Migrations add any column missing from a file.
SCHEMA: dict[str, list[tuple[str, str]]] = {
    "meta": [("key", "TEXT PRIMARY KEY"), ("value", "TEXT")],
    "runs": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("name", "TEXT NOT NULL UNIQUE"),
        ("op", "TEXT NOT NULL"), ("kind", "TEXT NOT NULL"), ("timer", "TEXT NOT NULL"),
        ("device", "TEXT"), ("env_json", "TEXT"), ("config_json", "TEXT"),
        ("status", "TEXT NOT NULL"), ("noise_floor", "REAL"), ("root_version", "INTEGER"),
        ("best_version", "INTEGER"), ("stop_reason", "TEXT"), ("created", "REAL"),
    ],
    "kernel_versions": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL REFERENCES runs(id)"),
        ("op", "TEXT NOT NULL"), ("kind", "TEXT NOT NULL"), ("source", "TEXT NOT NULL"),
        ("meta_json", "TEXT NOT NULL"), ("hash", "TEXT NOT NULL"), ("status", "TEXT NOT NULL"),
        ("origin", "TEXT"), ("step", "INTEGER"), ("parent_id", "INTEGER"), ("branch_id", "INTEGER"),
        ("opportunity_id", "INTEGER"), ("description", "TEXT"), ("weighted_latency_us", "REAL"),
        ("created", "REAL"),
    ],
    "edges": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"),
        ("parent_id", "INTEGER NOT NULL"), ("child_id", "INTEGER NOT NULL"), ("relation", "TEXT NOT NULL"),
    ],
    "contracts": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL UNIQUE"),
        ("op", "TEXT NOT NULL"), ("spec_json", "TEXT NOT NULL"), ("hash", "TEXT NOT NULL"),
        ("frozen_at", "REAL"),
    ],
    "workloads": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"),
        ("name", "TEXT NOT NULL"), ("shape_json", "TEXT NOT NULL"), ("weight", "REAL NOT NULL"),
        ("regression_limit", "REAL NOT NULL"),
    ],
    "check_results": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"),
        ("version_id", "INTEGER NOT NULL"), ("check", "TEXT NOT NULL"), ("passed", "INTEGER NOT NULL"),
        ("shape", "TEXT"), ("detail_json", "TEXT"), ("created", "REAL"),
    ],
    "measurements": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"),
        ("version_id", "INTEGER NOT NULL"), ("workload_id", "INTEGER NOT NULL"), ("session", "TEXT NOT NULL"),
        ("latency_us", "REAL NOT NULL"), ("samples_json", "TEXT"), ("simulated", "INTEGER NOT NULL"),
        ("role", "TEXT"), ("created", "REAL"),
    ],
    "opportunities": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"),
        ("parent_id", "INTEGER NOT NULL"), ("key", "TEXT NOT NULL"), ("kind", "TEXT NOT NULL"),
        ("description", "TEXT"), ("payload_json", "TEXT"), ("priority", "REAL"),
        ("status", "TEXT NOT NULL"), ("created", "REAL"), ("closed", "REAL"),
    ],
    "branches": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"),
        ("name", "TEXT NOT NULL"), ("base_version", "INTEGER NOT NULL"), ("head_version", "INTEGER NOT NULL"),
        ("status", "TEXT NOT NULL"), ("attempts", "INTEGER"), ("failures", "INTEGER"),
        ("since_improvement", "INTEGER"), ("created", "REAL"), ("updated", "REAL"),
    ],
    "decisions": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"), ("step", "INTEGER NOT NULL"),
        ("action", "TEXT NOT NULL"), ("reason", "TEXT NOT NULL"), ("version_id", "INTEGER"),
        ("branch_id", "INTEGER"), ("data_json", "TEXT"), ("created", "REAL"),
    ],
    "proposer_calls": [
        ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"), ("run_id", "INTEGER NOT NULL"), ("step", "INTEGER"),
        ("proposer", "TEXT NOT NULL"), ("model", "TEXT"), ("prompt_tokens", "INTEGER"),
        ("completion_tokens", "INTEGER"), ("total_tokens", "INTEGER"), ("latency_s", "REAL"),
        ("ok", "INTEGER"), ("error", "TEXT"), ("version_id", "INTEGER"), ("opportunity_id", "INTEGER"),
        ("created", "REAL"),
    ],
}

INDEXES = [
    "CREATE UNIQUE INDEX IF NOT EXISTS ux_versions_hash ON kernel_versions(run_id, hash)",
    "CREATE INDEX IF NOT EXISTS ix_versions_status ON kernel_versions(run_id, status)",
    "CREATE UNIQUE INDEX IF NOT EXISTS ux_edges ON edges(parent_id, child_id, relation)",
    "CREATE UNIQUE INDEX IF NOT EXISTS ux_workloads ON workloads(run_id, name)",
    "CREATE INDEX IF NOT EXISTS ix_checks_version ON check_results(version_id)",
    "CREATE INDEX IF NOT EXISTS ix_meas_version ON measurements(version_id, session)",
    "CREATE UNIQUE INDEX IF NOT EXISTS ux_opps ON opportunities(run_id, parent_id, key)",
    "CREATE INDEX IF NOT EXISTS ix_opps_status ON opportunities(run_id, status)",
    "CREATE INDEX IF NOT EXISTS ix_decisions ON decisions(run_id, step)",
]


def _create_sql(table: str, cols: list[tuple[str, str]]) -> str:
    quoted = ", ".join(f'"{c}" {decl}' for c, decl in cols)
    return f'CREATE TABLE IF NOT EXISTS "{table}" ({quoted})'


def _addable(decl: str) -> str:
    """A column declaration usable by ALTER TABLE ADD COLUMN (no PK/UNIQUE/NOT NULL without default)."""
    d = decl.replace("PRIMARY KEY AUTOINCREMENT", "").replace("PRIMARY KEY", "").replace("UNIQUE", "")
    return d.replace("NOT NULL", "").strip() or "TEXT"


def create(conn: sqlite3.Connection) -> None:
    """Create missing tables, add missing columns (:func:`migrate`), create missing indexes and
    record the schema version. Call inside a transaction."""
    for table, cols in SCHEMA.items():
        conn.execute(_create_sql(table, cols))
    migrate(conn)
    for sql in INDEXES:
        conn.execute(sql)
    conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                 (str(SCHEMA_VERSION),))


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Add every schema column an older file lacks. Only adds; returns what it added."""
    added = []
    for table, cols in SCHEMA.items():
        have = {r["name"] for r in conn.execute(f'PRAGMA table_info("{table}")')}
        for c, decl in cols:
            if c not in have:
                conn.execute(f'ALTER TABLE "{table}" ADD COLUMN "{c}" {_addable(decl)}')
                added.append(f"{table}.{c}")
    return added
