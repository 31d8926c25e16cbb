"""The rollout server's side of AReaL's ``xccl`` weight update (SGLang's distributed update).

AReaL's trainer (rank 0) opens a process group with every inference worker
(``/init_weights_update_group {master_address, master_port, rank_offset, world_size,
backend, group_name}``); then, per bucket of parameters, it posts
``/update_weights_from_distributed {names, dtypes, shapes, group_name}`` and broadcasts
each tensor from rank 0, in the order of ``names``. The server receives them in that order.

:func:`join_group` opens the server's end. It must build the group exactly the way the
trainer's side does (a ``tcp://`` rendezvous whose rank 0 hosts the TCP store, the store
prefixed by the group name, then torch's group helper, which prefixes it again): every
key the two ends exchange lives under those prefixes, so any other construction never
meets the trainer. The group is not the process's default group (the server has none).

Backends: ``nccl`` needs the trainer and the server on different GPUs (NCCL refuses two
ranks on one device); ``gloo`` (AReaL's CPU platform) works anywhere, which is how the
CPU tests drive this path with AReaL's real trainer.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

from areal_tik.engine.weight_staging import WeightUpdateError, parse_dtype, parse_shape

__all__ = ["join_group", "receive_bucket", "drain_bucket", "leave_group"]


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float = 600.0):
    """Join the trainer's weight-update group as ``rank`` (1.. for inference workers); blocks
    until every rank has joined or ``timeout_s`` passes. Returns the process group."""
    if not 0 < int(rank) < int(world_size):
        raise ValueError(f"weight update group: rank {rank} is outside 1..{int(world_size) - 1} "
                         "(rank 0 is the trainer)")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight update group: backend {backend!r} is not supported (nccl or gloo)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("weight update group: backend nccl asked for, but this server has no CUDA device")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    host = master_address.strip("[]")
    url = f"tcp://[{host}]:{int(master_port)}" if ":" in host else f"tcp://{host}:{int(master_port)}"
    store, rank, world_size = next(rendezvous(url, int(rank), int(world_size), timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(int(world_size), int(rank), [], dist.Backend(backend), store,
                                      group_name=group_name, timeout=timeout, group_desc=group_name)
    _world.pg_group_ranks[pg] = {i: i for i in range(int(world_size))}
    return pg


@torch.no_grad()
def receive_bucket(pg, names: list[str], dtypes: list[str], shapes: list, device) -> dict[str, torch.Tensor]:
    """Receive one bucket: a broadcast from rank 0 per name, in order. Returns name -> tensor
    on ``device`` (the trainer's dtype, e.g. bf16 after AReaL's cast to the compute dtype)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, "
                         f"{len(shapes)} shapes")
    # every buffer before the first receive: a bad entry found mid-bucket would leave the trainer's
    # remaining broadcasts unmatched (it hangs until the group's timeout)
    from areal_tik.engine.weight_staging import WeightUpdateError, parse_dtype, parse_shape
    bufs = []
    for name, dt, shape in zip(names, dtypes, shapes):
        try:
            dtype, size = parse_dtype(dt), parse_shape(shape)
        except WeightUpdateError as e:
            raise ValueError(f"update_weights_from_distributed: {name}: {e}") from None
        bufs.append((name, torch.empty(size, dtype=dtype, device=device)))
    out = {}
    for name, t in bufs:
        dist.broadcast(t, src=0, group=pg)
        out[name] = t
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return out


def drain_bucket(pg, dtypes: list, shapes: list, device, max_bytes: int) -> str:
    """Receive a refused bucket's broadcasts into scratch buffers and drop them, so the
    trainer's side completes and reads the refusal instead of waiting for the group's
    timeout. Only when every dtype and shape is well formed and the bucket is at most
    ``max_bytes`` + 64 MiB (a real bucket is never larger than the model). Never raises;
    returns what was done, for the reply."""
    try:
        nbytes = 0
        for dt, shape in zip(dtypes, shapes):
            n = parse_dtype(dt).itemsize
            for x in parse_shape(shape):
                n *= x
            nbytes += n
    except WeightUpdateError as e:
        return f"its broadcasts were not received: {e}"
    if nbytes > max_bytes + (64 << 20):
        return f"its broadcasts were not received: {nbytes} bytes is more than the model holds"
    try:
        receive_bucket(pg, [f"t{i}" for i in range(len(dtypes))], dtypes, shapes, device)
    except Exception as e:  # noqa: BLE001 - reported in the reply
        return f"receiving its broadcasts failed: {type(e).__name__}: {e}"
    return "its broadcasts were received and dropped"


def leave_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass
