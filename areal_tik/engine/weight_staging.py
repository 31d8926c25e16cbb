"""All-or-nothing weight updates: read and check a whole update before the first copy.

``stage(model, src)`` reads every tensor of a state dict or an HF checkpoint directory
(every ``*.safetensors`` file, else every ``pytorch_model*.bin``), checks each name, shape
and dtype against the model, and casts it to the parameter's dtype. Nothing in the model
changes while it runs; any problem raises :class:`WeightUpdateError` naming the tensor
and what was expected. ``commit(staged)`` then copies tensors of the parameter's exact
shape and dtype, a step with nothing left to refuse.

``check_specs(model, names, dtypes, shapes)`` does the same checks on an xccl bucket's
declared names, dtypes and shapes, before any tensor is received.
"""
from __future__ import annotations

import dataclasses
import glob
import os

import torch

__all__ = ["WeightUpdateError", "UnknownParameterError", "StagedWeights", "stage", "commit", "check_specs", "parse_dtype",
           "parse_shape", "target_table", "model_nbytes"]

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
    """Checked tensors, each already of its destination's dtype and shape."""

    pairs: list  # [(destination tensor, source tensor)]
    names: list

    def __len__(self) -> int:
        return len(self.pairs)


def target_table(model) -> dict[str, torch.Tensor]:
    """Every tensor an update may write: parameters and buffers by ``state_dict`` name."""
    table = dict(model.named_parameters())
    table.update(dict(model.named_buffers()))
    return table


def model_nbytes(model) -> int:
    """Bytes of every tensor an update may write (0 for no model)."""
    if model is None:
        return 0
    return sum(t.numel() * t.element_size() for t in target_table(model).values())


def _tied_head(model, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _check_one(table, model, name, shape: tuple, dtype: torch.dtype) -> str | None:
    """The reason ``name`` (``shape``, ``dtype``) cannot be loaded, or None when it can. Raises
    :class:`UnknownParameterError` for a name the model lacks."""
    if not isinstance(name, str) or not name:
        return f"tensor name {name!r} is not a non-empty string"
    dst = table.get(name)
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
    for f in files:
        try:
            if loader == "safetensors":
                from safetensors.torch import load_file
                items = load_file(f)
            else:
                items = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file refuses the whole update
            raise WeightUpdateError(f"cannot read {os.path.basename(f)}: {type(e).__name__}: {e}") from e
        if not isinstance(items, dict):
            raise WeightUpdateError(f"{os.path.basename(f)} holds no state dict")
        yield from items.items()


@torch.no_grad()
def stage(model, src) -> StagedWeights:
    """Read and check the whole update ``src`` (state dict or checkpoint directory) without
    touching ``model``. Guarantees: every returned source tensor has its destination's shape
    and dtype; a name appears once; at least one tensor. Raises :class:`WeightUpdateError`."""
    table, pairs, names, seen = target_table(model), [], [], set()
    for name, tensor in _iter_checkpoint(src):
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"{name!r} is not a tensor ({type(tensor).__name__})")
        why = _check_one(table, model, name, tuple(tensor.shape), tensor.dtype)
        if why is None and name in seen:
            why = f"{name} appears twice"
        if why is not None:
            raise WeightUpdateError(why)
        seen.add(name)
        dst = table.get(name)
        if dst is None:  # the tied lm_head: the embedding carries it
            continue
        pairs.append((dst, tensor if tensor.dtype == dst.dtype else tensor.to(dtype=dst.dtype)))
        names.append(name)
    if not pairs:
        raise WeightUpdateError("no tensors found")
    return StagedWeights(pairs, names)


@torch.no_grad()
def commit(staged: StagedWeights) -> None:
    """Copy staged tensors into the model in place (same shapes and dtypes: CUDA graphs stay valid)."""
    for dst, src in staged.pairs:
        dst.copy_(src)
