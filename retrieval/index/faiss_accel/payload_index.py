"""A set's payloads indexed by key and value, so a filter's slot mask is composed from bitmaps, not re-evaluated.

What the embedded backends (FAISS and its device search) need from a filter is a mask over the set's slots, inside
the vector search. A filter of a few conditions evaluated over per-slot columns makes several passes over boolean
masks of the whole set, plus a count over them: on the host that cost as much as the whole device search
(docs/metadata.md, "A filter met for the first time"). Here, as in Qdrant's payload index, each key keeps an
inverted index built once per set state: the slots of every value, and the slots of its numbers in sorted order.

* A condition (a *leaf*: one ``match`` or ``range``) resolves to the posting lists or the slice of sorted
  numbers it covers, and becomes a packed bitmap (one bit per slot, n/8 bytes). A leaf covering few slots is
  scattered from its postings (O(its slots)); one covering many is one vectorised comparison over its dense
  column, whichever costs less: a scatter costs a few instructions per slot it sets, a comparison a cheap
  vectorised pass over every slot, so postings serve leaves below 1/:data:`SPARSE` of the set (where the two
  were measured to cost the same: docs/performance.md, "Measurements behind the code").
* Leaves are cached (least recently used, ``LEAF_CACHE``) under what they resolved to, not how they were
  written, so ``lt 50`` and ``lte 49.5`` over integers share one; a new filter composed of known conditions costs
  only bitwise AND / OR / NOT over n/8 bytes (microseconds at 1M).
* The result is a :class:`SlotMask`: the packed bits (what faiss' ``IDSelectorBitmap`` reads and what the device
  search uploads, n/8 bytes) and their count (a popcount over 64-bit words).
* :meth:`PayloadIndex.parts` hands out the cached masks of a filter's ``must`` leaves (every row the filter keeps
  is in each), so a recurring condition can get a graph of its own that new filters containing it reuse
  (:mod:`retrieval.index.faiss_accel.filter_graphs`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.index.filters import Condition, Filter, Match, Range, Scalar, number_value, typed_value

Bits = npt.NDArray[np.uint8]
LEAF_CACHE = 64  # leaf bitmaps kept per set state: 64 x n/8 bytes (8 MB at 1M slots)
SPARSE = 8  # a leaf covering fewer than 1/SPARSE of the slots is scattered from its postings
# fewer slots than this are set bit by bit rather than packed from a whole-set mask, whichever costs less (the
# break-even measured: docs/performance.md, "Measurements behind the code")
FEW = 4096


def packed_bytes(n: int) -> int:
    """Bytes of a packed bitmap of ``n`` slots, padded to whole 64-bit words (popcount reads words)."""
    return -(-n // 64) * 8


def pack(mask: npt.NDArray[np.bool_]) -> Bits:
    """A boolean mask over slots as a padded little-endian packed bitmap (pad bits 0)."""
    padded = np.zeros(packed_bytes(len(mask)) * 8, dtype=bool)
    padded[: len(mask)] = mask
    return np.packbits(padded, bitorder="little")


def popcount(bits: Bits) -> int:
    return int(np.bitwise_count(bits.view(np.uint64)).sum())


@dataclass(frozen=True)
class SlotMask:
    """The slots a filter keeps (live ones only): packed bits over ``size`` slots and how many are set."""

    bits: Bits
    size: int
    kept: int

    def slots(self) -> npt.NDArray[np.int64]:
        """The kept slots, ascending: only the bytes holding one are unpacked (O(n/8 + kept))."""
        held = np.flatnonzero(self.bits)
        rows, bit = np.nonzero(np.unpackbits(self.bits[held, None], axis=1, bitorder="little"))
        out: npt.NDArray[np.int64] = held[rows] * 8 + bit
        return out

    @functools.cached_property
    def digest(self) -> bytes:
        """A digest of the kept slots (the set's size is in the bytes' length): equal masks, equal digests."""
        return hashlib.blake2b(self.bits.tobytes() + self.size.to_bytes(8, "little"), digest_size=16).digest()


class PayloadIndex:
    """The inverted index of one set state's payloads (``None`` for a dead slot) and its live slots.

    Per key: postings (slots per typed value) for ``match``, numbers sorted with their slots for ``range``; a key
    holding one value per slot also keeps a dense column (an integer code, or a float with NaN where absent) for
    the leaves that cover much of the set. Built once per set state (writes drop it); not thread-safe (the set's
    lock guards it).
    """

    def __init__(self, payloads: Sequence[Mapping[str, Any] | None], live: npt.NDArray[np.bool_]) -> None:
        self.size = len(payloads)
        self._padded = packed_bytes(self.size) * 8
        self.live = pack(live)
        vocabs: dict[str, dict[tuple[str, Scalar], int]] = {}
        matched: dict[str, tuple[list[int], list[int]]] = {}
        numbers: dict[str, tuple[list[int], list[float]]] = {}
        for slot, payload in enumerate(payloads):
            if not payload:
                continue
            for key, raw in payload.items():
                for value in raw if isinstance(raw, list) else [raw]:
                    typed = typed_value(value)
                    if typed is not None:
                        vocab = vocabs.setdefault(key, {})
                        slots, codes = matched.setdefault(key, ([], []))
                        slots.append(slot)
                        codes.append(vocab.setdefault(typed, len(vocab)))
                    x = number_value(value)
                    if x is not None and not math.isnan(x):  # NaN passes no range
                        slots, xs = numbers.setdefault(key, ([], []))
                        slots.append(slot)
                        xs.append(x)
        # postings of every key as one array of slots grouped by value code, and where each code's group starts
        self._postings: dict[str, tuple[dict[tuple[str, Scalar], int], npt.NDArray[np.int64],
                                        npt.NDArray[np.int64]]] = {}
        self._codes: dict[str, npt.NDArray[np.int32]] = {}
        for key, (slot_list, code_list) in matched.items():
            slots_arr, codes_arr = np.asarray(slot_list, dtype=np.int64), np.asarray(code_list, dtype=np.int32)
            order = np.argsort(codes_arr, kind="stable")
            starts = np.concatenate([[0], np.cumsum(np.bincount(codes_arr, minlength=len(vocabs[key])))])
            self._postings[key] = (vocabs[key], slots_arr[order], starts)
            if len(np.unique(slots_arr)) == len(slots_arr):  # one value per slot: a dense column too
                dense_codes = np.full(self._padded, -1, dtype=np.int32)
                dense_codes[slots_arr] = codes_arr
                self._codes[key] = dense_codes
        self._sorted: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]] = {}
        self._dense: dict[str, npt.NDArray[np.float64]] = {}
        for key, (slot_list, x_list) in numbers.items():
            slots_arr, xs_arr = np.asarray(slot_list, dtype=np.int64), np.asarray(x_list, dtype=np.float64)
            order = np.argsort(xs_arr, kind="stable")
            self._sorted[key] = (xs_arr[order], slots_arr[order])
            if len(np.unique(slots_arr)) == len(slots_arr):
                dense = np.full(self._padded, np.nan)
                dense[slots_arr] = xs_arr
                self._dense[key] = dense
        self._leaves: OrderedDict[tuple[Any, ...], SlotMask] = OrderedDict()

    def mask(self, f: Filter) -> SlotMask:
        bits = self._filter(f) & self.live
        return SlotMask(bits, self.size, popcount(bits))

    def _filter(self, f: Filter) -> Bits:
        """Packed bits of the slots passing ``f`` (dead slots too where only a ``must_not`` holds: the caller
        ANDs the live bits). Never modifies a cached leaf in place."""
        out: Bits | None = None
        for c in f.must:
            leaf = self._condition(c)
            out = leaf if out is None else out & leaf
        for c in f.must_not:
            leaf = ~self._condition(c)
            out = leaf if out is None else out & leaf
        if f.should:
            any_of = self._condition(f.should[0])
            for c in f.should[1:]:
                any_of = any_of | self._condition(c)
            out = any_of if out is None else out & any_of
        return np.full(len(self.live), 0xFF, dtype=np.uint8) if out is None else out

    def parts(self, f: Filter) -> list[SlotMask]:
        """The masks of the leaves ``f`` requires (its ``must`` leaves, nested ``must`` filters' included) and,
        where ``f`` has more than those, of their AND: every row ``f`` keeps is in each."""
        leaves: list[SlotMask] = []
        pending, whole = [f], True
        while pending:
            g = pending.pop()
            whole = whole and not (g.should or g.must_not)
            for c in g.must:
                if isinstance(c, Filter):
                    pending.append(c)
                else:
                    leaves.append(self._leaf(c))
        if len(leaves) < 2 or whole:
            return leaves
        bits = functools.reduce(np.bitwise_and, [leaf.bits for leaf in leaves])
        return [*leaves, SlotMask(bits, self.size, popcount(bits))]

    def _condition(self, c: Condition) -> Bits:
        return self._filter(c) if isinstance(c, Filter) else self._leaf(c).bits

    def _leaf(self, c: Match | Range) -> SlotMask:
        """A leaf's mask (live slots only), cached under what it covers."""
        if isinstance(c, Match):
            vocab = self._postings[c.key][0] if c.key in self._postings else {}
            codes = tuple(sorted({vocab[w] for w in map(typed_value, c.values) if w in vocab}))
            key: tuple[Any, ...] = ("match", c.key, codes)
        else:
            lo, hi = self._span(c)
            key = ("range", c.key, lo, hi)
        mask = self._leaves.get(key)
        if mask is None:
            bits = (self._match(c.key, codes) if isinstance(c, Match) else self._range(c, lo, hi)) & self.live
            mask = self._leaves[key] = SlotMask(bits, self.size, popcount(bits))
            if len(self._leaves) > LEAF_CACHE:
                self._leaves.popitem(last=False)
        else:
            self._leaves.move_to_end(key)
        return mask

    def _match(self, key: str, codes: tuple[int, ...]) -> Bits:
        if not codes:
            return np.zeros(len(self.live), dtype=np.uint8)
        _, grouped, starts = self._postings[key]
        if key in self._codes and int(sum(starts[c + 1] - starts[c] for c in codes)) * SPARSE >= self.size:
            dense = self._codes[key]
            return np.packbits(dense == codes[0] if len(codes) == 1 else np.isin(dense, codes), bitorder="little")
        return self._scatter([grouped[starts[c]:starts[c + 1]] for c in codes])

    def _span(self, c: Range) -> tuple[int, int]:
        """The slice of the key's sorted numbers that ``c`` covers."""
        xs = self._sorted.get(c.key, (np.zeros(0), None))[0]
        lo, hi = 0, len(xs)
        if c.gt is not None:
            lo = max(lo, int(np.searchsorted(xs, c.gt, side="right")))
        if c.gte is not None:
            lo = max(lo, int(np.searchsorted(xs, c.gte, side="left")))
        if c.lt is not None:
            hi = min(hi, int(np.searchsorted(xs, c.lt, side="left")))
        if c.lte is not None:
            hi = min(hi, int(np.searchsorted(xs, c.lte, side="right")))
        return lo, max(lo, hi)

    def _range(self, c: Range, lo: int, hi: int) -> Bits:
        if c.key in self._dense and (hi - lo) * SPARSE >= self.size:
            xs, _ = self._sorted[c.key]
            dense = self._dense[c.key]  # NaN (absent) fails both comparisons
            keep = (dense >= xs[lo]) & (dense <= xs[hi - 1])
            return np.packbits(keep, bitorder="little")
        slots = self._sorted[c.key][1][lo:hi] if hi > lo else np.zeros(0, dtype=np.int64)
        return self._scatter([slots])

    def _scatter(self, lists: list[npt.NDArray[np.int64]]) -> Bits:
        if sum(map(len, lists)) < FEW:  # set bit by bit: no pass over a boolean mask of every slot
            bits = np.zeros(len(self.live), dtype=np.uint8)
            for slots in lists:
                np.bitwise_or.at(bits, slots >> 3, np.left_shift(1, slots & 7).astype(np.uint8))
            return bits
        keep = np.zeros(self._padded, dtype=bool)
        for slots in lists:
            keep[slots] = True
        return np.packbits(keep, bitorder="little")
