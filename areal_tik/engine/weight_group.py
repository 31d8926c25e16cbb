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

__all__ = ["join_group", "receive_bucket", "leave_group"]


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float = 600.0):
    """Join the trainer's weight-update group as ``rank`` (1.. for inference workers); blocks
    until every rank has joined or ``timeout_s`` passes. Returns the process group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

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
    import torch.distributed as dist

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, "
                         f"{len(shapes)} shapes")
    # every buffer before the first receive: a bad entry found mid-bucket would leave the trainer's
    # remaining broadcasts unmatched (it hangs until the group's timeout)
    bufs = []
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, str(dt), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"update_weights_from_distributed: {name} has unknown dtype {dt!r}")
        bufs.append((name, torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=device)))
    out = {}
    for name, t in bufs:
        dist.broadcast(t, src=0, group=pg)
        out[name] = t
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return out


def leave_group(pg) -> None:
    import torch.distributed as dist
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass
