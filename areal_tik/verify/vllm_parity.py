"""``areal-tik verify --engine vllm``: rollout log-probs from vLLM (tik plugin) vs the trainer's, bit for bit.

One ``vllm.LLM`` on the tik plugin (``vllm_plugin.llm_kwargs``) is built with a small prefill token
budget and a small KV cache, so that one run goes through vLLM's own scheduler regimes:

- ``batch``: every request at once: continuous batching (prompts of different lengths finish
  prefill at different steps), chunked prefill (prompts longer than the token budget), decode in
  full CUDA graphs, and preemption when the KV cache runs out (vLLM re-prefills the preempted).
- ``abort``: the same requests stepped through ``LLMEngine``; after a few steps every third one
  is aborted and the rest run on (their bits must not notice).

Each generated token's log-prob (``logprobs=0``: the sampled token's, from our log-prob path) is
compared with ``packed_logprobs`` of the tik-patched HF model on the same sequences. With
``stock=True`` the LLM is stock vLLM (the negative control: it must mismatch). Needs vLLM 0.24
and the plugin's entry point installed (``pip install 'areal-tik[vllm]'``).
"""
from __future__ import annotations

import random
import time

import torch

from areal_tik.layers.logprob_head import generated_logprobs
from areal_tik.verify import contract

__all__ = ["run_vllm_parity", "REGIMES"]

REGIMES = ("batch", "abort")


def _requests(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _sampling(max_new: int, seed: int, i: int):
    from vllm import SamplingParams
    return SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_new, ignore_eos=True, logprobs=0,
                          detokenize=False, seed=seed * 7919 + i)


def _collect(out) -> tuple[list[int], list[int], list[float]]:
    c = out.outputs[0]
    toks = list(c.token_ids)
    return list(out.prompt_token_ids), toks, [d[t].logprob for d, t in zip(c.logprobs, toks)]


def _run_batch(llm, prompts, max_new, seed):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [_sampling(max_new, seed, i) for i in range(len(prompts))], use_tqdm=False)
    return [_collect(o) for o in outs]


def _run_abort(llm, prompts, max_new, seed, abort_after: int = 4):
    eng = llm.llm_engine
    ids = [f"abort-{seed}-{i}" for i in range(len(prompts))]
    for rid, p, i in zip(ids, prompts, range(len(prompts))):
        eng.add_request(rid, {"prompt_token_ids": p}, _sampling(max_new, seed, i))
    done, steps, aborted = {}, 0, set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id not in aborted:
                done[o.request_id] = _collect(o)
        steps += 1
        if steps == abort_after:
            aborted = {rid for k, rid in enumerate(ids) if k % 3 == 0 and rid not in done}
            eng.abort_request(sorted(aborted))
    return [done[r] for r in ids if r in done], len(aborted)


def _preemptions(llm) -> int | None:
    try:
        return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if "preempt" in m.name))
    except Exception:                                    # metrics off or renamed: not reported
        return None


def run_vllm_parity(model_dir: str, trainer_model, *, n_prompts: int = 48, min_prompt_len: int = 8,
                    max_prompt_len: int = 600, max_new_tokens: int = 64, seed: int = 0, stock: bool = False,
                    max_num_batched_tokens: int = 512, num_gpu_blocks: int | None = None,
                    regimes: tuple = REGIMES, progress=None) -> dict:
    """Run the regimes on one LLM over the HF checkpoint ``model_dir`` and compare every generated token's
    log-prob with ``trainer_model`` (the tik-patched HF model of the same checkpoint). ``num_gpu_blocks``
    (default: a quarter of what the requests need at once) forces preemption."""
    import json
    import os

    from vllm import LLM

    from areal_tik import vllm_plugin
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    vocab = int(cfg["vocab_size"])
    block = 64
    max_len = -(-(max_prompt_len + max_new_tokens + 1) // block) * block
    need_blocks = n_prompts * (max_len // block)
    kw = dict(model=model_dir, skip_tokenizer_init=True, max_model_len=max_len, max_num_seqs=min(64, n_prompts),
              max_num_batched_tokens=max_num_batched_tokens, seed=seed, dtype="bfloat16", disable_log_stats=False,
              num_gpu_blocks_override=num_gpu_blocks or max(max_len // block + 1, need_blocks // 4),
              gpu_memory_utilization=0.5)
    if stock:
        kw["block_size"] = block
    else:
        kw.update(vllm_plugin.llm_kwargs(cfg["model_type"], block_size=block))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    report = dict(engine="vllm" if stock else "vllm+tik", vllm_kwargs={k: str(v) for k, v in kw.items()},
                  start_s=round(start_s, 1), regimes={})
    prompts = _requests(n_prompts, min_prompt_len, max_prompt_len, vocab, seed)
    for k, name in enumerate(regimes):
        if progress:
            progress(name, k / len(regimes))
        t = time.perf_counter()
        extra = {}
        if name == "batch":
            seqs = _run_batch(llm, prompts, max_new_tokens, seed)
            extra["preemptions"] = _preemptions(llm)
        elif name == "abort":
            seqs, extra["aborted"] = _run_abort(llm, prompts, max_new_tokens, seed + 1)
        else:
            raise ValueError(f"unknown vLLM regime {name!r}; known: {REGIMES}")
        gen_s = time.perf_counter() - t
        train = generated_logprobs(trainer_model, seqs)
        rollout = [torch.tensor(lp, dtype=torch.float32) for _, _, lp in seqs]
        short = sum(len(o) != max_new_tokens for _, o, _ in seqs)
        rep = contract.compare_bits(torch.cat(rollout), torch.cat(train), name=f"vLLM {name} rollout vs trainer")
        report["regimes"][name] = dict(passed=bool(rep.passed) and rep.n_compared > 0 and short == 0,
                                       n_sequences=len(seqs), n_tokens=rep.n_compared, n_mismatch=rep.n_mismatch,
                                       max_abs_diff=rep.max_abs_diff, short_sequences=short,
                                       gen_s=round(gen_s, 2), **extra)
    report["passed"] = all(r["passed"] for r in report["regimes"].values())
    if progress:
        progress("done", 1.0)
    return report
