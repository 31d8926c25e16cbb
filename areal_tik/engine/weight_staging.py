"""All-or-nothing weight updates: read and check a whole update before the first copy.

``stage(model, src)`` reads every tensor of a state dict or an HF checkpoint directory
(every ``*.safetensors`` file, else every ``pytorch_model*.bin``), checks each name, shape
and dtype against the model, casts it to the parameter's dtype and checks that every value
is finite. Nothing in the model changes while it runs; any problem raises
:class:`WeightUpdateError` naming the tensor and what was expected. ``commit(staged)`` then
copies tensors of the parameter's exact shape and dtype, a step with nothing left to refuse.

Only regular files are opened: every file of a checkpoint is checked before the first is
read, so a FIFO or a device named ``model.safetensors`` is refused instead of blocking the
reader forever.

Where the staged copy lives: on the parameter's device while :func:`device_room` says it
fits (the finiteness check is then one reduction pass per tensor on the device, and the
commit a device-to-device copy), else in host memory (checked there, copied over at the
commit). The staged copy of a whole update is a second copy of the updated weights (15.2 GB
for a 7B model in bf16) held until the commit; where it does not fit on the device the host
holds the rest, and where the host cannot either, staging fails and the update is refused
with nothing changed.

``check_specs(model, names, dtypes, shapes)`` does the name/shape/dtype checks on an xccl
bucket's declared names, dtypes and shapes, before any tensor is received.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import stat
from typing import Callable

import torch

from areal_tik.layers.moe import WritableTensors

__all__ = ["WeightUpdateError", "UnknownParameterError", "StagedWeights", "stage", "commit", "check_specs", "parse_dtype",
           "parse_shape", "target_table", "model_nbytes", "device_room", "STAGING_RESERVE_BYTES"]

# device memory left free for the engine's own work while an update is staged there
STAGING_RESERVE_BYTES = 1 << 30

# dtype names a bucket may declare (torch's own spelling, as AReaL sends them)
_DTYPES = {n: getattr(torch, n) for n in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn",
                                          "float8_e5m2", "int8", "uint8", "int16", "int32", "int64", "bool")}


class WeightUpdateError(ValueError):
    """A weight update refused before anything was copied (bad name, shape, dtype or file)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownParameterError(WeightUpdateError, KeyError):
    """The update names a tensor the model does not have (also a ``KeyError``, as before)."""


@dataclasses.dataclass
class StagedWeights:
    """Checked tensors, each already of its destination's dtype and shape, every value finite."""

    pairs: list  # [(destination tensor, source tensor)]
    names: list

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def nbytes(self) -> int:
        return sum(src.numel() * src.element_size() for _, src in self.pairs)

    @property
    def host_bytes(self) -> int:
        """Bytes staged in host memory for a destination on another device."""
        return sum(src.numel() * src.element_size() for dst, src in self.pairs if src.device != dst.device)

    def extend(self, other: "StagedWeights") -> None:
        """Add ``other`` (the next bucket of one update); a name staged twice raises
        :class:`WeightUpdateError` and leaves this one as it was."""
        twice = sorted(set(self.names) & set(other.names))
        if twice:
            raise WeightUpdateError(f"{twice[0]} appears twice in this update"
                                    + (f" (and {len(twice) - 1} more)" if len(twice) > 1 else ""))
        self.pairs += other.pairs
        self.names += other.names


def device_room(device) -> int:
    """Bytes a staged update may still take on ``device``: what the driver has free plus what
    torch's allocator holds unused, less :data:`STAGING_RESERVE_BYTES` (unbounded off CUDA: the
    host is the device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, free + unused - STAGING_RESERVE_BYTES)


def _own_tensors(model) -> dict[str, torch.Tensor]:
    table = dict(model.named_parameters())
    table.update(dict(model.named_buffers()))
    return table


def target_table(model) -> WritableTensors:
    """Every tensor an update may write (``lookup(name)``): the model's parameters and buffers by ``state_dict``
    name, and the per-expert views of fused MoE expert weights under their checkpoint names."""
    return WritableTensors(_own_tensors(model))


def _target(table: WritableTensors, name: str) -> torch.Tensor | None:
    hit = table.lookup(name)
    return None if hit is None else hit[1]


def model_nbytes(model) -> int:
    """Bytes of every tensor an update may write (0 for no model)."""
    if model is None:
        return 0
    return sum(t.numel() * t.element_size() for t in _own_tensors(model).values())


def _tied_head(model, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _check_one(table, model, name, shape: tuple, dtype: torch.dtype) -> str | None:
    """The reason ``name`` (``shape``, ``dtype``) cannot be loaded, or None when it can. Raises
    :class:`UnknownParameterError` for a name the model lacks."""
    if not isinstance(name, str) or not name:
        return f"tensor name {name!r} is not a non-empty string"
    dst = _target(table, name)
    if dst is None:
        if _tied_head(model, name):
            return None
        raise UnknownParameterError(f"unknown parameter {name!r} (the model has no tensor of that name)")
    if tuple(shape) != tuple(dst.shape):
        return f"{name} has shape {list(shape)}, the model's is {list(dst.shape)}"
    if dst.dtype.is_floating_point != dtype.is_floating_point or dtype.is_complex:
        return f"{name} has dtype {str(dtype).removeprefix('torch.')}, the model's is " \
               f"{str(dst.dtype).removeprefix('torch.')}"
    return None


def parse_dtype(name) -> torch.dtype:
    """The torch dtype spelled ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``); raises WeightUpdateError."""
    key = str(name).removeprefix("torch.") if isinstance(name, str) else None
    if key not in _DTYPES:
        raise WeightUpdateError(f"unknown dtype {name!r} (known: {', '.join(sorted(_DTYPES))})")
    return _DTYPES[key]


def parse_shape(shape) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints; raises WeightUpdateError for anything else."""
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                       for s in shape):
        raise WeightUpdateError(f"shape {shape!r} is not a list of non-negative integers")
    return tuple(shape)


def check_specs(model, names: list, dtypes: list, shapes: list) -> None:
    """Raise :class:`WeightUpdateError` unless every (name, dtype, shape) of a bucket can be
    loaded into ``model``: known names (no repeats), the model's shapes, compatible dtypes."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
    if not names:
        raise WeightUpdateError("no tensors in the update")
    table, seen = target_table(model), set()
    for name, dt, shape in zip(names, dtypes, shapes):
        why = _check_one(table, model, name, parse_shape(shape), parse_dtype(dt))
        if why is None and name in seen:
            why = f"{name} appears twice"
        if why is not None:
            raise WeightUpdateError(why)
        seen.add(name)


def _regular_files(files: list[str]) -> list[str]:
    """``files`` when every one is a regular file (a link to one is); else WeightUpdateError, before any is opened."""
    for f in files:
        try:
            mode = os.stat(f).st_mode
        except OSError as e:
            raise WeightUpdateError(f"cannot read {os.path.basename(f)}: {e.strerror or e}") from None
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a directory"
                    if stat.S_ISDIR(mode) else "not a regular file")
            raise WeightUpdateError(f"{os.path.basename(f)} is {kind}, not a regular file; nothing was read")
    return files


def _iter_checkpoint(src):
    """(name, tensor) of a state dict or a checkpoint directory; file errors become WeightUpdateError."""
    if isinstance(src, dict):
        yield from src.items()
        return
    path = str(src)
    if not os.path.isdir(path):
        raise WeightUpdateError(f"{path!r} is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    loader = "safetensors"
    if not files:
        files, loader = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin"))), "torch"
    if not files:
        raise WeightUpdateError(f"no *.safetensors or pytorch_model*.bin files in {path}")
    for f in _regular_files(files):
        try:
            if loader == "safetensors":
                from safetensors.torch import load_file  # lazy: keeps safetensors out of this module's import
                items = load_file(f)
            else:
                items = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file refuses the whole update
            raise WeightUpdateError(f"cannot read {os.path.basename(f)}: {type(e).__name__}: {e}") from e
        if not isinstance(items, dict):
            raise WeightUpdateError(f"{os.path.basename(f)} holds no state dict")
        yield from items.items()


def _place(tensor: torch.Tensor, dst: torch.Tensor, room: Callable[[torch.device], int]) -> torch.Tensor:
    """``tensor`` cast to ``dst``'s dtype, on ``dst``'s device when ``room`` says it fits there (and
    the allocation succeeds), else in host memory."""
    if dst.device.type != "cpu" and tensor.numel() * dst.element_size() <= room(dst.device):
        try:
            return tensor.to(device=dst.device, dtype=dst.dtype)
        except torch.OutOfMemoryError:  # the room was not all usable (e.g. held by a graph pool)
            pass
    return tensor.to(device="cpu", dtype=dst.dtype)


def _first_non_finite(named: list) -> str | None:
    """The first name of ``named`` ((name, tensor) pairs) whose tensor holds a NaN or an infinity,
    with how many, or None. One reduction pass per floating tensor where it lives (min and max
    propagate NaN), one read back per device."""
    flags: dict[torch.device, list] = {}
    for i, (_, t) in enumerate(named):
        if t.is_floating_point() and t.numel():
            lo_hi = torch.stack(torch.aminmax(t.reshape(-1))).float()
            flags.setdefault(t.device, []).append((i, torch.isfinite(lo_hi).all()))
    bad = []
    for items in flags.values():
        ok = torch.stack([f for _, f in items]).cpu().tolist()
        bad += [i for (i, _), good in zip(items, ok) if not good]
    if not bad:
        return None
    name, t = named[min(bad)]
    n = int((~torch.isfinite(t)).sum())
    return f"{name} holds {n} NaN or infinite value{'s' if n != 1 else ''} (of {t.numel()})"


@torch.no_grad()
def stage(model, src, room: Callable[[torch.device], int] = device_room) -> StagedWeights:
    """Read and check the whole update ``src`` (state dict or checkpoint directory) without
    touching ``model``. Guarantees: every returned source tensor has its destination's shape
    and dtype and only finite values; a name appears once; at least one tensor. Each is staged
    on its destination's device while ``room(device)`` (bytes) says it fits, else in host
    memory. Raises :class:`WeightUpdateError`."""
    table, pairs, names, seen, checked = target_table(model), [], [], set(), []
    for name, tensor in _iter_checkpoint(src):
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"{name!r} is not a tensor ({type(tensor).__name__})")
        why = _check_one(table, model, name, tuple(tensor.shape), tensor.dtype)
        if why is None and name in seen:
            why = f"{name} appears twice"
        if why is not None:
            raise WeightUpdateError(why)
        seen.add(name)
        dst = _target(table, name)
        if dst is None:  # the tied lm_head: the embedding carries it (checked for finiteness all the same)
            checked.append((name, tensor))
            continue
        try:
            placed = _place(tensor, dst, room)
        except RuntimeError as e:  # out of memory where it was to be staged
            raise WeightUpdateError(f"staging {name} failed: {type(e).__name__}: {e}".splitlines()[0]) from None
        pairs.append((dst, placed))
        names.append(name)
        checked.append((name, placed))
    if not pairs:
        raise WeightUpdateError("no tensors found")
    why = _first_non_finite(checked)
    if why is not None:
        raise WeightUpdateError(f"{why}; a diverged trainer's weights are not loaded")
    return StagedWeights(pairs, names)


@torch.no_grad()
def commit(staged: StagedWeights) -> None:
    """Copy staged tensors into the model in place (same shapes and dtypes: CUDA graphs stay valid)."""
    for dst, src in staged.pairs:
        dst.copy_(src)
