"""The skip rule's checks on one batch and the audit's comparison (docs/design.md section 6).

``local_reasons`` lists why this rank may not skip the recompute for its shard (kernels, earlier
mismatch, the servers' answers, versions, probability processing, weights digest); an empty list
means it may. ``audit_compare`` compares the rolled rollout log-probs with a recompute bit for bit on
the generated tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from areal_tik.areal.consensus import server_disagreements
from areal_tik.verify.contract import compare_bits

__all__ = ["REASONS", "TikAuditError", "rolled_rollout_logprobs", "local_reasons", "skip_reasons", "audit_compare"]


REASONS = ("kernels_default", "fallback_after_mismatch", "no_server_info", "server_kernels", "fingerprint",
           "stale_versions", "server_version", "weights_digest", "logprob_definition")


class TikAuditError(RuntimeError):
    """An audit found rollout log-probs that differ from the trainer's recompute."""


def rolled_rollout_logprobs(traj: dict[str, Any]) -> torch.Tensor:
    """Rollout log-probs (token-aligned) in the next-token form ``compute_logp`` returns."""
    return torch.roll(traj["logprobs"].float(), shifts=-1, dims=-1)


def _gen_mask_rolled(traj: dict[str, Any]) -> torch.Tensor:
    return torch.roll(traj["loss_mask"].bool(), shifts=-1, dims=-1)


def local_reasons(batch: list[dict[str, Any]], version: int, *, kernels: str, fallback: bool,
                  own_fingerprint: str | None, answers: list[dict] | None, own_digest: str | None,
                  check_digest: bool = True) -> tuple[list[str], list[str]]:
    """This rank's reasons (codes from :data:`REASONS`, each once, in that order) why the recompute may
    NOT be skipped, and a detail for each that names the server or the tokens behind it; ([], []) = skip.
    ``answers``: :func:`areal_tik.areal.consensus.query_servers`'s, one per rollout server."""
    if kernels != "tik":
        return ["kernels_default"], ["actor.kernel_backend=default"]
    found: list[tuple[str, str]] = []
    if fallback:
        found.append(("fallback_after_mismatch", "an earlier audit found a mismatch"))
    found += server_disagreements(answers or [], version=version, own_fingerprint=own_fingerprint,
                                  own_digest=own_digest, check_digest=check_digest)
    for i, traj in enumerate(batch):
        gen = traj["loss_mask"].bool()
        v = traj["versions"][gen]
        if v.numel() and not bool((v == int(version)).all()):
            found.append(("stale_versions", f"sequence {i} of this shard has generated tokens of versions "
                                            f"{sorted(set(int(x) for x in v.unique()))}, trainer {int(version)}"))
            break
    codes = [r for r in REASONS if any(c == r for c, _ in found)]
    return codes, [d for _, d in found]


def skip_reasons(batch: list[dict[str, Any]], version: int, *, kernels: str, fallback: bool,
                 own_fingerprint: str | None, servers: list[dict] | None, own_digest: str | None) -> list[str]:
    """Every reason (from :data:`REASONS`) why the recompute may NOT be skipped; [] = skip. ``servers``:
    the ``/get_server_info`` answers (plain dicts, one per server)."""
    answers = None if servers is None else [{"addr": f"#{i}", "info": s} for i, s in enumerate(servers)]
    return local_reasons(batch, version, kernels=kernels, fallback=fallback, own_fingerprint=own_fingerprint,
                         answers=answers, own_digest=own_digest)[0]


def audit_compare(batch: list[dict[str, Any]], recomputed: list[torch.Tensor]) -> dict:
    """Bitwise comparison of rolled rollout log-probs with the recompute, generated tokens only."""
    rolled, fresh = [], []
    for traj, lp in zip(batch, recomputed):
        m = _gen_mask_rolled(traj).reshape(-1)
        r = rolled_rollout_logprobs(traj).reshape(-1)
        f = lp.detach().float().cpu().reshape(-1)
        n = min(r.numel(), f.numel(), m.numel())
        m = m[:n].cpu()
        rolled.append(r[:n].cpu()[m])
        fresh.append(f[:n][m])
    a = torch.cat(rolled) if rolled else torch.zeros(0)
    b = torch.cat(fresh) if fresh else torch.zeros(0)
    rep = compare_bits(b, a, name="audit recompute==rollout")
    return {"passed": rep.passed, "tokens": rep.n_compared, "mismatch_tokens": rep.n_mismatch,
            "max_abs_diff": float(rep.max_abs_diff), "first_mismatch": rep.first_mismatch}
