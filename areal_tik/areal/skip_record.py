"""What the tik actor records of each batch's skip decision: the counts one rank shares with the
others, the step's ``tik/...`` statistics for AReaL's ``stats_tracker``, the log line, and the
decision log (one JSON line per batch and rank).

Statistics per step (docs/design.md section 6):

- ``tik/recompute_skipped``: 1 when no forward ran at all;
- ``tik/skip_seq_frac``, ``tik/skip_token_frac``: the fraction of sequences, and of generated tokens,
  whose rollout log-probs were used as proximal log-probs (over every rank's shard);
- ``tik/recompute_saved_s``: this rank's estimate of the forward time the skipped sequences saved:
  their tokens (prompt and generated) at the seconds per token of the run's latest measured forward
  (:class:`~areal_tik.areal.row_forward.ForwardRate`);
- ``tik/seqs_stale_version``, ``tik/seqs_mixed_versions``: sequences recomputed because an older
  version generated them, or because a weight update interrupted their generation (every rank's);
- ``tik/no_skip/<reason>``: 1 for each reason some sequence was recomputed;
- ``tik/recompute_forward_s``, ``tik/audit*``, ``tik/compare*``, ``tik/fallback`` as before.
"""
from __future__ import annotations

import json
import os
from typing import Any

from areal_tik.areal.row_forward import row_tokens
from areal_tik.areal.skip_rule import REASONS, SEQUENCE_REASONS

__all__ = ["shard_share", "global_counts", "step_stats", "log_line", "write_decision"]


def shard_share(batch: list[dict[str, Any]], why: list[list[str | None]], micro_batches: int) -> dict:
    """What this rank tells the others: the forward micro-batches its recomputed rows fill, and its counts
    of sequences, generated tokens and tokens (all / of current-version rows), and of rows per reason."""
    share = {"micro_batches": int(micro_batches), "seqs": 0, "seqs_current": 0, "gen_tokens": 0,
             "gen_tokens_current": 0, "tokens_current": 0, **{c: 0 for c in SEQUENCE_REASONS}}
    for traj, rows in zip(batch, why):
        gen = traj["loss_mask"].reshape(len(rows), -1).sum(-1)
        for r, code in enumerate(rows):
            share["seqs"] += 1
            share["gen_tokens"] += int(gen[r])
            if code is None:
                share["seqs_current"] += 1
                share["gen_tokens_current"] += int(gen[r])
                share["tokens_current"] += row_tokens(traj, r)
            else:
                share[code] += 1
    return share


def global_counts(shares: list[dict]) -> dict:
    return {k: sum(int(s[k]) for s in shares) for k in shares[0]}


def step_stats(rec: dict, fallback: bool) -> dict[str, float]:
    stats = {
        "tik/recompute_skipped": float(rec.get("skipped", False)),
        "tik/recompute_forward_s": float(rec.get("recompute_forward_s", 0.0)),
        "tik/audit": float(bool(rec.get("audit"))),
        "tik/fallback": float(fallback),
    }
    for k in ("skip_seq_frac", "skip_token_frac", "recompute_saved_s", *(f"seqs_{c}" for c in SEQUENCE_REASONS)):
        if rec.get(k) is not None:
            stats[f"tik/{k}"] = float(rec[k])
    if "compare_tokens" in rec:
        stats.update({"tik/compare_tokens": float(rec["compare_tokens"]),
                      "tik/compare_mismatch_tokens": float(rec["compare_mismatch_tokens"]),
                      "tik/compare_max_abs_diff": float(rec["compare_max_abs_diff"])})
    if rec.get("audit") and "audit_tokens" in rec:
        stats.update({"tik/audit_tokens": float(rec["audit_tokens"]),
                      "tik/audit_mismatch_tokens": float(rec["audit_mismatch_tokens"]),
                      "tik/audit_max_abs_diff": float(rec["audit_max_abs_diff"])})
    for r in (*REASONS, *SEQUENCE_REASONS):
        stats[f"tik/no_skip/{r}"] = float(r in rec.get("reasons", ()))
    return stats


def log_line(rec: dict) -> str:
    who = f"rank {rec['rank']}/{rec['ranks']} " if rec.get("ranks", 1) > 1 else ""
    what = {"none": "recompute SKIPPED", "rows": "recompute ran on some sequences", "all": "recompute ran"}
    line = f"tik: {who}version {rec['version']} {what.get(rec.get('forward'), 'recompute ran')}"
    if rec.get("skip_seq_frac") is not None and rec.get("forward") != "all":
        line += f" ({rec['skip_seq_frac']:.0%} of sequences, {rec['skip_token_frac']:.0%} of generated tokens skipped)"
    if rec.get("reasons"):
        line += f" (reasons: {','.join(rec['reasons'])})"
    if "audit_tokens" in rec:
        line += (f"; audit {'EQUAL' if rec.get('audit_passed') else 'MISMATCH'} {rec.get('audit_mismatch_tokens')}/"
                 f"{rec.get('audit_tokens')} max|diff|={rec.get('audit_max_abs_diff')}")
    return line


def write_decision(rec: dict, directory: str | None, rank: int) -> None:
    """One JSON line per batch in ``directory``/rank<R>.jsonl (each rank its own file: in single-controller
    mode the ranks are RPC workers whose records the controller never sees)."""
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
