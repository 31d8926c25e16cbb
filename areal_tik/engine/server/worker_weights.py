"""The rollout server's weight-update commands, all or nothing.

:class:`WeightUpdateCommands` is a mixin of ``server.EngineWorker``; its methods run in the
engine thread. It uses the worker's ``engine``, ``groups``, ``_active``,
``_dist_update_open``, ``abort_all``, ``interval_stats``, ``_interval_reset`` and
``model_info``. An update is read and checked in full (``engine.stage_weights``) before
requests are aborted or a single tensor is copied: a refused update leaves the weights, the
version, the weights digest and the interval counters exactly as they were, and raises
:class:`RequestError` (400; 409 for requests in flight without ``abort_all_requests``) or
the checker's ``WeightUpdateError``, whose message the reply carries.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from areal_tik.engine.server.request_validation import RequestError

__all__ = ["WeightUpdateCommands"]


class WeightUpdateCommands:
    def cmd_update_weights(self, path: str, abort: bool):
        self._dist_update_open = False
        return self._load(lambda: path, abort, new_version=True, what="update_weights_from_disk", with_info=True)

    def cmd_update_from_distributed(self, req: dict):
        """One bucket of an xccl update (``req`` from ``parse_distributed_update``): receive (in
        this thread, the only one touching the model) and load it. The first bucket after a
        pause opens a new version. A bucket refused before receiving (unknown name, wrong
        shape or dtype, requests in flight) is still received and dropped when its size is
        sane, so the trainer's broadcasts complete and it gets the reply."""
        from areal_tik.engine.server.weight_group import drain_bucket, receive_bucket
        from areal_tik.engine.weight_staging import model_nbytes
        pg = self.groups.get(req["group_name"])
        if pg is None:
            raise RequestError(f"update_weights_from_distributed: no weight update group {req['group_name']!r} "
                               f"(known: {sorted(self.groups)}); call /init_weights_update_group first")
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        device = getattr(self.engine, "device", "cpu")
        problem = self._conflict("update_weights_from_distributed", req["abort"])
        check = getattr(self.engine, "check_weight_specs", None)
        if problem is None and check is not None:
            try:
                check(names, dtypes, shapes)
            except ValueError as e:  # WeightUpdateError (UnknownParameterError is a KeyError too)
                problem = RequestError(f"update_weights_from_distributed: {e}", 400)
        if problem is not None:
            how = drain_bucket(pg, dtypes, shapes, device, max_bytes=model_nbytes(getattr(self.engine, "model", None)))
            raise RequestError(f"{problem.message}; nothing was loaded ({how})", problem.status)
        bucket = receive_bucket(pg, names, dtypes, shapes, device)
        res = self._load(lambda: bucket, req["abort"], new_version=not self._dist_update_open,
                         what="update_weights_from_distributed", with_info=False)
        self._dist_update_open = True  # only once a bucket loaded: a failed first bucket opens no version
        return res

    def _conflict(self, what: str, abort: bool) -> RequestError | None:
        if not abort and self._active:
            return RequestError(f"{what}: {len(self._active)} requests in flight and abort_all_requests=false "
                                "(pause generation first, or set abort_all_requests)", 409)
        return None

    def _load(self, source: Callable[[], Any], abort: bool, new_version: bool, what: str, with_info: bool):
        """All or nothing: the update is read and checked (``engine.stage_weights``) before
        requests are aborted or anything is copied; on any refusal the weights, version,
        digest and interval counters are the old ones. ``with_info``: also compute the model
        info (weights digest) now; a bucket leaves it to the next ``/get_server_info`` (only
        the last bucket's digest would mean anything)."""
        problem = self._conflict(what, abort)
        if problem is not None:
            raise problem
        t0 = time.perf_counter()
        stage = getattr(self.engine, "stage_weights", None)
        staged = stage(source()) if stage is not None else None
        if abort:
            self.abort_all()
        version = int(self.engine.version) + (1 if new_version else 0)
        if staged is not None:
            self.engine.commit_weights(staged, version)
        else:
            self.engine.update_weights(source(), version)
        dt = time.perf_counter() - t0
        interval = None
        if new_version:
            interval = self.interval_stats()
            self._interval_reset()
        t1 = time.perf_counter()
        info = self.model_info() if self.model_info and with_info else {}
        return {"version": version, "load_s": dt, "info_s": time.perf_counter() - t1, "previous_interval": interval,
                **info}
