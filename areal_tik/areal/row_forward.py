"""The recompute forward over only the sequences that need it, in one plan every rank follows.

A batch is a list of trajectory dicts whose tensors have one row per sequence (a GRPO group holds
``n_samples`` rows). When the batch-wide conditions of the skip rule hold, a row whose generated tokens
all come from the current version keeps its rolled rollout log-probs; the other rows (``units``, as
``(trajectory, row)`` pairs) go through AReaL's forward, and :func:`merge` puts their values back in
place. Why this is exact: a row's log-probs do not depend on which rows share its micro-batch or how the
micro-batches are cut (contract R1), so a row forwarded with other rows equals the same row in a forward
of the whole batch, bit for bit.

The forward is collective under FSDP: every rank must run the same number of forward calls. Each rank
counts the micro-batches its own units fill (:func:`count_micro_batches`: AReaL's packer, under the
actor's ``max_tokens_per_mb``); the ranks exchange the counts and all run the largest, ``n_calls``
(:func:`forward_rows`): a rank spreads its units over up to ``n_calls`` micro-batches and fills the rest
of its calls with its shortest row, whose values are dropped. Each call is one micro-batch, so AReaL's
own agreement on the micro-batch count inside the forward sees the same count on every rank.

:class:`ForwardRate` turns measured forwards into the time the skipped rows saved.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from areal.api.cli_args import MicroBatchSpec
from areal.utils.data import DEFAULT_MAX_TOKENS_PER_MB, allocate_balanced_mbs

from areal_tik.areal.skip_rule import rolled_rollout_logprobs

__all__ = ["units_of", "row_tokens", "take_rows", "count_micro_batches", "plan_groups", "forward_rows", "merge",
           "ForwardRate"]

Unit = tuple[int, int]  # (trajectory index, row)


def units_of(reasons: list[list[str | None]]) -> list[Unit]:
    """The rows with a reason (they need the forward), in batch order."""
    return [(t, r) for t, rows in enumerate(reasons) for r, why in enumerate(rows) if why is not None]


def row_tokens(traj: dict[str, Any], row: int) -> int:
    """Tokens of one row (prompt and generated): what its forward costs."""
    return int(traj["attention_mask"][row].sum())


def take_rows(traj: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """A trajectory dict of only ``rows``: every tensor whose first dimension is the row count is sliced,
    everything else is kept (the padded width stays, so the forward returns the trajectory's width)."""
    n = traj["attention_mask"].shape[0]
    idx = torch.as_tensor(rows, dtype=torch.long)
    return {k: (v.index_select(0, idx.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n
                else v) for k, v in traj.items()}


def _one_per_call(mb_spec: MicroBatchSpec, n_groups: int) -> MicroBatchSpec:
    cap = mb_spec.max_tokens_per_mb if mb_spec.max_tokens_per_mb is not None else DEFAULT_MAX_TOKENS_PER_MB
    return MicroBatchSpec.new(mb_spec, n_mbs=n_groups, n_mbs_divisor=1, granularity=1, max_tokens_per_mb=cap)


def count_micro_batches(lens: list[int], mb_spec: MicroBatchSpec) -> int:
    """How many micro-batches AReaL's packer fills with rows of these lengths (0 for none)."""
    return len(allocate_balanced_mbs(_one_per_call(mb_spec, 1), lens)) if lens else 0


def plan_groups(lens: list[int], mb_spec: MicroBatchSpec, n_calls: int) -> list[list[int]]:
    """Indices of ``lens`` in at most ``n_calls`` micro-batches: spread over ``n_calls`` when that packs
    into exactly that many (the ranks' calls are then evenly loaded), else as few as they fit."""
    if not lens:
        return []
    spread = allocate_balanced_mbs(_one_per_call(mb_spec, min(n_calls, len(lens))), lens)
    if len(spread) <= n_calls:
        return spread
    fewest = allocate_balanced_mbs(_one_per_call(mb_spec, 1), lens)
    if len(fewest) > n_calls:
        raise RuntimeError(f"{len(lens)} rows need {len(fewest)} micro-batches, more than the {n_calls} agreed")
    return fewest


def forward_rows(forward: Callable[[list[dict]], list[torch.Tensor]], batch: list[dict[str, Any]],
                 units: list[Unit], n_calls: int, mb_spec: MicroBatchSpec) -> tuple[dict[Unit, torch.Tensor], int]:
    """Run exactly ``n_calls`` forward calls of one micro-batch each (``forward``: AReaL's, on a list of
    one-row trajectory dicts) over ``units``; returns each unit's log-probs (the row's padded width) and
    the tokens forwarded. Calls beyond this rank's own micro-batches forward its shortest row and drop
    the result."""
    if n_calls <= 0:
        return {}, 0
    if not any(traj["attention_mask"].shape[0] for traj in batch):
        raise RuntimeError("this rank holds no sequence to take part in the collective recompute forward")
    groups = plan_groups([row_tokens(batch[t], r) for t, r in units], mb_spec, n_calls)
    out: dict[Unit, torch.Tensor] = {}
    tokens = 0
    for g in groups:
        part = [units[i] for i in g]
        tokens += sum(row_tokens(batch[t], r) for t, r in part)
        res = forward([take_rows(batch[t], [r]) for t, r in part])
        for u, lp in zip(part, res):
            out[u] = lp.reshape(-1)
    if len(groups) < n_calls:
        filler = min(((t, r) for t, traj in enumerate(batch) for r in range(traj["attention_mask"].shape[0])),
                     key=lambda u: row_tokens(batch[u[0]], u[1]))
        for _ in range(n_calls - len(groups)):
            forward([take_rows(batch[filler[0]], [filler[1]])])
            tokens += row_tokens(batch[filler[0]], filler[1])
    return out, tokens


def merge(batch: list[dict[str, Any]], fresh: dict[Unit, torch.Tensor]) -> list[torch.Tensor]:
    """Per trajectory, the rolled rollout log-probs (the form ``compute_logp`` returns) with the rows in
    ``fresh`` replaced by their recomputed values."""
    out = []
    for t, traj in enumerate(batch):
        lp = rolled_rollout_logprobs(traj).to(traj["logprobs"].device)
        for r in range(lp.shape[0]):
            if (t, r) in fresh:
                lp[r] = fresh[(t, r)].to(device=lp.device, dtype=lp.dtype)
        out.append(lp)
    return out


class ForwardRate:
    """Seconds per token of this run's recompute forward over a whole batch, from the latest one measured
    (its wall time over the batch's tokens, prompt and generated): the skipped rows' tokens at this rate
    are the time their skip saved. None until a whole-batch forward has run (step 0's audit runs one)."""

    def __init__(self):
        self.s_per_token: float | None = None

    def measured(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.s_per_token = seconds / tokens

    def saved(self, tokens: int) -> float | None:
        return None if self.s_per_token is None else self.s_per_token * tokens
