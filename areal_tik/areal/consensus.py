"""One skip decision for every trainer rank, checked against every rollout server.

With ``actor.backend: fsdp:dN`` AReaL calls ``compute_logp`` on all N ranks, each with its own
shard of the batch, and the recompute forward inside it is collective (FSDP all-gathers the
parameters layer by layer). If one rank skipped while another recomputed, the recomputing rank
would wait forever in an all-gather the other never joins. So the decision is made once:

1. **Servers**: the group's first rank asks every rollout server ``GET /get_server_info``
   (:func:`query_servers`, a timeout per server) and broadcasts the answers, so every rank judges
   the same answers. A server that does not answer (dead, hung, unreachable) is an error that
   names it (:class:`TikServerError`), raised on every rank at once; a server that answers but
   disagrees (other kernels, fingerprint, weight version, weights digest or log-prob definition)
   blocks the skip with a reason that names it (:func:`server_disagreements`).
2. **Local conditions**: each rank checks its own shard (stale ``versions``).
3. **Agreement** (:func:`agree`): the ranks exchange their reasons (one ``all_gather_object``
   over the trainer's gloo group); the run skips only if no rank has a reason, and every rank
   logs the union, with the rank behind each local reason.
4. **Audit** (:func:`global_audit`): each rank compares its own shard bit for bit; the counts are
   summed (max |diff|: the max) over the group, so every rank sees the global mismatch count and
   takes the same fallback / raise decision.

``group=None`` (or a world of one) is the single-process case: nothing is exchanged.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any, Callable

__all__ = ["TikServerError", "LOGPROB_DEFINITION", "query_servers", "server_disagreements", "agree",
           "global_audit", "broadcast_from_first", "group_rank", "group_size"]

LOGPROB_DEFINITION = "log_softmax(logits.float()/T)[token], unfiltered"


class TikServerError(RuntimeError):
    """A rollout server did not answer the pre-skip check (dead, hung or unreachable)."""


def group_size(group) -> int:
    import torch.distributed as dist
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    import torch.distributed as dist
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def query_servers(addrs: list[str], timeout: float) -> list[dict]:
    """``GET /get_server_info`` from every server, in order. Returns one entry per server:
    ``{"addr", "info"}`` (the JSON it answered) or ``{"addr", "error", "dead"}``: ``dead`` when it
    did not answer at all (connection refused or reset, timeout), not when it answered badly
    (an HTTP error status or a body that is not JSON: a foreign server, which only blocks the skip)."""
    out = []
    for a in addrs:
        try:
            with urllib.request.urlopen(f"http://{a}/get_server_info", timeout=timeout) as r:
                body = r.read()
            try:
                info = json.loads(body)
            except ValueError:
                out.append({"addr": a, "error": f"answered a body that is not JSON ({body[:80]!r})", "dead": False})
                continue
            if not isinstance(info, dict):
                out.append({"addr": a, "error": f"answered {type(info).__name__}, not a JSON object", "dead": False})
                continue
            out.append({"addr": a, "info": info})
        except urllib.error.HTTPError as e:
            out.append({"addr": a, "error": f"answered HTTP {e.code}", "dead": False})
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as e:
            why = getattr(e, "reason", None) or e
            out.append({"addr": a, "error": f"no answer ({type(why).__name__}: {why}; timeout {timeout:g} s)",
                        "dead": True})
    return out


def raise_if_dead(answers: list[dict], timeout_key: str = "actor.tik.server_timeout") -> None:
    dead = [a for a in answers if a.get("dead")]
    if not dead:
        return
    names = ", ".join(f"{a['addr']} ({a['error']})" for a in dead)
    raise TikServerError(
        f"rollout server(s) {names} did not answer GET /get_server_info; this run's servers are "
        f"{', '.join(a['addr'] for a in answers)}. The recompute may only be skipped once every server that "
        f"produced samples is checked, and a server that died cannot be: stopping the run instead of "
        f"waiting on it (the per-server timeout is {timeout_key}).")


def server_disagreements(answers: list[dict], *, version: int, own_fingerprint: str | None,
                         own_digest: str | None, check_digest: bool = True) -> list[tuple[str, str]]:
    """``(reason, detail)`` for every way every server disagrees with this trainer; the detail names
    the server. Reasons are codes of :data:`areal_tik.areal.actor.REASONS`. An empty ``answers``
    (no server known) is ``no_server_info``."""
    out: list[tuple[str, str]] = []
    if not answers:
        return [("no_server_info", "no rollout server address known to the actor")]
    for a in answers:
        addr = a.get("addr", "?")
        if "info" not in a:
            out.append(("no_server_info", f"server {addr} {a.get('error', 'gave no server info')}"))
            continue
        s = a["info"]
        if s.get("kernels") != "tik":
            out.append(("server_kernels", f"server {addr} runs kernels={s.get('kernels')!r}, not 'tik'"))
        if s.get("kernel_fingerprint") != own_fingerprint:
            out.append(("fingerprint", f"server {addr} fingerprint {s.get('kernel_fingerprint')!r} != trainer's "
                                       f"{own_fingerprint!r}"))
        if int(s.get("weight_version", -1)) != int(version):
            out.append(("server_version", f"server {addr} holds weight version {s.get('weight_version')!r}, "
                                          f"trainer {int(version)}"))
        if check_digest and s.get("weights_digest") != own_digest:
            out.append(("weights_digest", f"server {addr} weights digest {s.get('weights_digest')!r} != trainer's "
                                          f"{own_digest!r}"))
        if not str(s.get("logprobs", "")).startswith(LOGPROB_DEFINITION):
            out.append(("logprob_definition", f"server {addr} returns log-probs {s.get('logprobs')!r}"))
    return out


def _gather(obj: Any, group) -> list[Any]:
    if group_size(group) == 1:
        return [obj]
    import torch.distributed as dist
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_first(make: Callable[[], Any], group) -> Any:
    """``make()`` on the group's first rank, its value on every rank (an exception raised by
    ``make`` is carried to every rank and raised there too, so no rank is left waiting)."""
    if group_size(group) == 1:
        return make()
    import torch.distributed as dist
    box: list[Any] = [None]
    if group_rank(group) == 0:
        try:
            box[0] = ("ok", make())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    kind, val = box[0]
    if kind == "error":
        raise val
    return val


def agree(reasons: list[str], details: list[str], group, order: tuple[str, ...]) -> tuple[list[str], list[str], list[list[str]]]:
    """The union of every rank's reasons (in ``order``), their details (each once; a detail only some
    ranks have says which), and each rank's own reasons. Skip iff the union is empty: identical on
    every rank by construction."""
    every = _gather((group_rank(group), list(reasons), list(details)), group)
    every.sort(key=lambda t: t[0])
    union = [r for r in order if any(r in rs for _, rs, _ in every)]
    n = len(every)
    seen: dict[str, list[int]] = {}
    for rank, _, ds in every:
        for d in ds:
            seen.setdefault(d, []).append(rank)
    merged = [d if len(ranks) == n or n == 1 else f"{d} (rank{'s' if len(ranks) > 1 else ''} "
              f"{','.join(map(str, ranks))})" for d, ranks in seen.items()]
    return union, merged, [rs for _, rs, _ in every]


def global_audit(local: dict, group) -> dict:
    """Sum of the ranks' audit counts (max of max |diff|), the first mismatch of the lowest rank
    that has one, and each rank's own counts."""
    every = _gather((group_rank(group), local), group)
    every.sort(key=lambda t: t[0])
    tokens = sum(int(r["tokens"]) for _, r in every)
    mism = sum(int(r["mismatch_tokens"]) for _, r in every)
    first = next(((rank, r["first_mismatch"]) for rank, r in every if r.get("first_mismatch") is not None), None)
    return {"passed": mism == 0 and all(r["passed"] for _, r in every), "tokens": tokens, "mismatch_tokens": mism,
            "max_abs_diff": max(float(r["max_abs_diff"]) for _, r in every),
            "first_mismatch": None if first is None else (first[1] if len(every) == 1 else
                                                          f"rank {first[0]}: {first[1]}"),
            "per_rank": [{"tokens": int(r["tokens"]), "mismatch_tokens": int(r["mismatch_tokens"])} for _, r in every]}
