"""KV bytes between a GPU and the host: one pinned staging buffer per device, and the stream packed on it.

On CUDA the sender quantises a cache where it lies, packs the stream's symbols on the device
(``pack_stream_tensor``) and moves the packed bytes to the host once (``to_host``); the receiver uploads
its symbol store once (``to_device``), unpacks and dequantises it on the device. Both cross through the
device's pinned buffer in chunks, double-buffered: ``non_blocking`` copies, each half's copy waited for
(a CUDA event) before the host reads or rewrites it. One buffer per device, reused by every transfer, so
pinned memory stays bounded whatever the cache's size; a lock serialises the threads that share it (a
node's sender and receiver workers).

On the CPU nothing is staged: ``to_host`` and ``to_device`` are views or one copy, as before. The packers
are the tensor twins of ``piece_plan.pack_stream``/``unpack_stream`` and run on any device (the tests
compare them with the numpy ones on the CPU).
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from pfec.common.plan.piece_plan import PiecePlan
from pfec.common.plan.pieces import PieceKind

#: The pinned buffer's size per device, bytes (two halves of 8 MiB; grown only for a longer row).
STAGING_BYTES: Final = 16 << 20
#: Bytes a packer moves per indexed copy (its index tensor is 8x this).
PACK_CHUNK_BYTES: Final = 8 << 20
#: Tests set this to run the staged loops on the CPU too (an unpinned buffer, no events): the same code.
STAGE_ON_CPU = False


class _Staging:
    """One device's pinned buffer, cut in two halves that alternate."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.half = nbytes // 2
        self.pinned = device.type == "cuda"
        self.buffer = torch.empty(2 * self.half, dtype=torch.uint8, pin_memory=self.pinned)
        self.events: list[torch.cuda.Event | None] = [None, None]

    def grow(self, row_bytes: int) -> None:
        """Make each half hold at least one row (caller holds the lock)."""
        if row_bytes > self.half:
            self.wait()
            self.half = row_bytes
            self.buffer = torch.empty(2 * row_bytes, dtype=torch.uint8, pin_memory=self.pinned)

    def side(self, i: int) -> torch.Tensor:
        return self.buffer[i * self.half : (i + 1) * self.half]

    def settle(self, i: int) -> None:
        """Wait until half i's last copy is done."""
        event = self.events[i]
        if event is not None:
            event.synchronize()
            self.events[i] = None

    def mark(self, i: int) -> None:
        """Record half i's copy (a CUDA event; the CPU's copies are done on return)."""
        if not self.pinned:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.events[i] = event

    def wait(self) -> None:
        self.settle(0)
        self.settle(1)


_STAGING: dict[torch.device, _Staging] = {}
_STAGING_LOCK = threading.Lock()


def staging(device: torch.device) -> _Staging:
    """The device's staging buffer, made on first use."""
    if device.type != "cuda":
        key = torch.device("cpu")
    else:
        key = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    with _STAGING_LOCK:
        found = _STAGING.get(key)
        if found is None:
            found = _STAGING[key] = _Staging(key, STAGING_BYTES)
        return found


def _rows(n_rows: int, row_bytes: int, half: int) -> list[tuple[int, int]]:
    per = max(1, half // max(1, row_bytes))
    return [(r, min(n_rows, r + per)) for r in range(0, n_rows, per)]


def to_host(src: torch.Tensor, out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """The bytes of ``src`` [rows, C] (uint8) in host memory: written into ``out`` (same shape, any row
    stride) or a new array. On CUDA through the pinned buffer, chunks of rows alternating halves: the copy
    of one chunk runs while the host reads the previous."""
    if src.dtype != torch.uint8 or src.dim() != 2:
        raise ValueError(f"to_host moves 2-D uint8 tensors, got {src.dtype} {tuple(src.shape)}")
    target = np.empty(tuple(src.shape), dtype=np.uint8) if out is None else out
    if target.shape != tuple(src.shape):
        raise ValueError(f"host array {target.shape} does not match the tensor {tuple(src.shape)}")
    if src.device.type != "cuda" and not STAGE_ON_CPU:
        np.copyto(target, src.numpy())
        return target
    src = src.contiguous()
    n_rows, width = src.shape
    stage = staging(src.device)
    with stage.lock:
        stage.grow(width)
        chunks = _rows(n_rows, width, stage.half)
        for j, (a, b) in enumerate(chunks):
            i = j % 2
            stage.settle(i)  # its bytes were read by the host two chunks ago; the event is long done
            stage.side(i)[: (b - a) * width].copy_(src[a:b].reshape(-1), non_blocking=True)
            stage.mark(i)
            if j:
                _read(stage, 1 - i, chunks[j - 1], width, target)
        if chunks:
            _read(stage, (len(chunks) - 1) % 2, chunks[-1], width, target)
    return target


def _read(stage: _Staging, i: int, rows: tuple[int, int], width: int, target: npt.NDArray[np.uint8]) -> None:
    """Synchronise on half i's copy, then read its rows into ``target``."""
    a, b = rows
    stage.settle(i)
    np.copyto(target[a:b], stage.side(i)[: (b - a) * width].numpy().reshape(b - a, width))


def to_device(array: npt.NDArray[np.uint8], device: torch.device) -> torch.Tensor:
    """Host bytes [rows, C] (any row stride) as a uint8 tensor on ``device``. On CUDA through the pinned
    buffer: the host fills one half while the other's upload runs; the upload is ordered before any later
    work on the current stream, and the buffer is free again on return."""
    if array.dtype != np.uint8 or array.ndim != 2:
        raise ValueError(f"to_device moves 2-D uint8 arrays, got {array.dtype} {array.shape}")
    if device.type != "cuda" and not STAGE_ON_CPU:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)
    n_rows, width = array.shape
    out = torch.empty((n_rows, width), dtype=torch.uint8, device=device)
    stage = staging(device)
    with stage.lock:
        stage.grow(width)
        for j, (a, b) in enumerate(_rows(n_rows, width, stage.half)):
            i = j % 2
            stage.settle(i)  # its previous upload is done: the host may rewrite it
            half = stage.side(i)[: (b - a) * width]
            np.copyto(half.numpy().reshape(b - a, width), array[a:b])
            out[a:b].reshape(-1).copy_(half, non_blocking=True)
            stage.mark(i)
        stage.wait()
    return out


# --- The stream, packed and unpacked as tensors ------------------------------------------------------------


def _classes(plan: PiecePlan, kind: PieceKind) -> list[tuple[npt.NDArray[np.int64], int]]:
    """Plan indices of ``kind``'s pieces grouped by size (as ``piece_plan`` groups them)."""
    idx = np.flatnonzero(plan.kinds == kind)
    sizes = plan.sizes[idx]
    return [(idx[sizes == s], int(s)) for s in np.unique(sizes)]


def _spans(plan: PiecePlan, kind: PieceKind, device: torch.device,
           ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(stream byte index [n * size], blocks [n], size) per chunk of ``kind``'s pieces of one size."""
    spans = []
    for idx, size in _classes(plan, kind):
        per = max(1, PACK_CHUNK_BYTES // size)
        steps = torch.arange(size, dtype=torch.int64, device=device)
        for first in range(0, idx.size, per):
            part = idx[first : first + per]
            starts = torch.from_numpy(plan.offsets[part]).to(device)
            spans.append(((starts[:, None] + steps).reshape(-1),
                          torch.from_numpy(plan.blocks[part]).to(device), size))
    return spans


def _piece_shape(plan: PiecePlan, kind: PieceKind) -> tuple[int, int]:
    return plan.layout.n_blocks, plan.layout.piece_size(kind, plan.layout.block_tokens)


def pack_stream_tensor(plan: PiecePlan, pieces: dict[PieceKind, torch.Tensor]) -> torch.Tensor:
    """The plan's symbols [n_symbols, symbol_size] (uint8, on the pieces' device): ``pack_stream`` on
    tensors, so a GPU packs where it quantised."""
    kinds = [PieceKind(k) for k in np.unique(plan.kinds).tolist()]
    device = next(iter(pieces.values())).device if pieces else torch.device("cpu")
    stream = torch.zeros(plan.n_symbols * plan.symbol_size, dtype=torch.uint8, device=device)
    for kind in kinds:
        rows = pieces.get(kind)
        want = _piece_shape(plan, kind)
        if rows is None or rows.dtype != torch.uint8 or tuple(rows.shape) != want:
            got = None if rows is None else f"{tuple(rows.shape)} {rows.dtype}"
            raise ValueError(f"{kind.name} piece bytes are {got}, the plan needs {want} uint8")
        for where, blocks, size in _spans(plan, kind, device):
            stream[where] = rows[blocks, :size].reshape(-1)
    return stream.view(plan.n_symbols, plan.symbol_size)


def unpack_stream_tensor(plan: PiecePlan, symbols: torch.Tensor) -> dict[PieceKind, torch.Tensor]:
    """Piece bytes by kind from a symbol store [n_symbols, symbol_size] on any device (rows of absent
    pieces zero): ``unpack_stream`` on tensors."""
    if symbols.dtype != torch.uint8 or tuple(symbols.shape) != (plan.n_symbols, plan.symbol_size):
        raise ValueError(f"symbol store has shape {tuple(symbols.shape)} {symbols.dtype}, the plan needs "
                         f"({plan.n_symbols}, {plan.symbol_size}) uint8")
    stream = symbols.contiguous().reshape(-1)
    out: dict[PieceKind, torch.Tensor] = {}
    for kind in [PieceKind(k) for k in np.unique(plan.kinds).tolist()]:
        rows = torch.zeros(_piece_shape(plan, kind), dtype=torch.uint8, device=symbols.device)
        for where, blocks, size in _spans(plan, kind, symbols.device):
            rows[blocks, :size] = stream[where].view(-1, size)
        out[kind] = rows
    return out
