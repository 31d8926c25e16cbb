"""Proposers: given a verified parent and an opportunity, return ONE complete candidate.

A candidate is complete source text plus meta-parameters (the agent's whole notion of a
kernel). Proposers are chosen by name (:func:`make_proposer`):

- ``offline``: zero tokens. Explores meta-parameters (per-M buckets of block sizes,
  warps, stages, group size, programs per SM) with H200-oriented priors, and applies
  known code transformations to ``<tik:...>`` regions of the source (grouped tile
  order, unmasked/pointer-increment K loop with EVEN_K specialisation, persistent
  schedule; for the csrc rms_norm: 16-byte vector loads, or the row held in registers).
  A transformation that does not find its region is not offered.
- ``llm``: an OpenAI-compatible chat endpoint (``openai`` package); base URL, model and
  key come from :class:`LLMConfig` (the CLI fills it from flags or environment); stops
  asking once the run's token budget is spent. Every call's token counts are recorded.
- ``replay``: returns scripted candidates in order (tests, and replaying an old run).

Opportunities (hypotheses) come from :meth:`Proposer.opportunities`; the loop stores
them and marks them consumed/withdrawn.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import time

from areal_tik.agent.kinds import regions, replace_region

__all__ = ["Proposal", "Proposer", "OfflineProposer", "ReplayProposer", "LLMProposer", "LLMConfig",
           "make_proposer", "TRANSFORMS"]


@dataclasses.dataclass
class Proposal:
    source: str | None
    meta: dict | None
    description: str = ""
    kind: str | None = None          # None: same kind as the parent
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    latency_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.source is not None and self.meta is not None


class Proposer:
    name = "?"

    def opportunities(self, task, version, context: dict) -> list[dict]:
        """Hypotheses for improving ``version``: dicts with key, kind, description, payload, priority."""
        return []

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        raise NotImplementedError


# ---------------------------------------------------------------- known transformations
# The csrc rms_norm's element loops over group c (the root's, at 4 spaces: inside a group loop inside a branch);
# the rms transformations keep them for the rows their vector paths do not take.
_RMS_SUMSQ_ELEMENTS = """\
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = c * 8 + e;
      if (idx < n) {
        const float v = to_f(xr[idx]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
      }
    }"""
_RMS_SCALE_ELEMENTS = """\
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = c * 8 + e;
      if (idx < n) {
        const float h = to_f(from_f<T>(__fmul_rn(to_f(xr[idx]), r)));
        yr[idx] = from_f<T>(__fmul_rn(to_f(w[idx]), h));
      }
    }"""
TRANSFORMS = {
    "grouped-order": ("tile-order", """\
num_pid_in_group = GROUP_M * num_pid_n
group_id = tile_id // num_pid_in_group
first_m = group_id * GROUP_M
group_size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
pid_m = first_m + (tile_id % num_pid_in_group) % group_size_m
pid_n = (tile_id % num_pid_in_group) // group_size_m"""),
    "unmasked-k-loop": ("k-loop", """\
# rows/cols past M/N wrap onto valid rows (computed, never stored): loads need no row mask
offs_am = offs_m % M
offs_wn = offs_n % N
a_ptrs = a_ptr + offs_am[:, None] * s_am + offs_k[None, :] * s_ak
b_ptrs = w_ptr + offs_wn[None, :] * s_wn + offs_k[:, None] * s_wk
for k0 in range(0, K, BLOCK_K):
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
        b = tl.load(b_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
    acc = tl.dot(a, b, acc)
    a_ptrs += BLOCK_K * s_ak
    b_ptrs += BLOCK_K * s_wk"""),
    "persistent": ("schedule", """\
num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
    _tile(tile_id, a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
          s_am, s_ak, s_wn, s_wk, s_cm, s_cn,
          HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K)"""),
    # csrc rms_norm (C++ regions of csrc/tik_elementwise.cu): 16-byte loads/stores of 8 elements where the row
    # allows (2-byte types, aligned, a whole group inside n); the same values in the same order as the element
    # loops, so the same sums and bits
    "vector-loads": ("rms-sumsq", """\
float ss = 0.f;
const bool vec = sizeof(T) == 2 && (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
for (int c = lane; c * 8 < n; c += 32) {
  if (vec && c * 8 + 8 <= n) {
    const uint4 u = *reinterpret_cast<const uint4*>(xr + c * 8);
    const T* e8 = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = to_f(e8[e]);
      ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
  } else {
""" + _RMS_SUMSQ_ELEMENTS + """
  }
}"""),
    # csrc rms_norm: a lane's whole share of the row (up to 16 groups of 8 = rows up to 4096 elements) loaded
    # into registers by 16-byte loads issued before the first add, then summed and scaled from registers: one
    # memory latency per row instead of one per loop trip, and x read once. Same values in the same order as
    # the element loops (groups lane, lane + 32, ..., elements ascending), so the same sums and bits; other
    # rows (4-byte types, unaligned, n not a multiple of 8, longer rows) keep the element loops.
    "row-registers": ("rms-sumsq", """\
float ss = 0.f;
constexpr int RG = 16;  // 16-byte groups per lane held in registers
const bool rg = sizeof(T) == 2 && (reinterpret_cast<uintptr_t>(xr) & 15) == 0 && n % 8 == 0 && n <= 256 * RG;
uint4 xg[RG];
if (rg) {
#pragma unroll
  for (int k = 0; k < RG; ++k)
    if ((lane + 32 * k) * 8 < n) xg[k] = __ldg(reinterpret_cast<const uint4*>(xr) + lane + 32 * k);
#pragma unroll
  for (int k = 0; k < RG; ++k) {
    if ((lane + 32 * k) * 8 < n) {
      const T* e8 = reinterpret_cast<const T*>(&xg[k]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float v = to_f(e8[e]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
      }
    }
  }
} else {
  for (int c = lane; c * 8 < n; c += 32) {
""" + _RMS_SUMSQ_ELEMENTS + """
  }
}"""),
}
_TRANSFORM_EXTRA = {"persistent": ("grid", "return (max(1, min(tiles, _num_sms(device) * cfg.get(\"PROGS_PER_SM\", 1))),)"),
                    "vector-loads": ("rms-scale", """\
const bool vec_o = sizeof(T) == 2 &&
                   ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(yr) | reinterpret_cast<uintptr_t>(w)) &
                    15) == 0;
for (int c = lane; c * 8 < n; c += 32) {
  if (vec_o && c * 8 + 8 <= n) {
    const uint4 ux = *reinterpret_cast<const uint4*>(xr + c * 8);
    const uint4 uw = *reinterpret_cast<const uint4*>(w + c * 8);
    const T* x8 = reinterpret_cast<const T*>(&ux);
    const T* w8 = reinterpret_cast<const T*>(&uw);
    uint4 uy;
    T* y8 = reinterpret_cast<T*>(&uy);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float h = to_f(from_f<T>(__fmul_rn(to_f(x8[e]), r)));
      y8[e] = from_f<T>(__fmul_rn(to_f(w8[e]), h));
    }
    *reinterpret_cast<uint4*>(yr + c * 8) = uy;
  } else {
""" + _RMS_SCALE_ELEMENTS + """
  }
}""")}
_TRANSFORM_EXTRA["row-registers"] = ("rms-scale", """\
if (rg && ((reinterpret_cast<uintptr_t>(yr) | reinterpret_cast<uintptr_t>(w)) & 15) == 0) {
#pragma unroll
  for (int k = 0; k < RG; ++k) {
    const int c = lane + 32 * k;
    if (c * 8 < n) {
      const uint4 uw = __ldg(reinterpret_cast<const uint4*>(w) + c);
      const T* x8 = reinterpret_cast<const T*>(&xg[k]);
      const T* w8 = reinterpret_cast<const T*>(&uw);
      uint4 uy;
      T* y8 = reinterpret_cast<T*>(&uy);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float h = to_f(from_f<T>(__fmul_rn(to_f(x8[e]), r)));
        y8[e] = from_f<T>(__fmul_rn(to_f(w8[e]), h));
      }
      reinterpret_cast<uint4*>(yr)[c] = uy;
    }
  }
} else {
  for (int c = lane; c * 8 < n; c += 32) {
""" + _RMS_SCALE_ELEMENTS + """
  }
}""")
_TRANSFORM_PRIORITY = {"unmasked-k-loop": 85.0, "grouped-order": 80.0, "persistent": 55.0, "vector-loads": 70.0,
                       "row-registers": 75.0}


def apply_transform(source: str, name: str) -> str:
    region, body = TRANSFORMS[name]
    out = replace_region(source, region, body)
    if name in _TRANSFORM_EXTRA:
        out = replace_region(out, *_TRANSFORM_EXTRA[name])
    return out


def _applied(source: str, name: str) -> bool:
    region, body = TRANSFORMS[name]
    r = regions(source).get(region)
    return r is not None and [ln.strip() for ln in r.strip().split("\n")] == [ln.strip() for ln in body.split("\n")]


# ---------------------------------------------------------------- meta-parameter space
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
        persistent = _applied(src, "persistent")
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
                 "payload": {"transform": name}, "priority": _TRANSFORM_PRIORITY[name]}
                for name, (region, _) in TRANSFORMS.items() if region in regs and not _applied(src, name)]

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


class ReplayProposer(Proposer):
    """Returns scripted candidates in order: each item {source, meta, description[, kind]}."""

    name = "replay"

    def __init__(self, script: list[dict]):
        self.script = list(script)

    def opportunities(self, task, version, context: dict) -> list[dict]:
        # one opportunity per scripted item, all on the root (the first head), in order
        if context.get("is_root"):
            return [{"key": f"replay:{i}", "kind": "replay", "description": s.get("description", f"scripted #{i}"),
                     "payload": {"index": i}, "priority": 1000.0 - i} for i, s in enumerate(self.script)]
        return []

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        s = self.script[opportunity.payload["index"]]
        return Proposal(s["source"], s.get("meta", parent.meta), description=s.get("description", ""),
                        kind=s.get("kind"))


# ---------------------------------------------------------------- LLM
@dataclasses.dataclass
class LLMConfig:
    base_url: str | None = None
    model: str = ""
    api_key: str | None = None
    token_budget: int = 2_000_000
    max_completion_tokens: int = 8000
    temperature: float = 0.7
    timeout_s: float = 300.0


_SYSTEM = """You optimise GPU kernels under a strict numerical contract. You receive a complete
kernel module and its meta-parameters. Return ONE complete replacement: the full module in a
```python block and the meta-parameters as JSON in a ```json block. Keep the entry point and its
signature. Contract: {contract}. Every output element must be accumulated in fp32 over K in
ascending order with acc = tl.dot(a, b, acc) (no split-K, nothing that depends on the batch size);
rows are independent. Candidates are checked for unwritten outputs, input mutation, fresh inputs,
unseen shapes, determinism and bitwise row-subset/batch-extension invariance, then timed against
the incumbent."""


class LLMProposer(Proposer):
    """OpenAI-compatible chat completions; records token counts; respects a token budget."""

    name = "llm"

    def __init__(self, config: LLMConfig, client=None):
        self.cfg = config
        self._client = client

    def client(self):
        if self._client is None:
            import openai
            self._client = openai.OpenAI(base_url=self.cfg.base_url, api_key=self.cfg.api_key or "EMPTY",
                                         timeout=self.cfg.timeout_s)
        return self._client

    def opportunities(self, task, version, context: dict) -> list[dict]:
        ideas = [
            ("memory", "improve memory access: unmasked/vectorised loads, pointer increments, fewer index ops"),
            ("decode", "speed up small-M (decode) shapes: more parallelism over N without splitting K"),
            ("prefill", "speed up large-M shapes: bigger tiles, deeper pipelining, better L2 reuse (tile order)"),
            ("schedule", "restructure the launch: persistent programs, fewer launches, better occupancy"),
        ]
        off = OfflineProposer().opportunities(task, version, context)
        return [{"key": f"llm:{k}", "kind": "llm", "description": d, "payload": {"hint": d}, "priority": 50.0}
                for k, d in ideas] + off[:4]

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        used = int(context.get("tokens_used", 0))
        if used >= self.cfg.token_budget:
            return Proposal(None, None, error=f"token budget spent ({used} >= {self.cfg.token_budget})")
        failures = context.get("recent_failures", [])[-3:]
        user = (f"Opportunity: {opportunity.description}\n\nCurrent meta-parameters:\n```json\n"
                f"{json.dumps(parent.meta, indent=1)}\n```\n\nCurrent module:\n```python\n{parent.source}\n```\n")
        if context.get("latency"):
            user += f"\nMeasured latency per workload (us): {json.dumps(context['latency'])}\n"
        if failures:
            user += "\nRecent rejected attempts (do not repeat): " + "; ".join(failures) + "\n"
        msgs = [{"role": "system", "content": _SYSTEM.format(contract=context.get("contract_text", ""))},
                {"role": "user", "content": user}]
        t0 = time.time()
        try:
            r = self.client().chat.completions.create(
                model=self.cfg.model, messages=msgs, temperature=self.cfg.temperature,
                max_tokens=min(self.cfg.max_completion_tokens, max(256, self.cfg.token_budget - used)))
        except Exception as e:
            return Proposal(None, None, model=self.cfg.model, latency_s=time.time() - t0, error=f"{type(e).__name__}: {e}")
        usage = getattr(r, "usage", None)
        pt = int(getattr(usage, "prompt_tokens", 0) or 0)
        ct = int(getattr(usage, "completion_tokens", 0) or 0)
        text = r.choices[0].message.content or ""
        src, meta = parse_completion(text, parent.meta)
        prop = Proposal(src, meta, description=f"llm: {opportunity.description}", prompt_tokens=pt,
                        completion_tokens=ct, model=self.cfg.model, latency_s=time.time() - t0)
        if src is None:
            prop.error = "no ```python block in the completion"
        return prop


def parse_completion(text: str, default_meta: dict) -> tuple[str | None, dict | None]:
    code = re.findall(r"```python\n(.*?)```", text, re.S)
    js = re.findall(r"```json\n(.*?)```", text, re.S)
    meta = default_meta
    if js:
        try:
            meta = json.loads(js[-1])
        except json.JSONDecodeError:
            pass
    return (code[-1] if code else None), meta


def make_proposer(name: str, **kw) -> Proposer:
    if name == "offline":
        return OfflineProposer()
    if name == "replay":
        return ReplayProposer(kw["script"])
    if name == "llm":
        return LLMProposer(kw["config"])
    raise KeyError(f"unknown proposer {name!r}; choose offline, llm or replay")
