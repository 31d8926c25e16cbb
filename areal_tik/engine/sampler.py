"""Token sampling whose result for a row never depends on the other rows.

Per row: greedy (T == 0) takes the first argmax of the logits; otherwise Gumbel-max over
``logits.float() / T`` restricted to the top-k / top-p set. The Gumbel noise of a row is a
counter-based hash of ``(seed, position, vocab index)`` -- a per-request random stream
that plays the role of a per-request ``torch.Generator`` but is computed for the whole
batch in a few tensor ops: the same request at the same position draws the same noise in
any batch, after any preemption, and after a client-side resume (R5) with the same seed.

The log-prob returned with each token is the contract's unfiltered
``log_softmax(logits.float() / T)[token]`` from ``layers.logprob_head.logprobs_of``
(T := 1 for greedy), never the filtered distribution.

Row-invariance on a CPU: the top-p cumulative sums use ``cumsum`` (a sequential scan per
row) in float64 and ``exp``/``log`` come from ``kernels._torch_math`` (position-independent
bits); on CUDA the element-wise ``torch.exp``/``torch.log`` are already per-element.
"""
from __future__ import annotations

import functools

import torch

from areal_tik.layers.logprob_head import logprobs_of
from areal_tik.kernels import _torch_math
from areal_tik.kernels.gumbel import C_MIX, M32, uniform_noise, vocab_hash

__all__ = ["Sampler", "row_key", "uniform_noise"]


def _hash32_py(x: int) -> int:
    x &= M32
    x = (((x >> 16) ^ x) * C_MIX) & M32
    x = (((x >> 16) ^ x) * C_MIX) & M32
    return ((x >> 16) ^ x) & M32


@functools.lru_cache(maxsize=1 << 16)
def _seed_key(seed: int) -> int:
    s = int(seed) & ((1 << 64) - 1)
    k = _hash32_py(s & M32)
    return _hash32_py(k ^ (s >> 32) ^ 0x9E3779B9)


def row_key(seed: int, position: int) -> int:
    """32-bit key of the random draw for token ``position`` of a request seeded ``seed``."""
    return _hash32_py(_seed_key(seed) ^ (int(position) * 0x2545F491 & M32))


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, ops, logprob_ops=None):
        """``ops``: bound ops for the fused Gumbel-max draw (both kernel modes sample alike);
        ``logprob_ops``: the model's bound ops for the recorded log-probs (None: default kernels)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.ops, self.logprob_ops = ops, logprob_ops
        self._vhash = vocab_hash(vocab_size, self.device)
        cpu = self.device.type != "cuda"
        self._exp = _torch_math.exp if cpu else torch.exp
        self._log = _torch_math.log if cpu else torch.log

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list, seeds: list[int], positions: list[int]):
        """Sample one token per row. ``params``: SamplingParams per row; ``positions``: the
        absolute position of the token being sampled. Returns (tokens list, logprobs list)."""
        B, V = logits.shape
        dev = logits.device
        temps = [p.temperature for p in params]
        greedy = [i for i, t in enumerate(temps) if t == 0]
        sampled = [i for i, t in enumerate(temps) if t != 0]
        if not greedy:      # the RL case: every row sampled, no gather/scatter
            tokens = self._sample(logits, params, [row_key(seeds[i], positions[i]) for i in range(B)])
        elif not sampled:
            tokens = torch.argmax(logits, dim=-1)
        else:
            tokens = torch.empty(B, dtype=torch.int64, device=dev)
            gi = torch.tensor(greedy, device=dev)
            tokens[gi] = torch.argmax(logits.index_select(0, gi), dim=-1)
            si = torch.tensor(sampled, device=dev)
            tokens[si] = self._sample(logits.index_select(0, si), [params[i] for i in sampled],
                                      [row_key(seeds[i], positions[i]) for i in sampled])
        groups = sorted(set(temps))
        if len(groups) == 1:
            logprobs = logprobs_of(logits, tokens, groups[0], self.logprob_ops)
        else:
            logprobs = torch.empty(B, dtype=torch.float32, device=dev)
            for t in groups:
                ri = torch.tensor([i for i, x in enumerate(temps) if x == t], device=dev)
                logprobs[ri] = logprobs_of(logits.index_select(0, ri), tokens.index_select(0, ri), t, self.logprob_ops)
        # one device-to-host copy for both (token ids < 2**53 and fp32 values are exact in float64)
        both = torch.cat([tokens.to(torch.float64), logprobs.to(torch.float64)]).tolist()
        return [int(x) for x in both[:B]], both[B:]

    def fused_temperature(self, params: list) -> float | None:
        """The temperature every row samples at when all rows share one T > 0 and none filters (top-k / top-p
        off: the RL case), else None. Such a step's draw is :meth:`draw`, which a decode CUDA graph can hold."""
        t = params[0].temperature
        if t == 0:
            return None
        V = self.vocab_size
        for p in params:
            if p.temperature != t or 0 < p.top_k < V or p.top_p < 1.0:
                return None
        return t

    def draw(self, logits: torch.Tensor, keys: torch.Tensor, temps: torch.Tensor, t: float):
        """Tokens (int64) and log-probs (fp32) of an unfiltered draw at temperature ``t`` (``temps``: ``t`` per
        row, fp32; ``keys``: :func:`row_key` per row, int64): Gumbel-max in one fused pass, then the contract's
        log-prob of the drawn token. Only device ops: this runs inside decode graphs too."""
        tokens = self.ops.gumbel_argmax(logits, keys, temps, self._vhash)
        return tokens, logprobs_of(logits, tokens, t, self.logprob_ops)

    def _sample(self, logits: torch.Tensor, params: list, keys: list[int]) -> torch.Tensor:
        B, V = logits.shape
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
        keys_t = torch.tensor(keys, dtype=torch.int64, device=dev)
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        top_p = [p.top_p for p in params]
        if all(k >= V for k in top_k) and all(p >= 1.0 for p in top_p):
            # unfiltered (the RL case): one fused pass over the logits (kernels/gumbel.py)
            return self.ops.gumbel_argmax(logits, keys_t, temp[:, 0], self._vhash)
        x = logits.float() / temp
        # top-k / top-p: the kept set from a sorted copy, then Gumbel-max over it
        xs, _ = torch.sort(x, dim=-1, descending=True, stable=True)
        k_t = torch.tensor(top_k, device=dev)[:, None]
        ranks = torch.arange(V, device=dev)[None, :]
        e = self._exp((xs - xs[:, :1]).double())                       # unnormalised probs, sorted
        e = torch.where(ranks < k_t, e, torch.zeros_like(e))
        cum = torch.cumsum(e, dim=-1)
        total = cum[:, -1:]
        p_t = torch.tensor(top_p, dtype=torch.float64, device=dev)[:, None]
        kept_sorted = ((cum - e) < p_t * total) & (ranks < k_t)
        kept_sorted[:, 0] = True
        n_keep = kept_sorted.sum(-1, keepdim=True)
        thresh = xs.gather(-1, n_keep - 1)                               # smallest kept value
        keep = x >= thresh
        u = uniform_noise(keys_t, self._vhash)
        gumbel = -self._log(-self._log(u))
        score = torch.where(keep, x + gumbel, torch.full_like(x, float("-inf")))
        return torch.argmax(score, dim=-1)
