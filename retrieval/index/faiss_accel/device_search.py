"""Exact vector search on an accelerator, beside the embedded FAISS index.

A set's vectors are mirrored as one half-precision matrix on the device (with a live mask, so deletes cost
nothing); a search is one matrix product and a top-k per query batch, then the few candidates are re-scored exactly
in float32 from the FAISS index, so results equal exact float32 search (the index congruence suite checks it) while
the pass over the whole set reads 2 bytes per value. At 1M x 2048 that is 4 GB per query batch, read in little more
than a millisecond at an H100's ~3 TB/s, where an HNSW graph on a CPU needs milliseconds and gives up exactness.
Where the GPU multiplies float8 (compute capability 8.9 and up: Ada, Hopper) the matrix is kept in float8 e4m3
instead, 1 byte per value (``precision``): the pass reads half as much, and the few thousand-th of a score it loses
only decides which candidates are re-scored (4x oversampled), not their final scores.
``bench/ann_recall.py --precision float16,float8`` measures both.

Two implementations sit behind :class:`DeviceMatrix`, chosen by :func:`make_device_matrix`: torch (CUDA,
or the CPU for tests) and faiss-gpu (``faiss.StandardGpuResources`` + ``GpuIndexFlatIP``) where that build
of faiss is installed. The faiss-gpu one is not exercised in CI or on the device box (no CUDA 12 cuBLAS
there); the torch one is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

OVERSAMPLE = 4  # candidates per wanted hit taken from the half-precision pass, then re-scored exactly
EXTRA = 16
# float8 e4m3 keeps 3 mantissa bits down to 2**-6; unit vectors' components (|x| <= 1, typically ~1/sqrt(D))
# are scaled into that range, and 256 keeps even a one-hot vector below the format's largest value (448).
FP8_SCALE = 256.0
FP8_MAX = 448.0
PRECISIONS = ("auto", "float16", "float8")
# On CUDA a mirror's work runs on a high-priority side stream: a search's read-back then waits for its own few
# kernels, not for every pass the models queued on the default stream before it (a search holds its set's lock
# meanwhile, and the set's other searches queue on it). The stream comes from torch's pool of this priority, which
# only mirrors draw from (GPU preprocessing takes -1's, whose streams it shares under its own turns; a mirror sharing
# one would break them).
PRIORITY = -2


class DeviceMatrix(Protocol):
    """One set's vectors on an accelerator, addressed by FAISS slot."""

    @property
    def nbytes(self) -> int: ...

    def append(self, rows: npt.NDArray[np.float32]) -> None:
        """Add rows at the next slots (in slot order)."""
        ...

    def kill(self, slots: npt.ArrayLike) -> None:
        """Mark slots dead; they are never returned again."""
        ...

    def candidates(self, queries: npt.NDArray[np.float32], n: int,
                   allowed: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.int64]:
        """``[Q, n]`` slots with the highest half-precision scores, best first (-1 pads); with ``allowed``
        (a filter's slots as a little-endian packed bitmap, live ones only), only those slots."""
        ...


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def float8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies float8 on ``device``: CUDA from compute capability 8.9, and the
    CPU (a reference implementation, for tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


class TorchMatrix:
    """:class:`DeviceMatrix` on torch: a preallocated ``[capacity, D]`` buffer (doubled when full, so appends
    are amortised O(rows)) and a boolean live mask. ``precision``: "float16" (bfloat16 on a CPU), "float8"
    (e4m3, a fixed scale; rows and columns padded to multiples of 16 as the float8 matrix product needs), or
    "auto": float8 on a CUDA device that multiplies it, else float16."""

    def __init__(self, dim: int, device: str | torch.device, *, capacity: int = 1024,
                 precision: str = "auto") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current GPU now, not a later one
            self.device = torch.device("cuda", torch.cuda.current_device())
        if precision not in PRECISIONS:
            raise ValueError(f"unknown device search precision {precision!r}; choose one of {PRECISIONS}")
        if precision == "auto":
            precision = "float8" if self.device.type == "cuda" and float8_supported(self.device) else "float16"
        if precision == "float8" and not float8_supported(self.device):
            raise ValueError(f"{self.device} does not multiply float8 (needs compute capability 8.9+); "
                             "set the device search precision to float16 or auto")
        self.fp8 = precision == "float8"
        if self.fp8:
            self.dtype = torch.float8_e4m3fn
        else:
            # float16 keeps 3 more mantissa bits than bfloat16 (unit vectors need no range); CPUs do bfloat16 well
            self.dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        self.dim = dim
        width = _round16(dim) if self.fp8 else dim
        self.rows = 0
        self.dead = 0
        # every tensor of the mirror is made and used on this stream, so the allocator never hands its memory to
        # another stream while a search still reads it
        self._stream = (torch.cuda.Stream(self.device, priority=PRIORITY)
                        if self.device.type == "cuda" else None)
        with self._on_stream():
            self._data = torch.zeros((_round16(capacity), width), dtype=self.dtype, device=self.device)
            self._live = torch.zeros(self._data.shape[0], dtype=torch.bool, device=self.device)
            if self.fp8:
                self._inv = torch.tensor(1.0 / FP8_SCALE, dtype=torch.float32, device=self.device)
            self._bit = torch.arange(8, dtype=torch.uint8, device=self.device)  # a packed mask's bit order

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    @property
    def nbytes(self) -> int:
        return int(self._data.numel() * self._data.element_size())

    def _convert(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return rows.to(self.dtype)
        # never scaled in place: on the CPU ``rows`` may share the caller's numpy memory
        return (rows.float() * FP8_SCALE).clamp_(-FP8_MAX, FP8_MAX).to(self.dtype)

    def append(self, rows: npt.NDArray[np.float32]) -> None:
        with self._on_stream():
            self._append(rows)

    def _append(self, rows: npt.NDArray[np.float32]) -> None:
        n = int(rows.shape[0])
        if self.rows + n > self._data.shape[0]:
            capacity = _round16(max(self.rows + n, 2 * self._data.shape[0]))
            data = torch.zeros((capacity, self._data.shape[1]), dtype=self.dtype, device=self.device)
            data[: self.rows] = self._data[: self.rows]
            live = torch.zeros(capacity, dtype=torch.bool, device=self.device)
            live[: self.rows] = self._live[: self.rows]
            self._data, self._live = data, live
        block = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(self.device, non_blocking=True)
        self._data[self.rows : self.rows + n, : self.dim] = self._convert(block)
        self._live[self.rows : self.rows + n] = True
        self.rows += n

    def kill(self, slots: npt.ArrayLike) -> None:
        with self._on_stream():
            index = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device)
            if index.numel():
                self._live[index] = False
                self.dead += int(index.numel())

    def _scores(self, queries: npt.NDArray[np.float32]) -> torch.Tensor:
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)
        if not self.fp8:
            return q.to(self.dtype) @ self._data[: self.rows].T
        # float8 products need rows and the shared width in multiples of 16, and the second operand
        # column-major: the stored rows transposed are exactly that (the whole padded buffer, sliced after).
        padded = torch.zeros((_round16(q.shape[0]), self._data.shape[1]), dtype=torch.float32, device=self.device)
        padded[: q.shape[0], : self.dim] = q
        out = torch._scaled_mm(self._convert(padded), self._data.T, scale_a=self._inv, scale_b=self._inv,
                               out_dtype=torch.float32)
        return out[: q.shape[0], : self.rows]

    def _unpacked(self, bits: npt.NDArray[np.uint8]) -> torch.Tensor:
        """A packed bitmap over slots as a boolean tensor of ``rows``: sent as it is (n/8 bytes) and unpacked by a
        GPU, or unpacked by numpy for a CPU device (torch's CPU uint8 kernels are far slower at it)."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.unpackbits(bits, count=self.rows, bitorder="little").view(bool))
        packed = torch.from_numpy(bits).to(self.device, non_blocking=True)
        return ((packed.unsqueeze(1) >> self._bit) & 1).view(-1)[: self.rows].bool()

    @torch.inference_mode()
    def candidates(self, queries: npt.NDArray[np.float32], n: int,
                   allowed: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.int64]:
        with self._on_stream():
            return self._candidates(queries, n, allowed)

    def _candidates(self, queries: npt.NDArray[np.float32], n: int,
                    allowed: npt.NDArray[np.uint8] | None) -> npt.NDArray[np.int64]:
        scores = self._scores(queries)
        if allowed is not None:  # a filter's slots (live only): the others' scores become -inf
            scores.masked_fill_(self._unpacked(~allowed), float("-inf"))
        elif self.dead:  # a set without deletes skips the mask pass over every score
            scores.masked_fill_(~self._live[: self.rows], float("-inf"))
        n = min(n, self.rows)
        top = torch.topk(scores, n, dim=1)
        slots = top.indices.masked_fill(torch.isinf(top.values), -1)
        return slots.cpu().numpy().astype(np.int64)


class FaissGpuMatrix:
    """:class:`DeviceMatrix` on faiss-gpu (``GpuIndexFlatIP`` in float16 storage), for machines whose faiss
    build has GPU support. Dead slots are filtered after the search (faiss-gpu takes no ID selector)."""

    def __init__(self, dim: int, device: int = 0) -> None:
        import faiss

        self._faiss: Any = faiss
        self._resources = faiss.StandardGpuResources()
        config = faiss.GpuIndexFlatConfig()
        config.device = device
        config.useFloat16 = True
        self._index = faiss.GpuIndexFlatIP(self._resources, dim, config)
        self._dead: set[int] = set()

    @property
    def nbytes(self) -> int:
        return int(self._index.ntotal * self._index.d * 2)

    def append(self, rows: npt.NDArray[np.float32]) -> None:
        self._index.add(np.ascontiguousarray(rows, dtype=np.float32))

    def kill(self, slots: npt.ArrayLike) -> None:
        self._dead.update(int(s) for s in np.asarray(slots).ravel())

    def candidates(self, queries: npt.NDArray[np.float32], n: int,
                   allowed: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.int64]:
        """Without an ID selector, a filter widens the search by the slots it rejects, so the result is exact
        (and costs what the rejected slots cost: the torch mirror is the fast filtered path)."""
        total = int(self._index.ntotal)
        keep = None if allowed is None else np.unpackbits(allowed, count=total, bitorder="little").view(bool)
        rejected = len(self._dead) if keep is None else total - int(np.count_nonzero(keep))
        want = min(n + rejected, total)
        _, slots = self._index.search(np.ascontiguousarray(queries, dtype=np.float32), want)
        out = np.full((slots.shape[0], n), -1, dtype=np.int64)
        for r, row in enumerate(slots):
            kept = [int(s) for s in row if s >= 0 and int(s) not in self._dead
                    and (keep is None or bool(keep[s]))][:n]
            out[r, : len(kept)] = kept
        return out


def choose(setting: str) -> str | None:
    """The device search for a setting: "auto" picks faiss-gpu (when its build and a GPU are there), else
    torch on CUDA, else none (the CPU path)."""
    if setting == "cpu":
        return None
    if setting != "auto":
        return setting
    import faiss

    if getattr(faiss, "get_num_gpus", lambda: 0)() > 0 and hasattr(faiss, "GpuIndexFlatIP"):
        return "faiss-gpu"
    return "torch" if torch.cuda.is_available() else None


def make_device_matrix(kind: str, dim: int, device: str, precision: str = "auto") -> DeviceMatrix:
    """``kind``: "torch" (on ``device``, in ``precision``) or "faiss-gpu" (float16 storage)."""
    match kind:
        case "torch":
            return TorchMatrix(dim, device, precision=precision)
        case "faiss-gpu":
            index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()  # as TorchMatrix
            return FaissGpuMatrix(dim, index)
        case _:
            raise ValueError(f"unknown device search {kind!r}; choose 'torch' or 'faiss-gpu'")


def rescore(candidates: npt.NDArray[np.int64], exact_rows: npt.NDArray[np.float32], query: npt.NDArray[np.float32],
            k: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The top ``k`` of one query's candidate slots by exact float32 inner product, best first."""
    scores = exact_rows @ query
    order = np.argsort(-scores, kind="stable")[:k]
    return candidates[order], scores[order].astype(np.float32)


def oversampled(k: int) -> int:
    return OVERSAMPLE * k + EXTRA
