"""Token sampling whose result for a row never depends on the other rows.

Per row: greedy (T == 0) takes the first argmax of the logits; otherwise Gumbel-max over
``logits.float() / T`` restricted to the top-k / top-p set. The Gumbel noise of a row is a
counter-based hash of ``(seed, position, vocab index)`` -- a per-request random stream
that plays the role of a per-request ``torch.Generator`` but is computed for the whole
batch in a few tensor ops: the same request at the same position draws the same noise in
any batch, after any preemption, and after a client-side resume (R5) with the same seed.

The log-prob returned with each token is the contract's unfiltered
``log_softmax(logits.float() / T)[token]`` from ``backend.logprob_head.logprobs_of``
(T := 1 for greedy), never the filtered distribution.

Row-invariance on a CPU: the top-p cumulative sums use ``cumsum`` (a sequential scan per
row) in float64 and ``exp``/``log`` come from ``kernels._torch_math`` (position-independent
bits); on CUDA the element-wise ``torch.exp``/``torch.log`` are already per-element.
"""
from __future__ import annotations

import torch

from areal_tik.backend.logprob_head import logprobs_of
from areal_tik.kernels import _torch_math

__all__ = ["Sampler", "row_key", "uniform_noise"]

_M32 = 0xFFFFFFFF
_C = 0x45D9F3B   # < 2**31: products of 32-bit values stay below 2**63 (no int64 overflow)


def _hash32_py(x: int) -> int:
    x &= _M32
    x = (((x >> 16) ^ x) * _C) & _M32
    x = (((x >> 16) ^ x) * _C) & _M32
    return ((x >> 16) ^ x) & _M32


def row_key(seed: int, position: int) -> int:
    """32-bit key of the random draw for token ``position`` of a request seeded ``seed``."""
    s = int(seed) & ((1 << 64) - 1)
    k = _hash32_py(s & _M32)
    k = _hash32_py(k ^ (s >> 32) ^ 0x9E3779B9)
    return _hash32_py(k ^ (int(position) * 0x2545F491 & _M32))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _C & _M32
    x = ((x >> 16) ^ x) * _C & _M32
    return (x >> 16) ^ x


def uniform_noise(keys: torch.Tensor, vocab_index_hash: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in (0, 1), ``[B, V]``: row b depends only on ``keys[b]``."""
    x = _hash32(vocab_index_hash[None, :] ^ keys[:, None])
    x = _hash32(x ^ (keys[:, None] * 0x27D4EB2F & _M32))
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, kernels: str = "tik"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.kernels = kernels
        self._vhash = _hash32(torch.arange(vocab_size, dtype=torch.int64, device=self.device) * 0x61C88647 & _M32)
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
        tokens = torch.empty(B, dtype=torch.int64, device=dev)
        greedy = [i for i, t in enumerate(temps) if t == 0]
        sampled = [i for i, t in enumerate(temps) if t != 0]
        if greedy:
            gi = torch.tensor(greedy, device=dev)
            tokens[gi] = torch.argmax(logits.index_select(0, gi), dim=-1)
        if sampled:
            si = torch.tensor(sampled, device=dev)
            tokens[si] = self._sample(logits.index_select(0, si), [params[i] for i in sampled],
                                      [row_key(seeds[i], positions[i]) for i in sampled])
        logprobs = torch.empty(B, dtype=torch.float32, device=dev)
        for t in sorted(set(temps)):
            rows = [i for i, x in enumerate(temps) if x == t]
            ri = torch.tensor(rows, device=dev)
            logprobs[ri] = logprobs_of(logits.index_select(0, ri), tokens.index_select(0, ri), t, self.kernels)
        return tokens.tolist(), logprobs.tolist()

    def _sample(self, logits: torch.Tensor, params: list, keys: list[int]) -> torch.Tensor:
        B, V = logits.shape
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
        x = logits.float() / temp
        keep = None
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        top_p = [p.top_p for p in params]
        if any(k < V for k in top_k) or any(p < 1.0 for p in top_p):
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
        u = uniform_noise(torch.tensor(keys, dtype=torch.int64, device=dev), self._vhash)
        gumbel = -self._log(-self._log(u))
        score = x + gumbel
        if keep is not None:
            score = torch.where(keep, score, torch.full_like(score, float("-inf")))
        return torch.argmax(score, dim=-1)
