"""The rollout server's weight-update commands, all or nothing.

:class:`WeightUpdateCommands` is a mixin of ``server.EngineWorker``; its methods run in the
engine thread. It uses the worker's ``engine``, ``groups``, ``paused``, ``_active``,
``abort_all``, ``interval_stats``, ``_interval_reset`` and ``model_info``.

An update is read and checked in full (``engine.stage_weights``: names, shapes, dtypes, every
value finite) before requests are aborted or a single tensor is copied: a refused update
leaves the weights, the version, the weights digest and the interval counters exactly as they
were, and raises :class:`RequestError` (400; 409 for requests in flight without
``abort_all_requests``) or the checker's ``WeightUpdateError``, whose message the reply carries.

A distributed (xccl) update is several buckets between ``/pause_generation`` and
``/continue_generation`` (AReaL's trainer sends them so): every bucket is received, checked
and staged, and the whole update is applied at ``/continue_generation``, the version advancing
once. A bucket refused anywhere in it refuses the whole update: later buckets of the same
update are received and dropped, and continue applies nothing. Cost: the staged buckets are a
second copy of the updated weights, held until continue (on the device while it has room,
else in host memory: ``weight_staging``). A bucket sent outside a pause is an update of its
own, applied at once.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from areal_tik.engine.server.request_validation import RequestError

__all__ = ["WeightUpdateCommands", "OpenUpdate"]

logger = logging.getLogger("areal_tik.server")


class OpenUpdate:
    """A distributed update being staged: its buckets so far (``staged``: one ``StagedWeights``
    for an engine with ``stage_weights``, else ``tensors``, name -> tensor), or the reason it
    was refused (then nothing of it is ever applied)."""

    def __init__(self):
        self.staged = None
        self.tensors: dict = {}
        self.buckets = 0
        self.refused: str | None = None
        self.t0 = time.perf_counter()

    def summary(self) -> dict:
        n = len(self.staged) if self.staged is not None else len(self.tensors)
        out = {"buckets": self.buckets, "tensors": n}
        if self.staged is not None:
            out.update(staged_bytes=self.staged.nbytes, staged_on_host_bytes=self.staged.host_bytes)
        return out


class WeightUpdateCommands:
    _open_update: OpenUpdate | None = None
    _ipc_buffer: tuple | None = None     # (key, the trainer's shared buffer mapped here)

    def _no_open_update(self, what: str) -> None:
        if self._open_update is not None:
            raise RequestError(f"{what}: a distributed weight update is being staged; "
                               "/continue_generation applies it (or drops it if refused) first", 409)

    def cmd_update_weights(self, path: str, abort: bool):
        self._no_open_update("update_weights_from_disk")
        return self._load(lambda: path, abort, what="update_weights_from_disk", with_info=True)

    def cmd_update_from_ipc(self, req: dict):
        """An update from the trainer's shared buffer (``engine/weight_ipc``; ``req`` from ``parse_ipc_update``):
        the buffer is mapped at its first update (a new key replaces the old mapping), its views loaded as a
        checkpoint's tensors would be (checked in full first, all or nothing)."""
        # lazy: keeps torch out of this module's import
        from areal_tik.engine.weight_ipc import IPCError, mapped_views
        what = "update_weights_from_ipc"
        self._no_open_update(what)
        try:
            self._ipc_buffer, tensors = mapped_views(self._ipc_buffer, req["key"], req["handle"], req["layout"])
        except IPCError as e:
            raise RequestError(f"{what}: {e}", 400) from None
        except RuntimeError as e:   # the handle's memory could not be mapped (another machine, a freed buffer)
            raise RequestError(f"{what}: mapping the shared buffer failed: {str(e).splitlines()[0]}", 400) from None
        return self._load(lambda: tensors, req["abort"], what=what, with_info=True)

    def cmd_update_from_distributed(self, req: dict):
        """One bucket of an xccl update (``req`` from ``parse_distributed_update``): receive it (in
        this thread, the only one touching the model), check and stage it. During a pause it
        joins the open update (applied at continue); outside one it is applied at once. A bucket
        refused before receiving (unknown name, wrong shape or dtype, requests in flight, an
        earlier bucket refused) is still received and dropped when its size is sane, so the
        trainer's broadcasts complete and it gets the reply."""
        # lazy: keeps torch out of this module's import
        from areal_tik.engine.server.weight_group import drain_bucket, receive_bucket
        from areal_tik.engine.weight_staging import model_nbytes
        pg = self.groups.get(req["group_name"])
        if pg is None:
            raise RequestError(f"update_weights_from_distributed: no weight update group {req['group_name']!r} "
                               f"(known: {sorted(self.groups)}); call /init_weights_update_group first")
        what = "update_weights_from_distributed"
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        device = getattr(self.engine, "device", "cpu")
        upd = None
        if self.paused:
            upd = self._open_update = self._open_update or OpenUpdate()
        problem = None
        if upd is not None and upd.refused:
            problem = RequestError(f"{what}: an earlier bucket of this update was refused ({upd.refused}); "
                                   "/continue_generation ends it with nothing applied", 400)
        problem = problem or self._conflict(what, req["abort"])
        check = getattr(self.engine, "check_weight_specs", None)
        if problem is None and check is not None:
            try:
                check(names, dtypes, shapes)
            except ValueError as e:  # WeightUpdateError (UnknownParameterError is a KeyError too)
                problem = RequestError(f"{what}: {e}", 400)
        if problem is not None:
            how = drain_bucket(pg, dtypes, shapes, device, max_bytes=model_nbytes(getattr(self.engine, "model", None)))
            self._refuse_open(upd, problem.message)
            raise RequestError(f"{problem.message}; nothing was loaded ({how})", problem.status)
        t0 = time.perf_counter()
        if upd is None:  # outside a pause: an update of its own
            bucket = receive_bucket(pg, names, dtypes, shapes, device)
            return self._load(lambda: bucket, req["abort"], what=what, with_info=False)
        try:
            self._stage_bucket(upd, receive_bucket(pg, names, dtypes, shapes, device))
        except Exception as e:  # noqa: BLE001 - WeightUpdateError (a NaN, a name twice), a failed receive, OOM
            self._refuse_open(upd, f"{type(e).__name__}: {e}")
            raise RequestError(f"{what}: {e}; this update will apply nothing", 400) from None
        upd.buckets += 1
        return {"version": int(self.engine.version) + 1, "applied": False, "load_s": time.perf_counter() - t0,
                "message": "staged; the whole update is applied at /continue_generation", **upd.summary()}

    def _stage_bucket(self, upd: OpenUpdate, bucket: dict) -> None:
        stage = getattr(self.engine, "stage_weights", None)
        if stage is None:  # an engine without staging: the buckets are merged and loaded in one call
            twice = sorted(set(upd.tensors) & set(bucket))
            if twice:
                raise ValueError(f"{twice[0]} appears twice in this update")
            upd.tensors.update(bucket)
            return
        staged = stage(bucket)
        if upd.staged is None:
            upd.staged = staged
        else:
            upd.staged.extend(staged)

    def _refuse_open(self, upd: OpenUpdate | None, reason: str) -> None:
        """Mark the open update refused and drop what it staged (memory back now, not at continue)."""
        if upd is None:
            return
        upd.refused = upd.refused or reason
        upd.staged, upd.tensors = None, {}

    def close_open_update(self) -> dict | None:
        """At ``/continue_generation``: apply the open distributed update as one new version (or,
        if one of its buckets was refused, drop it); what happened, or None without one."""
        upd, self._open_update = self._open_update, None
        if upd is None:
            return None
        if upd.refused:
            logger.error("distributed weight update dropped at continue (nothing applied): %s", upd.refused)
            return {"applied": False, "refused": upd.refused, "version": int(self.engine.version)}
        summary = upd.summary()
        if upd.staged is not None:
            res = self._load(lambda: None, True, what="update_weights_from_distributed", with_info=False,
                             staged=upd.staged)
        else:
            res = self._load(lambda: upd.tensors, True, what="update_weights_from_distributed", with_info=False)
        res["load_s"] = time.perf_counter() - upd.t0
        logger.info("applied a distributed weight update of %d buckets (%d tensors) as version %d; staged %.1f MB "
                    "(%.1f MB in host memory)", summary["buckets"], summary["tensors"], res["version"],
                    summary.get("staged_bytes", 0) / 2 ** 20, summary.get("staged_on_host_bytes", 0) / 2 ** 20)
        return {"applied": True, **summary, **res}

    def _conflict(self, what: str, abort: bool) -> RequestError | None:
        if not abort and self._active:
            return RequestError(f"{what}: {len(self._active)} requests in flight and abort_all_requests=false "
                                "(pause generation first, or set abort_all_requests)", 409)
        return None

    def _load(self, source: Callable[[], Any], abort: bool, what: str, with_info: bool, staged=None):
        """All or nothing: the update is read and checked (``engine.stage_weights``, unless
        ``staged`` already is) before requests are aborted or anything is copied; on any refusal
        the weights, version, digest and interval counters are the old ones. Applied as a new
        version. ``with_info``: also compute the model info (weights digest) now."""
        problem = self._conflict(what, abort)
        if problem is not None:
            raise problem
        t0 = time.perf_counter()
        stage = getattr(self.engine, "stage_weights", None)
        if staged is None and stage is not None:
            staged = stage(source())
        if abort:
            self.abort_all()
        version = int(self.engine.version) + 1
        if staged is not None:
            self.engine.commit_weights(staged, version)
        else:
            self.engine.update_weights(source(), version)
        dt = time.perf_counter() - t0
        interval = self.interval_stats()
        self._interval_reset()
        t1 = time.perf_counter()
        info = self.model_info() if self.model_info and with_info else {}
        return {"version": version, "load_s": dt, "info_s": time.perf_counter() - t1, "previous_interval": interval,
                **info}
