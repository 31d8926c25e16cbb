"""FSDP PPO actor that runs the tik kernels and skips the old-policy recompute when safe.

:class:`TikFSDPPPOActor` subclasses AReaL's ``FSDPPPOActor``:

- the model is patched (``areal_tik.layers.patch.patch_model``, through
  :class:`~areal_tik.areal.device_model.TikModelMixin`) right after AReaL builds it and
  *before* FSDP2 wraps it, so parameter names, checkpoints and weight updates are unchanged;
- with ``kernel_backend=tik`` the trainer's log-probs come from the model's bound
  ``logprobs_from_logits`` (the function the rollout sampler uses), not AReaL's
  ``gather_logprobs``;
- ``compute_logp`` (called by the trainer under the ``recompute_logp`` timer when
  ``should_compute_prox_logp()``) decides per batch and per sequence (docs/design.md section 6).
  Per batch:
    1. ``kernel_backend=tik``, no earlier audit mismatch, and every rollout server
       reports ``kernels == "tik"`` with our kernel fingerprint;
    2. same probability processing: ``actor.temperature == gconfig.temperature``
       (checked at config load) and the server's log-probs are the unfiltered
       ``log_softmax(logits/T)``;
    3. the servers' weight version equals ours and their bf16 weight digest equals the
       digest of our compute-dtype parameters.
  If one fails, AReaL's recompute runs on the whole batch. Otherwise per sequence: one whose
  every generated token's ``versions`` entry equals the actor's current version gets its rolled
  rollout log-probs as ``prox_logp`` (exactly the shape and shift AReaL's forward returns); the
  others (stale, or mixed after a weight update interrupted them) go through AReaL's forward, only
  they (:mod:`areal_tik.areal.row_forward`), and their values are merged back in place.
- several ranks (``fsdp:dN``) take ONE decision (:mod:`areal_tik.areal.consensus`): the first
  rank asks every server and broadcasts the answers, each rank checks its own shard, the reasons
  and what each rank needs of the forward are exchanged; a batch-wide reason on any rank makes all
  recompute everything, else every rank runs as many forward micro-batches as the rank that needs
  the most (the forward is collective: a split decision would hang); a server that does not answer
  raises :class:`TikServerError` naming it, on every rank; audit counts are summed over the ranks.
  Each rank appends its records to ``actor.tik.decision_log_dir/rank<R>.jsonl`` (docs/scale-out.md).
- audit: on step 0 and every ``tik.audit_interval`` steps the forward runs on every sequence and
  is compared bit for bit (``areal_tik.verify.contract.compare_bits``) on the generated tokens of
  the current-version sequences; a mismatch (counted over every rank's shard) either switches to
  recompute for the rest of the run (``fallback``) or raises :class:`TikAuditError` (``raise``).
  The recomputed values are what training uses on audit steps.

Every decision is logged through AReaL's ``stats_tracker`` (keys ``tik/...``:
:mod:`areal_tik.areal.skip_record`) and kept in ``self.tik_records`` (one dict per batch).

Timing semantics (known, left as is): AReaL's ``timeperf/recompute_logp`` timer wraps the
whole ``compute_logp`` call, so on a skipped step it still counts the skip decision: one
``/get_server_info`` round trip per rollout server (from the first rank), the exchange of reasons
between the ranks, and the bf16 digest of the trainer's
parameters (``own_digest``: cached per weight version, and the version advances every step,
so in practice one full pass over the parameters per step; on CUDA one Triton pass over the bf16
bits, overlapped with the servers' query, which digest their copy at the same time). On 2x H200
with xccl (1.5B, before that kernel and overlap) the decision cost 0.23-0.26 s per step against a
0.36-0.43 s forward saved. ``tik/recompute_forward_s`` is
the forward alone (0.0 when skipped; the forward over the recomputed sequences when some were skipped). Single-controller mode: this actor runs in an RPC worker; the controller sends
the rollout server addresses through :meth:`set_server_addresses`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import json
import os
import threading
import time
import urllib.request
from contextlib import contextmanager
from typing import Any

import torch
from areal.api.cli_args import MicroBatchSpec
from areal.engine.fsdp_engine import FSDPPPOActor
from areal.utils import logging, stats_tracker
import torch.distributed as dist

from areal_tik.areal.consensus import (LOGPROB_DEFINITION, TikServerError, agree, broadcast_from_first,
                                       global_audit, group_rank, group_size, query_servers, raise_if_dead)
from areal_tik.areal.device_model import TikModelMixin, settings_of
from areal_tik.areal.ports import private_port_draws
from areal_tik.areal.shared_update import SharedUpdate
from areal_tik.areal.row_forward import ForwardRate, count_micro_batches, forward_rows, merge, row_tokens, units_of
from areal_tik.areal.skip_record import global_counts, log_line, shard_share, step_stats, write_decision
from areal_tik.areal.skip_rule import (REASONS, SEQUENCE_REASONS, TikAuditError, audit_compare,  # noqa: F401
                                       local_reasons, rolled_rollout_logprobs, row_reasons)
from areal_tik.dispatch.fingerprint import compute
from areal_tik.layers.weights_digest import model_digest
from areal_tik.layers.default_varlen import status as default_attention_status

logger = logging.getLogger("TikActor")

__all__ = ["TikFSDPPPOActor", "TikAuditError", "TikServerError", "local_reasons", "row_reasons",
           "rolled_rollout_logprobs", "audit_compare"]

def servers_leave_groups(addrs: list[str], names: list[str], timeout: float = 60.0) -> None:
    """Ask each rollout server to leave the named weight update groups (best effort: a server that
    is gone has nothing to leave)."""
    for a in addrs:
        for n in names:
            try:
                req = urllib.request.Request(f"http://{a}/destroy_weights_update_group",
                                             data=json.dumps({"group_name": n}).encode(),
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=timeout).read()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                logger.warning("destroy_weights_update_group %s on %s failed: %s", n, a, e)


class TikFSDPPPOActor(TikModelMixin, FSDPPPOActor):
    """``FSDPPPOActor`` on the areal-tik kernels with the recompute skip and audit."""

    def __init__(self, config):
        private_port_draws()   # in an actor worker: the weight-update group's port, apart from the run's seed
        super().__init__(config)
        self.kernels = getattr(config, "kernel_backend", "default")
        self.settings = settings_of(config, self.kernels)
        self.tik_ops = None
        self.tik_cfg = getattr(config, "tik", None)
        self.fallback = False
        self.tik_records: list[dict] = []
        self._fingerprint: str | None = None
        self._digest_cache: tuple[int, str] | None = None
        self._server_addrs_override: list[str] | None = None
        self._rate = ForwardRate()
        self._shared_update: SharedUpdate | None = None

    def destroy(self):
        """AReaL's ``destroy`` ends with ``destroy_process_group()``, which also tears down the xccl
        weight update group; NCCL makes that collective, so it waited forever for the rollout
        server (minutes in every 2x H200 A/B, cut by the harness). Rank 0 asks each server to
        leave the group while its own destroy runs."""
        pool = getattr(self, "_digest_pool", None)
        if pool is not None:  # a digest still reading the weights must end before they are freed
            pool.shutdown(wait=True, cancel_futures=True)
            self._digest_pool = self._digest_pending = None
        names = list(getattr(self, "weight_update_group_names", None) or [])
        th = None
        if names and getattr(self, "weight_update_group_initialized", False) and int(os.getenv("RANK", "0")) == 0:
            th = threading.Thread(target=servers_leave_groups, args=(self.server_addresses(), names),
                                  name="tik-leave-groups", daemon=True)
            th.start()
        try:
            return super().destroy()
        finally:
            if th is not None:
                th.join(timeout=60)

    def _update_weights_from_disk(self, meta):
        """AReaL's disk update, or with ``actor.tik.weight_transfer: ipc`` the shared buffer instead of the
        checkpoint (``shared_update``): generation paused, every server loads the buffer, generation resumed. The
        step's ``timeperf/update_weights`` covers it; ``tik/ipc_fill_s`` and ``tik/ipc_load_s`` split it."""
        if getattr(self.tik_cfg, "weight_transfer", "areal") != "ipc":
            return super()._update_weights_from_disk(meta)
        if self._shared_update is None:
            self._shared_update = SharedUpdate(self._compute_dtype(), timeout=float(self.tik_cfg.server_timeout) * 20)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rollout_engine.pause_generation()
        try:
            res = self._shared_update.send(self.model, self.server_addresses(), world)
        finally:
            self.rollout_engine.continue_generation()
        stats_tracker.scalar(**{"tik/ipc_fill_s": res["fill_s"], "tik/ipc_load_s": res["load_s"]})

    def _save_model_to_hf(self, path, tokenizer, processor):
        """AReaL's save, timed: a disk weight update is this save (trainer side) followed by the rollout
        server's load, so ``timeperf/update_weights - tik/hf_save_s`` is the server's share (``areal-tik ab``
        reports both). Every arm runs this class, the reference arm included; nothing else changes."""
        t0 = time.perf_counter()
        out = super()._save_model_to_hf(path, tokenizer, processor)
        stats_tracker.scalar(**{"tik/hf_save_s": time.perf_counter() - t0})
        return out

    # ---- log-probs through the one areal-tik function --------------------------------
    def _labels(self, inputs):
        labels = inputs.get("rolled_input_ids", torch.roll(inputs["input_ids"], shifts=-1, dims=-1))
        if labels.ndim == 2 and labels.shape[0] == 1:
            labels = labels.squeeze(0)
        return labels

    def _tik_logprobs(self, logits, labels, entropy: bool = False):
        """Log-probs (and, with ``entropy``, the entropy of softmax(logits/T) from the same pass
        over the logits, detached: a logged statistic, not part of the log-prob contract)."""
        out = self.tik_ops.logprobs_from_logits(logits, labels, float(self.config.temperature),
                                                return_entropy=entropy)
        lp = out[0] if entropy else out
        if logits.requires_grad and lp.grad_fn is None:
            raise RuntimeError("logprobs_from_logits returned no autograd graph; "
                               "the training loss needs its backward")
        return (lp, out[1].detach()) if entropy else lp

    def _compute_logprobs(self, logits, inputs, ulysses_pad_size=0):
        if self.kernels != "tik":
            return super()._compute_logprobs(logits, inputs, ulysses_pad_size)
        self._no_sp()
        return self._tik_logprobs(logits, self._labels(inputs))

    def _compute_logprobs_entropy(self, logits, inputs, ulysses_pad_size=0):
        if self.kernels != "tik":
            return super()._compute_logprobs_entropy(logits, inputs, ulysses_pad_size)
        self._no_sp()
        # one pass over the [T, V] logits for both (the separate torch entropy pass this replaces
        # re-read them about six times in fp32; the 2x H200 A/B's tik train step was 16% slower)
        return self._tik_logprobs(logits, self._labels(inputs), entropy=True)

    def _no_sp(self):
        if self.parallel_helper.sp_size > 1 or self.parallel_helper.tp_size > 1:
            raise NotImplementedError("kernel_backend=tik supports data parallelism only (sp=tp=1)")

    # ---- skip decision -------------------------------------------------------------
    def own_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = compute(self.tik_ops)["fingerprint"]   # the ops patch_model bound
        return self._fingerprint

    def _digest_now(self) -> str:
        return model_digest(self.model, dtype=getattr(torch, self.config.dtype))

    def prepare_batch(self, *args, **kwargs):
        """AReaL's rollout phase (the trainer waits for the servers): the tik actor digests its
        weights in a background thread meanwhile, so the skip decision finds the digest ready.
        Started here, not at ``set_version`` right after the weight update: there it competed
        for the GIL and the GPU with AReaL's stats commit and showed up as +0.08 s of untimed
        step time (2x H200 A/B, e2ef8f7). The weights cannot change before ``compute_logp``
        takes the digest: the optimizer runs only in the train step after it."""
        self._start_background_digest()
        return super().prepare_batch(*args, **kwargs)

    def _start_background_digest(self) -> None:
        """Only where it is safe: weights resident (an offloaded actor's memory is released until
        the recompute phase restores it) and a world of one (the digest of a sharded model
        all-gathers, and a side thread's collectives could interleave differently on each rank
        with the rollout's own); otherwise ``own_digest`` digests on the spot, as before."""
        if self.kernels != "tik" or getattr(self, "model", None) is None or getattr(self, "is_offload", False):
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return
        v = int(self.get_version())
        pending = getattr(self, "_digest_pending", None)
        if (self._digest_cache is not None and self._digest_cache[0] == v) or (pending is not None and pending[0] == v):
            return
        if getattr(self, "_digest_pool", None) is None:
            self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="tik-digest")
        dev = torch.cuda.current_device() if torch.cuda.is_available() else None

        def work():
            if dev is not None:
                torch.cuda.set_device(dev)
            return self._digest_now()
        self._digest_pending = (v, self._digest_pool.submit(work))

    def own_digest(self) -> str:
        v = self.get_version()
        if self._digest_cache is None or self._digest_cache[0] != v:
            pending = getattr(self, "_digest_pending", None)
            if pending is not None and pending[0] == v:
                self._digest_pending = None
                self._digest_cache = (v, pending[1].result())
            else:
                self._digest_cache = (v, self._digest_now())
        return self._digest_cache[1]

    def server_addresses(self) -> list[str]:
        if self._server_addrs_override is not None:
            return self._server_addrs_override
        eng = getattr(self, "rollout_engine", None)
        inner = getattr(eng, "_engine", eng)
        addrs = list(getattr(inner, "addresses", None) or [])
        if not addrs and os.getenv("AREAL_LLM_SERVER_ADDRS"):
            addrs = os.environ["AREAL_LLM_SERVER_ADDRS"].split(",")
        return addrs

    def set_server_addresses(self, addrs: list[str]) -> None:
        """Rollout servers to ask before skipping. Single-controller mode: this actor runs in an
        RPC worker that never sees the rollout engine, so the controller sends the addresses of
        the servers ``launch_server`` started (``TikPPOTrainer._init_rollout``)."""
        self._server_addrs_override = [str(a) for a in addrs]

    def query_servers(self) -> list[dict]:
        """Every rollout server's ``/get_server_info`` answer (or why there is none), in address order."""
        timeout = float(self.tik_cfg.server_timeout) if self.tik_cfg is not None else 30.0
        return query_servers(self.server_addresses(), timeout)

    def decision_group(self):
        """The process group every rank of this engine is in (AReaL's gloo ``cpu_group``), or None in a
        world of one: the skip decision and the audit are agreed over it."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return getattr(self, "_cpu_group", None) or dist.group.WORLD

    def _is_audit_step(self, version: int) -> bool:
        n = self.tik_cfg.audit_interval if self.tik_cfg is not None else 0
        return version == 0 or (n > 0 and version % n == 0)

    @torch.no_grad()
    def compute_logp(self, data, *args, **kwargs):
        version = int(self.get_version())
        rec: dict[str, Any] = {"version": version, "kernel_backend": self.kernels,
                               "gen_tokens": int(sum(int(t["loss_mask"].sum()) for t in data)),
                               "total_tokens": int(sum(int(t["attention_mask"].sum()) for t in data)),
                               "n_seqs": len(data),
                               "reward_mean": float(sum(float(t["rewards"].float().sum()) for t in data)
                                                    / max(1, sum(int(t["rewards"].numel()) for t in data)))}
        group = self.decision_group()
        rec.update(rank=group_rank(group), ranks=group_size(group))
        if self.kernels != "tik":
            t0 = time.perf_counter()
            out = super().compute_logp(data, *args, **kwargs)
            rec.update(skipped=False, forward="all", reasons=["kernels_default"], audit=False,
                       recompute_forward_s=time.perf_counter() - t0)
            rec["default_attention"] = default_attention_status()["path"]  # which baseline attention ran
            # The baseline recomputes anyway: how far are its rollout log-probs from it? (no extra forward)
            res = global_audit(audit_compare(data, out), group)
            rec.update(compare_tokens=res["tokens"], compare_mismatch_tokens=res["mismatch_tokens"],
                       compare_max_abs_diff=res["max_abs_diff"])
            self._record(rec)
            return out

        check = self.tik_cfg is None or self.tik_cfg.server_check
        if check:
            # the group's first rank asks the servers (they digest their weights meanwhile) while every
            # rank takes part in digesting the trainer's (collective under FSDP); then it shares the answers
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(1) as pool:
                asked = pool.submit(self.query_servers) if group_rank(group) == 0 else None
                own_digest = self.own_digest()
                answers = broadcast_from_first(lambda: asked.result(), group)
            rec["servers"] = [a["addr"] for a in answers]
            raise_if_dead(answers)
        else:
            answers = [{"addr": "(actor.tik.server_check=false)",
                        "info": {"kernels": "tik", "kernel_fingerprint": self.own_fingerprint(), "weight_version": version,
                                 "weights_digest": None, "logprobs": LOGPROB_DEFINITION}}]
            own_digest = self.own_digest()
        mine, details = local_reasons(data, version, kernels=self.kernels, fallback=self.fallback,
                                      own_fingerprint=self.own_fingerprint(), answers=answers, own_digest=own_digest,
                                      check_digest=check)
        why = row_reasons(data, version)
        units = units_of(why)
        need = count_micro_batches([row_tokens(data[t], r) for t, r in units], self.config.mb_spec)
        share = shard_share(data, why, need)
        agreed = agree(mine, details, group, REASONS, share=share)
        audit = self._is_audit_step(version) and not self.fallback
        total = global_counts(agreed.shares)
        seq_codes = [c for c in SEQUENCE_REASONS if total[c]]
        # nothing current on any rank: AReaL's own forward over everything (one call, its own micro-batches)
        forward = "all" if agreed.reasons or audit or not total["seqs_current"] else (
            "rows" if total["micro_batches"] else "none")
        rec.update(reasons=agreed.reasons + seq_codes, reason_details=agreed.details, audit=audit, local_reasons=mine,
                   forward=forward, skipped=forward == "none", forward_micro_batches=max(
                       s["micro_batches"] for s in agreed.shares) if forward == "rows" else None,
                   **{f"seqs_{c}": total[c] for c in SEQUENCE_REASONS})
        if group_size(group) > 1:
            rec["reasons_per_rank"] = agreed.per_rank
        if agreed.details:
            logger.info("tik: version %d, recompute needed: %s", version, "; ".join(agreed.details))
        skipping = forward != "all"
        rec.update(seqs_total=total["seqs"], gen_tokens_total=total["gen_tokens"],
                   seqs_skipped=total["seqs_current"] if skipping else 0,
                   gen_tokens_skipped=total["gen_tokens_current"] if skipping else 0,
                   recompute_saved_s=self._rate.saved(share["tokens_current"]) if skipping else 0.0)
        rec.update(skip_seq_frac=rec["seqs_skipped"] / max(1, total["seqs"]),
                   skip_token_frac=rec["gen_tokens_skipped"] / max(1, total["gen_tokens"]))
        t0 = time.perf_counter()
        if forward == "none":
            rec.update(recompute_forward_s=0.0)
            self._record(rec)
            return merge(data, {})
        if forward == "rows":
            spec = self.config.mb_spec
            with self._one_micro_batch_per_call():
                fresh, ran = forward_rows(lambda part: super(TikFSDPPPOActor, self).compute_logp(part, *args, **kwargs),
                                          data, units, rec["forward_micro_batches"], spec)
            rec.update(recompute_forward_s=time.perf_counter() - t0, forward_seqs=len(units), forward_tokens=ran)
            self._record(rec)
            return merge(data, fresh)

        out = super().compute_logp(data, *args, **kwargs)
        rec.update(recompute_forward_s=time.perf_counter() - t0)
        self._rate.measured(rec["recompute_forward_s"], rec["total_tokens"])
        if audit:
            current = [[r for r, code in enumerate(rows) if code is None] for rows in why]
            res = global_audit(audit_compare(data, out, rows=current), group)
            rec.update(audit_passed=res["passed"], audit_tokens=res["tokens"],
                       audit_mismatch_tokens=res["mismatch_tokens"], audit_max_abs_diff=res["max_abs_diff"],
                       audit_per_rank=res["per_rank"])
            if not res["passed"]:
                msg = (f"tik audit at version {version}: {res['mismatch_tokens']}/{res['tokens']} generated-token "
                       f"log-probs of current-version sequences differ between rollout and trainer (max |diff| "
                       f"{res['max_abs_diff']:.3g}, first at {res['first_mismatch']}); skip reasons otherwise: "
                       f"{rec['reasons'] or 'none'}")
                if self.tik_cfg is not None and self.tik_cfg.mismatch_policy == "raise":
                    self._record(rec)
                    raise TikAuditError(msg + " (actor.tik.mismatch_policy=raise)")
                logger.warning(msg + "; falling back to recompute for the rest of the run")
                self.fallback = True
                rec["fallback_engaged"] = True
        self._record(rec)
        return out

    @contextmanager
    def _one_micro_batch_per_call(self):
        """AReaL's forward packs a call's rows into at least ``mb_spec.n_mbs`` micro-batches (groups of
        ``granularity`` rows); the row forward plans its calls as one micro-batch each
        (:mod:`areal_tik.areal.row_forward`)."""
        spec = self.config.mb_spec
        self.config.mb_spec = MicroBatchSpec.new(spec, n_mbs=1, n_mbs_divisor=1, granularity=1)
        try:
            yield
        finally:
            self.config.mb_spec = spec

    def _record(self, rec: dict):
        self.tik_records.append(rec)
        stats_tracker.scalar(**step_stats(rec, self.fallback))
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        write_decision(rec, getattr(self.tik_cfg, "decision_log_dir", None) if self.tik_cfg is not None else None, rank)
        logger.info(log_line(rec))
