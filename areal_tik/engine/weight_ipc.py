"""Weights handed from a trainer to a rollout server on the same machine through shared memory: no disk, no copy
through the host, no collective.

The trainer keeps one flat buffer of every weight in the rollout dtype (:class:`SharedWeights`), fills it after
each optimizer step (a cast-copy on the device) and sends the server a JSON description: the buffer's handle and
each weight's name, shape and offset (:meth:`SharedWeights.request`). The server maps the buffer once
(:func:`import_buffer`; later updates with the same ``key`` reuse the mapping) and copies the views into its
parameters (:func:`views`), as from a checkpoint. On a GPU the handle is a CUDA IPC handle of the buffer's
allocation (both processes on one device: the one-GPU layout, where a disk update is most of a step); on a CPU a
``/dev/shm`` file (the tests' stand-in, the same protocol).

The handle is plain JSON, never a pickle: the server rebuilds it through torch's own IPC entry points from
checked integers and base64 byte strings, so a request cannot run code; the route serves loopback peers only.
"""
from __future__ import annotations

import base64
import math
import uuid
from typing import Iterable

import torch

__all__ = ["SharedWeights", "export_buffer", "import_buffer", "views", "check_layout", "mapped_views", "IPCError",
           "DTYPES"]

#: dtypes a shared buffer may have (by name, as in the request)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_NAMES = 1 << 20


class IPCError(ValueError):
    """A shared-weights description that cannot be used (the message names the field)."""


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(field: str, v) -> bytes:
    if not isinstance(v, str) or len(v) > 4096:
        raise IPCError(f"handle.{field} must be a base64 string of at most 4,096 characters")
    try:
        return base64.b64decode(v, validate=True)
    except ValueError:
        raise IPCError(f"handle.{field} is not valid base64") from None


def _int(field: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise IPCError(f"handle.{field} must be an integer >= {lo}, got {v!r}")
    return v


def export_buffer(buf: torch.Tensor) -> dict:
    """A JSON-able handle of the contiguous 1-D tensor ``buf`` for another process on this machine: CUDA IPC for
    a CUDA tensor (``torch.multiprocessing``'s own sharing), a shared-memory file for a CPU tensor (the tensor is
    moved to shared memory). ``buf`` must stay alive while the importer uses it."""
    if buf.dim() != 1 or not buf.is_contiguous():
        raise IPCError("export_buffer: a contiguous 1-D tensor")
    dtype = next((n for n, d in DTYPES.items() if d == buf.dtype), None)
    if dtype is None:
        raise IPCError(f"export_buffer: dtype {buf.dtype} is not one of {sorted(DTYPES)}")
    if buf.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor
        _, a = reduce_tensor(buf)
        (_, _, _, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event_handle,
         event_sync) = a
        return {"kind": "cuda", "dtype": dtype, "numel": buf.numel(), "device": int(device), "offset": int(offset),
                "handle": _b64(handle), "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes),
                "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": int(ref_offset),
                "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync)}
    storage = buf.untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()            # the importer's reference, as torch's own CPU reduction takes it
    return {"kind": "shm", "dtype": dtype, "numel": buf.numel(), "offset": buf.storage_offset(),
            "manager": _b64(manager), "filename": _b64(handle), "size_bytes": int(size)}


def import_buffer(h) -> torch.Tensor:
    """The tensor behind a handle of :func:`export_buffer` (a view of the exporter's memory; checked fields,
    :class:`IPCError` naming the first bad one)."""
    if not isinstance(h, dict):
        raise IPCError("handle must be an object")
    kind, dtype = h.get("kind"), DTYPES.get(h.get("dtype"))
    if dtype is None:
        raise IPCError(f"handle.dtype must be one of {sorted(DTYPES)}, got {h.get('dtype')!r}")
    numel, offset = _int("numel", h.get("numel")), _int("offset", h.get("offset"))
    size_bytes = _int("size_bytes", h.get("size_bytes"))
    if (offset + numel) * dtype.itemsize > size_bytes:
        raise IPCError(f"handle: offset {offset} + numel {numel} elements pass the buffer's {size_bytes} bytes")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise IPCError("handle.kind 'cuda' on a server without CUDA")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        event = h.get("event_handle")
        return rebuild_cuda_tensor(
            torch.Tensor, (numel,), (1,), offset, torch.UntypedStorage, dtype, _int("device", h.get("device")),
            _unb64("handle", h.get("handle")), size_bytes, _int("offset_bytes", h.get("offset_bytes")), False,
            _unb64("ref_counter_handle", h.get("ref_counter_handle")),
            _int("ref_counter_offset", h.get("ref_counter_offset")),
            None if event is None else _unb64("event_handle", event), bool(h.get("event_sync_required")))
    if kind == "shm":
        name = _unb64("filename", h.get("filename"))
        if not name.startswith(b"/torch_"):
            raise IPCError("handle.filename must name a torch shared-memory file (/torch_...)")
        storage = torch.UntypedStorage._new_shared_filename_cpu(_unb64("manager", h.get("manager")), name,
                                                                size_bytes)
        return torch.empty(0, dtype=dtype).set_(storage, offset, (numel,), (1,))
    raise IPCError(f"handle.kind must be 'cuda' or 'shm', got {kind!r}")


def check_layout(layout, numel: int) -> list[tuple[str, tuple[int, ...], int]]:
    """``[(name, shape, offset)]`` from a request's ``layout`` (a list of ``[name, shape, offset]``), each view
    inside a buffer of ``numel`` elements; :class:`IPCError` naming the first bad entry."""
    if not isinstance(layout, list) or not layout or len(layout) > MAX_NAMES:
        raise IPCError(f"layout must be a non-empty list of [name, shape, offset] (at most {MAX_NAMES})")
    out = []
    for i, e in enumerate(layout):
        if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[0] and isinstance(e[1], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e[1])
                and isinstance(e[2], int) and not isinstance(e[2], bool) and e[2] >= 0):
            raise IPCError(f"layout[{i}] must be [name, [dims >= 0], offset >= 0], got {str(e)[:120]}")
        n = math.prod(e[1])
        if e[2] + n > numel:
            raise IPCError(f"layout[{i}] ({e[0]}): elements {e[2]}..{e[2] + n} pass the buffer's {numel}")
        out.append((e[0], tuple(e[1]), e[2]))
    return out


def views(buf: torch.Tensor, layout: list[tuple[str, tuple[int, ...], int]]) -> dict[str, torch.Tensor]:
    """name -> the view of ``buf`` (1-D) at its offset and shape."""
    return {name: buf[off: off + math.prod(shape)].view(shape) for name, shape, off in layout}


def mapped_views(mapped: tuple | None, key, handle, layout) -> tuple[tuple, dict[str, torch.Tensor]]:
    """The importer's side of one update: ``(mapping to keep, name -> view)``. ``mapped`` is the ``(key, buffer)``
    kept from an earlier update (or None); a request with another ``key`` maps its ``handle`` (a refused handle
    leaves ``mapped`` as it was: the caller keeps it). :class:`IPCError` names what is wrong; a handle whose memory
    cannot be mapped raises torch's ``RuntimeError``."""
    if not isinstance(key, str) or not key:
        raise IPCError("key must be a non-empty string")
    if mapped is None or mapped[0] != key:
        if handle is None:
            raise IPCError(f"buffer {key!r} is not mapped here; send its handle")
        mapped = (key, import_buffer(handle))
    buf = mapped[1]
    return mapped, views(buf, check_layout(layout, buf.numel()))


class SharedWeights:
    """The exporter's flat buffer of ``named`` (name -> tensor; floating tensors, each once: a tied weight under
    its first name) in ``dtype`` on ``device``, with a fresh ``key`` (a buffer the importer maps once)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device):
        self.layout: list[tuple[str, tuple[int, ...], int]] = []
        seen, off = set(), 0
        for name, t in named:
            if not t.is_floating_point() or id(t) in seen:
                continue
            seen.add(id(t))
            self.layout.append((name, tuple(t.shape), off))
            off += t.numel()
        if not self.layout:
            raise IPCError("SharedWeights: no floating-point tensors to share")
        self.buffer = torch.empty(off, dtype=dtype, device=device)
        self.key = uuid.uuid4().hex
        self.handle = export_buffer(self.buffer)
        self._views = views(self.buffer, self.layout)

    def fill(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (cast to the buffer's dtype) every shared tensor of ``named`` into the buffer; a name of the
        layout missing from ``named`` raises (nothing stale is ever sent)."""
        got = set()
        for name, t in named:
            v = self._views.get(name)
            if v is not None and name not in got:
                v.copy_(t.detach())
                got.add(name)
        missing = [n for n, _, _ in self.layout if n not in got]
        if missing:
            raise IPCError(f"SharedWeights.fill: {len(missing)} shared tensors not given, e.g. {missing[0]}")
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()   # the importer reads on its own stream

    def request(self, with_handle: bool = True) -> dict:
        """The body of ``POST /update_weights_from_ipc``: ``key``, ``layout`` and (the first time, or always)
        ``handle``."""
        body = {"key": self.key, "layout": [[n, list(s), o] for n, s, o in self.layout], "abort_all_requests": True}
        if with_handle:
            body["handle"] = self.handle
        return body
