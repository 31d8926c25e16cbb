"""The regime harness behind ``areal-tik verify``, the parity tests and ``bench_parity``.

One set of random requests (prompts, seeds, temperatures, top-p/top-k) is generated
under several engine regimes, then every generated token's rollout log-prob is compared
bit for bit with the training forward's:

- R2 prefill: all requests at once in shuffled order, whole-prompt prefill.
- R3 chunked prefill: a small random token budget (chunk boundaries anywhere), another
  page size, shuffled physical pages.
- R4 continuous batching: requests arrive at random steps, few slots, so sequences join
  and leave every step and decode batches change size.
- R5 resume: mid-generation ``abort_all`` then client-side resume (prompt + output so far,
  same seed), a weight update (same weights, new version: in-flight sequences are
  re-prefilled), and a KV cache small enough to force preemption.
- R1 training forward (autograd on): the R2 sequences under two different packings
  (random order, random micro-batch splits, each micro-batch padded to a multiple of
  ``pad_to`` with a padding segment), compared with each other. A regime's sequences that
  equal R2's are compared with those training values; any other sequence is recomputed
  under a fresh random packing.

Also counted: sequences whose *tokens* differ from R2 (sampling is seeded per request, so
with an invariant stack there are none). The result is a plain dict (JSON-ready).
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable

import torch

from areal_tik.verify import contract
from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.engine.config import EngineConfig
from areal_tik.engine.llm_engine import LLMEngine
from areal_tik.engine.sequence import RequestOutput, SamplingParams

__all__ = ["ParityConfig", "run_parity", "REGIMES"]

REGIMES = ("R1", "R2", "R3", "R4", "R5")


@dataclasses.dataclass
class ParityConfig:
    n_prompts: int = 6
    min_prompt_len: int = 3
    max_prompt_len: int = 40
    max_new_tokens: int = 10
    seed: int = 0
    temperatures: tuple = (1.0, 0.7, 0.0)
    pad_to: int = 256
    max_num_seqs: int = 64
    page_sizes: tuple = (16, 32)
    backward: bool = True
    regimes: tuple = REGIMES
    ignore_eos: bool = True
    r4_max_num_seqs: tuple = (2, 4)     # R4 slots drawn from this range (few: constant join/leave)
    r5_concurrent: int = 2              # R5 KV pages for this many full-length sequences (preemption)
    max_tokens_per_mb: int = 16384      # R1 micro-batches are also cut at this many tokens (memory)
    enforce_eager: bool = False         # engines without CUDA graphs (isolates graph capture/replay)


def _requests(cfg: ParityConfig, vocab: int, rng: random.Random):
    reqs = []
    for i in range(cfg.n_prompts):
        n = rng.randint(cfg.min_prompt_len, cfg.max_prompt_len)
        prompt = [rng.randrange(3, vocab) for _ in range(n)]
        t = cfg.temperatures[i % len(cfg.temperatures)]
        top_p = rng.choice([1.0, 1.0, 0.9, 0.7])
        top_k = rng.choice([-1, -1, 50, 10**8])
        sp = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, max_new_tokens=cfg.max_new_tokens,
                            seed=rng.getrandbits(48), ignore_eos=cfg.ignore_eos)
        reqs.append((f"r{i}", prompt, sp))
    return reqs


def _engine(model, cfg: ParityConfig, **kw) -> LLMEngine:
    max_len = cfg.max_prompt_len + cfg.max_new_tokens + 1
    base = dict(max_model_len=max_len, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=8192,
                enforce_eager=cfg.enforce_eager)
    base.update(kw)
    return LLMEngine(model, EngineConfig(**base))


def _drain(eng: LLMEngine, results: dict):
    while eng.has_unfinished():
        for o in eng.step():
            results[o.request_id] = o


def _all_at_once(eng: LLMEngine, reqs, rng):
    """Add every request (in a random order) before the first step, run to the end."""
    res = {}
    for rid, p, sp in rng.sample(reqs, len(reqs)):
        eng.add_request(rid, p, sp)
    _drain(eng, res)
    return res, eng.stats()


def _run_r2(model, cfg, reqs, rng):
    return _all_at_once(_engine(model, cfg, page_size=cfg.page_sizes[0], chunked_prefill=False), reqs, rng)


def _run_r3(model, cfg, reqs, rng):
    eng = _engine(model, cfg, page_size=cfg.page_sizes[-1], chunked_prefill=True,
                  max_num_batched_tokens=rng.randint(5, max(6, cfg.max_prompt_len // 2)),
                  page_order_seed=rng.getrandbits(32))
    return _all_at_once(eng, reqs, rng)


def _run_r4(model, cfg, reqs, rng):
    eng = _engine(model, cfg, page_size=rng.choice(cfg.page_sizes), max_num_seqs=rng.randint(*cfg.r4_max_num_seqs),
                  max_num_batched_tokens=rng.randint(cfg.max_prompt_len, 4 * cfg.max_prompt_len),
                  page_order_seed=rng.getrandbits(32))
    pending = rng.sample(reqs, len(reqs))
    res = {}
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 2) if eng.has_unfinished() else 1):
            if pending:
                rid, p, sp = pending.pop()
                eng.add_request(rid, p, sp)
        for o in eng.step():
            res[o.request_id] = o
    return res, eng.stats()


def _run_r5(model, cfg, reqs, rng):
    """Abort + client resume, a weight update mid-flight, and memory-pressure preemption."""
    max_len = cfg.max_prompt_len + cfg.max_new_tokens + 1
    ps = cfg.page_sizes[0]
    pages = max(cfg.r5_concurrent * ((max_len + ps - 1) // ps), 3)   # room for few sequences: preemption
    eng = _engine(model, cfg, page_size=ps, num_pages=pages, page_order_seed=rng.getrandbits(32),
                  max_num_batched_tokens=rng.randint(8, 2 * cfg.max_prompt_len))
    res: dict[str, RequestOutput] = {}
    partial: dict[str, RequestOutput] = {}
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    abort_at = rng.randint(2, 2 + cfg.max_new_tokens // 2)
    update_at = abort_at + rng.randint(1, 3)
    updated = False
    step = 0
    params = {rid: sp for rid, _, sp in reqs}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    while eng.has_unfinished():
        step += 1
        if step == abort_at:
            for o in eng.abort_all():
                partial[o.request_id] = o
                sp = params[o.request_id]
                left = sp.max_new_tokens - len(o.output_ids)
                if left > 0:
                    eng.add_request(o.request_id, o.prompt_ids + o.output_ids,
                                    dataclasses.replace(sp, max_new_tokens=left))
        if step >= update_at and not updated and eng.scheduler.running:
            eng.update_weights(state, eng.version + 1)     # same weights, new version: re-prefill in flight
            updated = True
        for o in eng.step():
            res[o.request_id] = o
    merged = {}
    for rid, _, _ in reqs:
        part, rest = partial.get(rid), res.get(rid)
        if part is None:
            merged[rid] = rest
            continue
        n_prompt = len(part.prompt_ids)
        out_ids = part.output_ids + (rest.output_ids if rest else [])
        out_lps = part.output_logprobs + (rest.output_logprobs if rest else [])
        merged[rid] = RequestOutput(rid, part.prompt_ids, out_ids, out_lps,
                                    rest.finish_reason if rest else "length", eng.version)
        assert len(merged[rid].prompt_ids) == n_prompt
    return merged, eng.stats()


_RUNNERS = {"R2": _run_r2, "R3": _run_r3, "R4": _run_r4, "R5": _run_r5}


def _key(o: RequestOutput, temperature: float) -> tuple:
    return (tuple(o.prompt_ids), tuple(o.output_ids), len(o.prompt_ids), temperature)


def _training_logprobs(model, outs: list[RequestOutput], temps: list[float], cfg: ParityConfig,
                       rng: random.Random, split: bool, backward: bool) -> list[torch.Tensor]:
    """Per sequence, fp32 training log-probs of its output tokens (autograd on)."""
    dev = next(model.parameters()).device
    order = rng.sample(range(len(outs)), len(outs))
    if split and len(order) > 1:
        n_mb = rng.randint(1, min(3, len(order)))
        cuts = sorted(rng.sample(range(1, len(order)), n_mb - 1))
    else:
        cuts = []
    groups = []
    for g in (order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])):
        cur, n = [], 0
        for i in g:
            ln = len(outs[i].prompt_ids) + len(outs[i].output_ids)
            if cur and n + ln > cfg.max_tokens_per_mb:
                groups.append(cur)
                cur, n = [], 0
            cur.append(i)
            n += ln
        groups.append(cur)
    result: list[torch.Tensor | None] = [None] * len(outs)
    for g_i, group in enumerate(groups):
        ids, cu, temps_tok, spans = [], [0], [], []
        for i in group:
            o = outs[i]
            s = o.prompt_ids + o.output_ids
            spans.append((i, cu[-1] + len(o.prompt_ids) - 1, len(o.output_ids)))
            ids += s
            temps_tok += [temps[i]] * len(s)
            cu.append(cu[-1] + len(s))
        pad = (-cu[-1]) % cfg.pad_to if split else 0
        if pad:
            ids += [rng.randrange(3, model.config.vocab_size) for _ in range(pad)]
            temps_tok += [1.0] * pad
            cu.append(cu[-1] + pad)
        with torch.enable_grad():
            lp = packed_logprobs(model, torch.tensor(ids, device=dev), torch.tensor(cu, dtype=torch.int32),
                                 temperature=torch.tensor(temps_tok), fused=bool(g_i % 2 == 0))
            if backward and lp.requires_grad:
                lp[lp.isfinite()].sum().backward()
        lp = lp.detach().cpu()
        for i, a, n in spans:
            result[i] = lp[a:a + n]
    if backward:
        model.zero_grad(set_to_none=True)
    return result


def run_parity(model, cfg: ParityConfig | None = None,
               progress: Callable[[str, float], None] | None = None) -> dict:
    """Run the regimes on ``model`` (patched) and report mismatching tokens per regime."""
    cfg = cfg or ParityConfig()
    rng = random.Random(cfg.seed)
    report = {"config": dataclasses.asdict(cfg), "regimes": {}, "passed": True}
    progress = progress or (lambda name, frac: None)
    reqs = _requests(cfg, model.config.vocab_size, rng)
    temps = {rid: sp.temperature for rid, _, sp in reqs}
    rids = [rid for rid, _, _ in reqs]
    runs: dict[str, dict] = {}
    gen_regimes = [r for r in ("R2", "R3", "R4", "R5") if r in cfg.regimes or r == "R2"]
    steps = len(gen_regimes) * 2 + 1
    done = 0
    for r in gen_regimes:
        progress(f"{r} generate", done / steps)
        t0 = time.perf_counter()
        outs, stats = _RUNNERS[r](model, cfg, reqs, random.Random(rng.getrandbits(32)))
        runs[r] = dict(outs=outs, stats=stats, gen_s=time.perf_counter() - t0)
        done += 1
    ref = runs["R2"]["outs"]
    ref_list = [ref[rid] for rid in rids]
    ref_temps = [temps[rid] for rid in rids]
    # R1: the reference sequences under two packings, autograd on (backward on the second).
    # The training value of a token is a function of its sequence alone (which R1 checks),
    # so regimes whose sequences equal R2's reuse packing B's values; others get a fresh packing.
    progress("R1 packings", done / steps)
    a = _training_logprobs(model, ref_list, ref_temps, cfg, random.Random(rng.getrandbits(32)), split=False,
                           backward=False)
    b = _training_logprobs(model, ref_list, ref_temps, cfg, random.Random(rng.getrandbits(32)), split=True,
                           backward=cfg.backward)
    cache = {_key(o, t): lp for o, t, lp in zip(ref_list, ref_temps, b)}
    if "R1" in cfg.regimes:
        rep = contract.compare_bits(torch.cat(a), torch.cat(b), name="R1 training packings")
        report["regimes"]["R1"] = _row(rep, divergent=0, stats={})
    done += 1
    for r in gen_regimes:
        if r not in cfg.regimes:
            continue
        progress(f"{r} vs training", done / steps)
        outs = [runs[r]["outs"][rid] for rid in rids]
        missing = [i for i, o in enumerate(outs) if _key(o, ref_temps[i]) not in cache]
        if missing:
            fresh = _training_logprobs(model, [outs[i] for i in missing], [ref_temps[i] for i in missing], cfg,
                                       random.Random(rng.getrandbits(32)), split=True, backward=False)
            for i, lp in zip(missing, fresh):
                cache[_key(outs[i], ref_temps[i])] = lp
        train = [cache[_key(o, t)] for o, t in zip(outs, ref_temps)]
        eng = torch.cat([torch.tensor(o.output_logprobs, dtype=torch.float32) for o in outs])
        rep = contract.compare_bits(eng, torch.cat(train), name=f"{r} rollout vs training")
        divergent = sum(o.output_ids != ref[rid].output_ids for rid, o in zip(rids, outs))
        report["regimes"][r] = _row(rep, divergent=divergent, stats=runs[r]["stats"], gen_s=runs[r]["gen_s"])
        done += 1
    progress("done", 1.0)
    report["passed"] = bool(report["regimes"]) and all(v["passed"] for v in report["regimes"].values())
    report["n_mismatch_total"] = sum(v["n_mismatch"] for v in report["regimes"].values())
    return report


def _row(rep: contract.Report, divergent: int, stats: dict, gen_s: float = 0.0) -> dict:
    # a regime that compared no token proves nothing: it does not pass
    return dict(passed=rep.passed and divergent == 0 and rep.n_compared > 0, n_tokens=rep.n_compared, n_mismatch=rep.n_mismatch,
                max_abs_diff=rep.max_abs_diff, first_mismatch=None if rep.first_mismatch is None else str(rep.first_mismatch),
                divergent_sequences=divergent, engine=stats, generate_s=round(gen_s, 3))
