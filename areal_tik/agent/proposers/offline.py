"""The ``offline`` proposer: zero tokens, deterministic. Meta-parameter search (per-M buckets
of block sizes, warps, stages, group size, programs per SM) from H200-oriented priors, the
build-time defines of a csrc root, and the known transformations of :mod:`.transforms`."""
from __future__ import annotations

import copy
import json

from areal_tik.agent.kinds import regions
from areal_tik.agent.proposers.base import Proposal, Proposer
from areal_tik.agent.proposers.transforms import TRANSFORM_PRIORITY, TRANSFORMS, is_applied, apply_transform


SPACE = {
    "BLOCK_M": [16, 32, 64, 128, 256],
    "BLOCK_N": [16, 32, 64, 128, 256],
    "BLOCK_K": [32, 64, 128],
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3, 4, 5, 6],
    "GROUP_M": [1, 4, 8, 16],
    "PROGS_PER_SM": [1, 2, 3],
}
# Priors for an H100/H200-class GPU by M range (decode / mid / prefill-training).
PRIORS = {
    "small": [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=5, GROUP_M=1),
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, GROUP_M=1),
              dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=1)],
    "mid": [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=8),
            dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=8),
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=8)],
    "large": [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=8),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=8),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=8)],
}


def _m_class(max_m) -> str:
    if max_m is not None and max_m <= 32:
        return "small"
    if max_m is not None and max_m <= 512:
        return "mid"
    return "large"


def valid_config(cfg: dict, smem_limit: int = 220 * 1024) -> bool:
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    smem = (bm * bk + bk * bn) * 2 * max(1, cfg["num_stages"])
    acc_regs = bm * bn / (cfg["num_warps"] * 32)
    return smem <= smem_limit and acc_regs <= 256 and bm * bn >= 16 * 32 and bm * bn <= 256 * 256


def _bucket_of(meta: dict, m: int) -> int:
    for i, b in enumerate(meta["buckets"]):
        if b.get("max_m") is None or m <= b["max_m"]:
            return i
    return len(meta["buckets"]) - 1


class OfflineProposer(Proposer):
    """Meta-parameter search + known transformations; zero tokens, deterministic."""

    name = "offline"

    def __init__(self, priors: dict | None = None, max_prior_variants: int = 3):
        self.priors = priors or PRIORS
        self.max_prior_variants = max_prior_variants

    def opportunities(self, task, version, context: dict) -> list[dict]:
        meta, src = version.meta, version.source
        if "defines" in meta:
            return self._define_moves(task, meta) + self._transform_moves(src)
        if "buckets" not in meta:
            return []
        workloads = context.get("workloads", [])
        lat = context.get("latency", {})        # workload id -> us for this version (if measured)
        ops = []
        # 1. specialise the M buckets to the workloads' M values, starting from priors
        ms = sorted({w.shape["M"] for w in workloads})
        bounds = ms[:-1] + [None]
        have = [b.get("max_m") for b in meta["buckets"]]
        if ms and have != bounds:
            for v in range(self.max_prior_variants):
                buckets = []
                for mx in bounds:
                    pri = self.priors[_m_class(mx)]
                    cfg = dict(pri[min(v, len(pri) - 1)])
                    if v == 0:  # one shared BLOCK_K: the safest choice for bitwise equality across buckets
                        cfg["BLOCK_K"] = 64
                    buckets.append({"max_m": mx, **cfg})
                ops.append({"key": f"buckets:{json.dumps(bounds)}:prior{v}", "kind": "meta",
                            "description": f"specialise M buckets {bounds} with prior set {v}",
                            "payload": {"set_buckets": buckets}, "priority": 100.0 - v})
        # 2. code transformations not applied yet
        ops += self._transform_moves(src)
        # 3. per-bucket moves, weighted by the bucket's share of the weighted latency
        share = [0.0] * len(meta["buckets"])
        for w in workloads:
            t = lat.get(str(w.id), lat.get(w.id, 1.0))
            share[_bucket_of(meta, w.shape["M"])] += w.weight * t
        tot = sum(share) or 1.0
        share = [s / tot for s in share]
        persistent = is_applied(src, "persistent")
        for bi, b in enumerate(meta["buckets"]):
            if share[bi] == 0.0:
                continue
            for v, pri in enumerate(self.priors[_m_class(b.get("max_m"))]):
                cfg = {**b, **pri}
                if cfg != b:
                    ops.append({"key": f"b{bi}:prior{v}:{json.dumps(pri, sort_keys=True)}", "kind": "meta",
                                "description": f"bucket {bi} (M<={b.get('max_m')}): prior config {v}",
                                "payload": {"bucket": bi, "set": pri}, "priority": 30.0 * share[bi] - v})
            for p, vals in SPACE.items():
                if p == "PROGS_PER_SM" and not persistent:
                    continue
                cur = b.get(p, 1 if p in ("GROUP_M", "PROGS_PER_SM") else None)
                if cur not in vals:
                    continue
                i = vals.index(cur)
                for j in (i - 1, i + 1):
                    if 0 <= j < len(vals):
                        cand = {**b, p: vals[j]}
                        if not valid_config(cand):
                            continue
                        bonus = {"BLOCK_N": 2, "BLOCK_M": 2, "num_stages": 1.5, "BLOCK_K": 1,
                                 "num_warps": 1}.get(p, 0.5)
                        ops.append({"key": f"b{bi}:{p}={vals[j]}", "kind": "meta",
                                    "description": f"bucket {bi} (M<={b.get('max_m')}): {p} {cur} -> {vals[j]}",
                                    "payload": {"bucket": bi, "set": {p: vals[j]}},
                                    "priority": 10.0 * share[bi] + bonus})
        return ops

    @staticmethod
    def _transform_moves(src: str) -> list[dict]:
        """Known transformations whose regions the source has and that are not applied yet."""
        regs = regions(src)
        return [{"key": f"transform:{name}", "kind": "transform",
                 "description": f"apply transformation '{name}' to region <tik:{region}>",
                 "payload": {"transform": name}, "priority": TRANSFORM_PRIORITY[name]}
                for name, (region, _) in TRANSFORMS.items() if region in regs and not is_applied(src, name)]

    @staticmethod
    def _define_moves(task, meta: dict) -> list[dict]:
        """Build-time knobs of a csrc root (``task.tunables``: define -> ordered values): one step either way."""
        ops = []
        for name, vals in getattr(task, "tunables", {}).items():
            cur = meta["defines"].get(name)
            if cur not in vals:
                continue
            i = vals.index(cur)
            for j in (i - 1, i + 1):
                if 0 <= j < len(vals):
                    ops.append({"key": f"define:{name}={vals[j]}", "kind": "meta",
                                "description": f"{name} {cur} -> {vals[j]}",
                                "payload": {"set_defines": {name: vals[j]}}, "priority": 10.0 - abs(j - i) * 0.1})
        return ops

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        p = opportunity.payload
        src, meta = parent.source, copy.deepcopy(parent.meta)
        try:
            if "set_defines" in p:
                meta["defines"].update(p["set_defines"])
            if "transform" in p:
                src = apply_transform(src, p["transform"])
            if "set_buckets" in p:
                meta["buckets"] = copy.deepcopy(p["set_buckets"])
            if "bucket" in p:
                meta["buckets"][p["bucket"]].update(p["set"])
        except (KeyError, IndexError) as e:
            return Proposal(None, None, error=f"not applicable: {e}")
        return Proposal(src, meta, description=opportunity.description)
