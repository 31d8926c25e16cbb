"""Records of the optimization IR: one dataclass per table row, with to_dict/from_dict.

These mirror the rows of :mod:`areal_tik.agent.store` exactly (JSON columns become
dicts/lists here). They carry no policy; :mod:`roles` decides, the store persists.
Failures are data: a failed :class:`KernelVersion` keeps its source, its
:class:`CheckResult` rows say why, and its status stays ``failed`` forever (never a parent).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar

__all__ = [
    "Record", "Run", "KernelVersion", "Edge", "Contract", "Workload", "CheckResult",
    "Measurement", "Opportunity", "Branch", "Decision", "ProposerCall", "content_hash",
    "canonical_json", "VERSION_STATUSES", "OPPORTUNITY_STATUSES", "BRANCH_STATUSES",
]

VERSION_STATUSES = ("pending", "verified", "failed")
OPPORTUNITY_STATUSES = ("open", "consumed", "withdrawn")
BRANCH_STATUSES = ("active", "merged", "archived", "abandoned")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def content_hash(kind: str, op: str, source: str, meta: dict) -> str:
    """sha256 over kind, op, source text and canonical meta JSON (hex, 16 chars)."""
    h = hashlib.sha256()
    for part in (kind, op, source, canonical_json(meta)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class Record:
    """Base: ``JSON_FIELDS`` are stored as TEXT columns named ``<field>_json``."""

    TABLE: ClassVar[str] = ""
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_row(self) -> dict:
        row = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self.JSON_FIELDS:
                row[f.name + "_json"] = canonical_json(v)
            elif isinstance(v, bool):
                row[f.name] = int(v)
            else:
                row[f.name] = v
        return row

    @classmethod
    def from_row(cls, row) -> "Record":
        d = dict(row)
        out = {}
        for f in dataclasses.fields(cls):
            if f.name in cls.JSON_FIELDS:
                raw = d.get(f.name + "_json")
                out[f.name] = json.loads(raw) if raw is not None else None
            elif f.name in d:
                out[f.name] = d[f.name]
        rec = cls(**out)
        for f in dataclasses.fields(cls):
            if f.type in ("bool", bool) and getattr(rec, f.name) is not None:
                setattr(rec, f.name, bool(getattr(rec, f.name)))
        return rec


@dataclasses.dataclass
class Run(Record):
    """One optimization run of one op from one root, with one timer."""
    TABLE: ClassVar[str] = "runs"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("env", "config")
    name: str
    op: str
    kind: str
    timer: str                      # "gpu" or "simulated" (simulated results are never exported)
    device: str = ""
    env: dict = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    status: str = "created"         # created / initialized / running / stopped
    noise_floor: float | None = None
    root_version: int | None = None
    best_version: int | None = None
    stop_reason: str | None = None
    created: float = 0.0
    id: int | None = None


@dataclasses.dataclass
class KernelVersion(Record):
    """A kernel = source text + meta-parameters, content-hashed (``hash``)."""
    TABLE: ClassVar[str] = "kernel_versions"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("meta",)
    run_id: int
    op: str
    kind: str
    source: str
    meta: dict
    hash: str = ""
    status: str = "pending"         # pending / verified / failed
    origin: str = ""                # root / offline / llm / replay
    step: int = 0
    parent_id: int | None = None
    branch_id: int | None = None
    opportunity_id: int | None = None
    description: str = ""
    weighted_latency_us: float | None = None
    created: float = 0.0
    id: int | None = None

    def __post_init__(self):
        if not self.hash:
            self.hash = content_hash(self.kind, self.op, self.source, self.meta)


@dataclasses.dataclass
class Edge(Record):
    TABLE: ClassVar[str] = "edges"
    run_id: int
    parent_id: int
    child_id: int
    relation: str = "derived"       # derived / merge
    id: int | None = None


@dataclasses.dataclass
class Contract(Record):
    """The frozen contract of a run: which checks, shapes, seeds and bounds judge a version."""
    TABLE: ClassVar[str] = "contracts"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("spec",)
    run_id: int
    op: str
    spec: dict
    hash: str = ""
    frozen_at: float = 0.0
    id: int | None = None

    def __post_init__(self):
        if not self.hash:
            self.hash = hashlib.sha256(canonical_json(self.spec).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Workload(Record):
    TABLE: ClassVar[str] = "workloads"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("shape",)
    run_id: int
    name: str
    shape: dict
    weight: float = 1.0
    regression_limit: float = 0.08  # max relative slowdown of this workload allowed at promotion
    id: int | None = None


@dataclasses.dataclass
class CheckResult(Record):
    TABLE: ClassVar[str] = "check_results"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("detail",)
    run_id: int
    version_id: int
    check: str
    passed: bool
    shape: str = ""
    detail: dict = dataclasses.field(default_factory=dict)
    created: float = 0.0
    id: int | None = None


@dataclasses.dataclass
class Measurement(Record):
    """Median latency of one version on one workload in one interleaved session."""
    TABLE: ClassVar[str] = "measurements"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("samples",)
    run_id: int
    version_id: int
    workload_id: int
    session: str
    latency_us: float
    samples: list = dataclasses.field(default_factory=list)
    simulated: bool = False
    role: str = "candidate"         # candidate / reference / noise
    created: float = 0.0
    id: int | None = None


@dataclasses.dataclass
class Opportunity(Record):
    """A hypothesis for improving ``parent_id``; ``key`` dedups it per parent."""
    TABLE: ClassVar[str] = "opportunities"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("payload",)
    run_id: int
    parent_id: int
    key: str
    kind: str
    description: str
    payload: dict = dataclasses.field(default_factory=dict)
    priority: float = 0.0
    status: str = "open"            # open / consumed / withdrawn
    created: float = 0.0
    closed: float | None = None
    id: int | None = None


@dataclasses.dataclass
class Branch(Record):
    TABLE: ClassVar[str] = "branches"
    run_id: int
    name: str
    base_version: int
    head_version: int
    status: str = "active"          # active / merged / archived / abandoned
    attempts: int = 0
    failures: int = 0
    since_improvement: int = 0
    created: float = 0.0
    updated: float = 0.0
    id: int | None = None


@dataclasses.dataclass
class Decision(Record):
    TABLE: ClassVar[str] = "decisions"
    JSON_FIELDS: ClassVar[tuple[str, ...]] = ("data",)
    run_id: int
    step: int
    action: str                     # qualify_root / promote / reject / keep / branch / merge / archive / abandon / duplicate / stop
    reason: str
    version_id: int | None = None
    branch_id: int | None = None
    data: dict = dataclasses.field(default_factory=dict)
    created: float = 0.0
    id: int | None = None


@dataclasses.dataclass
class ProposerCall(Record):
    TABLE: ClassVar[str] = "proposer_calls"
    run_id: int
    step: int
    proposer: str
    model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    latency_s: float = 0.0
    ok: bool = True
    error: str = ""
    version_id: int | None = None
    opportunity_id: int | None = None
    created: float = 0.0
    id: int | None = None
