"""The trainer's side of a weight update through shared memory (``actor.tik.weight_transfer: ipc``).

AReaL's ``disk`` update writes an HF checkpoint (gather to the host, safetensors to the disk) that the rollout
server then reads back: on one GPU that was 66-71% of a step in our A/Bs (docs/results.md). With ``ipc`` the
trainer keeps one buffer of its weights in the rollout dtype on its own device (``engine/weight_ipc``), refills
it after each step (a cast-copy on the device) and posts its description to each areal-tik server on this
machine (``/update_weights_from_ipc``), which copies the views into its parameters: the same tensors a checkpoint
would carry (canonical HF names, the trainer dtype cast to the compute dtype as AReaL's save casts it; tied
weights once), so the weights digest and the skip rule see what they see after a disk update.

Limits (checked when an update starts, one-line errors): a trainer world of one (the local shard is the whole
weight), servers on this machine (the handle is a CUDA IPC handle of the trainer's GPU, or shared memory).
Cost: a second copy of the weights in the compute dtype on the trainer's device.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import torch

from areal_tik.engine.server.config import IPC_ROUTE
from areal_tik.engine.weight_ipc import SharedWeights
from areal_tik.layers.weights_digest import canonical_name

__all__ = ["SharedUpdate", "local_weights", "SharedUpdateError"]


class SharedUpdateError(RuntimeError):
    """A shared-memory weight update that cannot run or that a server refused (the message says which)."""


def local_weights(model: torch.nn.Module, world_size: int = 1) -> list[tuple[str, torch.Tensor]]:
    """``(canonical HF name, whole tensor)`` of every parameter (tied ones once), without a copy: an FSDP2
    DTensor's local shard is the whole weight in a world of one."""
    if world_size != 1:
        raise SharedUpdateError(f"actor.tik.weight_transfer=ipc needs a trainer world of one (got {world_size}); "
                                "use actor.weight_update_mode=xccl or disk")
    out = []
    for name, p in model.named_parameters():
        t = p.data
        if hasattr(t, "to_local"):
            t = t.to_local()
        out.append((canonical_name(name), t))
    return out


def _post(addr: str, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("message")
        except ValueError:
            msg = None
        raise SharedUpdateError(f"{addr}{path}: HTTP {e.code}: {msg or e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SharedUpdateError(f"{addr}{path}: {e}") from None


class SharedUpdate:
    """One trainer's shared buffer (built at the first update) and the updates sent from it."""

    def __init__(self, dtype: torch.dtype, timeout: float = 600.0):
        self.dtype, self.timeout = dtype, float(timeout)
        self.shared: SharedWeights | None = None

    def send(self, model: torch.nn.Module, addresses: list[str], world_size: int = 1) -> dict:
        """Fill the buffer from ``model`` and have every server in ``addresses`` load it; returns timings and the
        servers' replies. Raises :class:`SharedUpdateError` naming the server that refused."""
        if not addresses:
            raise SharedUpdateError("actor.tik.weight_transfer=ipc: no rollout server address to update")
        t0 = time.perf_counter()
        named = local_weights(model, world_size)
        if self.shared is None:
            self.shared = SharedWeights(named, self.dtype, named[0][1].device)
        self.shared.fill(named)
        t1 = time.perf_counter()
        body = self.shared.request(with_handle=True)
        replies = []
        for addr in addresses:
            res = _post(addr, IPC_ROUTE, body, self.timeout)
            if not res.get("success"):
                raise SharedUpdateError(f"{addr}{IPC_ROUTE}: {res.get('message', res)}")
            replies.append(res)
        return {"fill_s": t1 - t0, "load_s": time.perf_counter() - t1, "replies": replies}
