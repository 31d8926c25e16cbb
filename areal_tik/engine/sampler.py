"""Token sampling whose result for a row never depends on the other rows.

Per row: greedy (T == 0) takes the first argmax of the logits; otherwise Gumbel-max over
``logits.float() / T`` restricted to the top-k / top-p set, drawn by the bound ``gumbel_argmax``
op (the filtered rows first set the logits outside ``kernels.gumbel.kept_mask`` to ``-inf``). The
Gumbel noise of a row is a counter-based hash of ``(seed, position, vocab index)``
(``kernels.gumbel.row_key``) -- a per-request random stream that plays the role of a per-request
``torch.Generator`` but is computed for the whole batch in one pass: the same request at the same
position draws the same noise in any batch, after any preemption, and after a client-side resume
(R5) with the same seed.

The log-prob returned with each token is the contract's unfiltered
``log_softmax(logits.float() / T)[token]`` from ``layers.logprob_head.logprobs_of``
(T := 1 for greedy), never the filtered distribution.
"""
from __future__ import annotations

import torch

from areal_tik.kernels.gumbel import kept_mask, row_key, vocab_hash
from areal_tik.layers.logprob_head import logprobs_of

__all__ = ["Sampler", "row_key"]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, ops, logprob_ops=None):
        """``ops``: bound ops for the fused Gumbel-max draw (both kernel modes sample alike);
        ``logprob_ops``: the model's bound ops for the recorded log-probs (None: default kernels)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.ops, self.logprob_ops = ops, logprob_ops
        self._vhash = vocab_hash(vocab_size, self.device)

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
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        keys_t = torch.tensor(keys, dtype=torch.int64, device=dev)
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        top_p = [p.top_p for p in params]
        if any(k < V for k in top_k) or any(p < 1.0 for p in top_p):
            # top-k / top-p: the same draw over the kept set (the rest of each row at -inf)
            logits = logits.masked_fill(~kept_mask(logits, temp, top_k, top_p), float("-inf"))
        return self.ops.gumbel_argmax(logits, keys_t, temp, self._vhash)
