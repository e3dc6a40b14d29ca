"""The visual-package stage: one service that every model uses, keyed by vision-tower fingerprint.

Each model registers its role ("embedding", "reranker") with the fingerprint of its own vision tower.
Models whose towers are byte-identical land in one slot and share packages; different towers get
their own slot, so ingestion builds a package per image for every distinct tower (one preprocessing
pass per image for towers that preprocess alike, one tower pass per distinct tower) and a search never
has to encode a reference. Every tower run is counted by role, tower and :class:`Purpose`, in total
(``stats``) and per request (:class:`Usage`).

A role may also be registered without a local tower (a vLLM server whose weights are not here): then
its fingerprint is known (read-only use of the store) or not at all (images go to the server raw).

With a query tier (:class:`~retrieval.packages.ephemeral.EphemeralPackages`, which the server always
gives), packages of query images (``Purpose.QUERY``: search candidates, images sent to the API) go to that
bounded memory tier, never to the store: open search can neither fill the disk nor evict a reference's
package. Without one (library use), every package is kept in the store.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages.ephemeral import EphemeralPackages
from rubricsearch.retrieval.packages.package import Fingerprint, VisualPackage
from rubricsearch.retrieval.packages.store import PackageStore
from rubricsearch.retrieval.packages.tower import Prepared, Purpose, Usage, VisionTower
from rubricsearch.retrieval.pixel_budget import PixelBudget, holding


@dataclass
class TowerSlot:
    """One distinct vision tower in use, the roles it serves and (if it runs here) the tower itself."""

    fingerprint: Fingerprint
    roles: list[str] = field(default_factory=list)
    tower: VisionTower | None = None

    @property
    def local(self) -> bool:
        return self.tower is not None

    def describe(self) -> dict[str, Any]:
        fp = self.fingerprint
        return {"digest": fp.digest(), "tower_sha256": fp.tower, "roles": list(self.roles), "local": self.local,
                "min_pixels": fp.min_pixels, "max_pixels": fp.max_pixels, "resize": fp.resize}


@dataclass(eq=False)
class Made:
    """Packages made by the towers and not stored yet (:meth:`VisualPackages.make`), with the sizes of those
    found stored."""

    sizes: dict[str, dict[str, int]]  # sha256 -> {fingerprint digest: stored bytes}
    passes: list[tuple[TowerSlot, list[VisualPackage]]] = field(default_factory=list)
    reused: list[tuple[TowerSlot, list[VisualPackage]]] = field(default_factory=list)  # made by an earlier make
    purpose: Purpose = Purpose.INGEST
    usage: Usage | None = None


@dataclass
class Preparation:
    """Pixels prepared once per group of towers that preprocess alike (see :meth:`VisualPackages.prepare`)."""

    by_key: dict[Hashable, Prepared] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)


class VisualPackages:
    """Get-or-compute packages for every registered model; see the module docstring."""

    def __init__(self, store: PackageStore, queries: EphemeralPackages | None = None) -> None:
        self.store = store
        self.queries = queries
        self._lock = threading.Lock()
        self._slots: dict[str, TowerSlot] = {}
        self._roles: dict[str, ModelPackages] = {}
        self._encodes: Counter[tuple[str, str, str]] = Counter()  # (role, tower digest, purpose)
        self._lookups: Counter[tuple[str, str]] = Counter()  # (role, "hits" | "misses")
        # made and not stored yet, by (sha256, tower digest): a later make takes them instead of encoding again
        # (weak: a batch dropped before its keep takes its packages with it)
        self._unkept: weakref.WeakValueDictionary[tuple[str, str], VisualPackage] = weakref.WeakValueDictionary()
        # the process's decoded-pixel budget (retrieval/pixel_budget.py), shared with ingestion; None: unbounded
        self.pixel_budget: PixelBudget | None = None

    # -- registry -------------------------------------------------------------------------------
    def register(self, role: str, fingerprint: Fingerprint | None, tower: VisionTower | None = None) -> ModelPackages:
        """Add a model. ``fingerprint=None``: its tower is unknown here (no packages for it at all).

        A taken role gets a numbered suffix (two embedders in one process stay apart)."""
        if tower is not None and fingerprint is None:
            fingerprint = tower.fingerprint
        with self._lock:
            base, n = role, 2
            while role in self._roles:
                role, n = f"{base}-{n}", n + 1
            slot = None
            if fingerprint is not None:
                slot = self._slots.setdefault(fingerprint.digest(), TowerSlot(fingerprint))
                slot.roles.append(role)
                if slot.tower is None and tower is not None:
                    slot.tower = tower
            view = ModelPackages(self, role, slot)
            self._roles[role] = view
            return view

    def towers(self) -> list[TowerSlot]:
        with self._lock:
            return list(self._slots.values())

    def describe(self) -> dict[str, Any]:
        """For /readyz and logs: every distinct tower and whether the models share one."""
        with self._lock:
            unknown = [r for r, v in self._roles.items() if v.slot is None]
            towers = [s.describe() for s in self._slots.values()]
        return {"towers": towers, "shared": len(towers) == 1 and len(towers[0]["roles"]) > 1,
                "unknown_roles": unknown}

    def local_towers(self) -> list[TowerSlot]:
        return [s for s in self.towers() if s.tower is not None]

    # -- one model's packages ---------------------------------------------------------------------
    def get_or_encode(self, view: ModelPackages, images: Sequence[ImageLike], *, purpose: Purpose | None = None,
                      usage: Usage | None = None) -> list[VisualPackage]:
        """One package per image (same order) under the model's tower; each distinct missing image is
        encoded once. ``purpose`` overrides the one read off each image (:meth:`Purpose.of`)."""
        slot = view.require_slot()
        found = self._find(view, images)
        missing = {img.sha256: img for img in images if img.sha256 not in found}
        if missing:
            if slot.tower is None:
                raise BackendUnavailable(f"no local vision tower for the {view.role} model to encode images with")
            purposes = {sha: purpose or Purpose.of(img) for sha, img in missing.items()}
            with holding(self.pixel_budget, missing.values()):  # once per call: the images decode in encode
                encoded = slot.tower.encode(list(missing.values()))
            for pkg in encoded:
                if self.queries is not None and purposes[pkg.image_sha256] == Purpose.QUERY:
                    found[pkg.image_sha256] = self.queries.put(pkg)
                else:
                    found[pkg.image_sha256] = self.store.put(pkg)
            self._count(view.role, slot, list(purposes.values()), usage)
        return [found[img.sha256] for img in images]

    def find(self, view: ModelPackages, images: Iterable[ImageLike]) -> dict[str, VisualPackage]:
        """The stored packages of the images under the model's tower (no encode): a remote backend
        without a tower here sends these and the rest raw."""
        if view.slot is None:
            return {}
        return self._find(view, list(images))

    def _find(self, view: ModelPackages, images: Sequence[ImageLike]) -> dict[str, VisualPackage]:
        assert view.slot is not None
        fp = view.slot.fingerprint
        found = self.store.get_many((img.sha256 for img in images), fp)
        misses: set[str] = set()
        for img in images:
            sha = img.sha256
            if sha in found or sha in misses:
                continue
            pkg = self.queries.get(sha, fp) if self.queries is not None else None
            if pkg is None:
                misses.add(sha)
            else:
                found[sha] = pkg
        with self._lock:
            self._lookups[(view.role, "hits")] += len(found)
            self._lookups[(view.role, "misses")] += len(misses)
        return found

    # -- every tower (ingestion, backfill) --------------------------------------------------------
    def missing(self, sha256: str) -> list[TowerSlot]:
        """Local towers that have no package of this image yet."""
        return [s for s in self.local_towers() if not self.store.contains(sha256, s.fingerprint)]

    def prepare(self, images: Sequence[ImageLike]) -> Preparation:
        """Preprocess, once per group of alike towers, the images some tower of the group still lacks."""
        out = Preparation()
        for key, slots in self._groups().items():
            todo = {img.sha256: img for img in images
                    if any(not self.store.contains(img.sha256, s.fingerprint) for s in slots)}
            if todo:
                assert slots[0].tower is not None
                prepared = slots[0].tower.prepare(list(todo.values()))
                out.by_key[key] = prepared
                out.errors.update(prepared.errors)
        return out

    def build(self, images: Sequence[ImageLike], prepared: Preparation | None = None, *,
              purpose: Purpose = Purpose.INGEST, usage: Usage | None = None) -> dict[str, dict[str, int]]:
        """A package of every image for every local tower (one tower pass per distinct tower), stored.

        Returns ``{sha256: {fingerprint digest: stored bytes}}`` of the packages each image now has
        (made here or found), for the catalog's package records. Raises on a bad image: callers that
        need per-image failures retry one image at a time."""
        return self.keep(self.make(images, prepared, purpose=purpose, usage=usage))

    def make(self, images: Sequence[ImageLike], prepared: Preparation | None = None, *,
             purpose: Purpose = Purpose.INGEST, usage: Usage | None = None) -> Made:
        """:meth:`build` up to the tower passes: the packages are made, and stored by :meth:`keep`. Ingestion
        keeps them on a thread of its own, so the thread that launches the towers goes on to the next batch
        (quantising and queueing a batch's packages costs about as long as its tower pass)."""
        unique = {img.sha256: img for img in images}
        made = Made({sha: {} for sha in unique}, purpose=purpose, usage=usage)
        for key, slots in self._groups().items():
            ready = prepared.by_key.get(key) if prepared is not None else None
            for slot in slots:
                assert slot.tower is not None
                digest = slot.fingerprint.digest()
                todo, reused = [], []
                for sha, img in unique.items():
                    have = self.store.stored_bytes(sha, slot.fingerprint)  # (read, not dequantised)
                    seen = self.queries.pop(sha, slot.fingerprint) if have is None and self.queries else None
                    if seen is not None:  # a query image becomes a reference: no second encode
                        self.store.put(seen)
                        have = self.store.stored_bytes(sha, slot.fingerprint)
                    pending = self._pending(sha, digest) if have is None else None
                    if pending is not None:
                        reused.append(pending)  # in the batch before, still on its way to the store
                    elif have is None:
                        todo.append(img)
                    else:
                        made.sizes[sha][digest] = have
                if reused:
                    made.reused.append((slot, reused))
                if todo:
                    encoded = slot.tower.encode(todo, ready)
                    with self._lock:
                        self._unkept.update(((pkg.image_sha256, digest), pkg) for pkg in encoded)
                    made.passes.append((slot, encoded))
        return made

    def keep(self, made: Made) -> dict[str, dict[str, int]]:
        """Store what :meth:`make` made (each tower batch quantised together); the sizes of :meth:`build`."""
        for encoded, (slot, packages) in [(True, p) for p in made.passes] + [(False, p) for p in made.reused]:
            digest = slot.fingerprint.digest()
            for pkg, nbytes in zip(packages, self.store.put_many(packages), strict=True):
                made.sizes[pkg.image_sha256][digest] = nbytes
            with self._lock:
                for pkg in packages:
                    if self._unkept.get((pkg.image_sha256, digest)) is pkg:
                        del self._unkept[(pkg.image_sha256, digest)]
            if encoded:
                self._count(slot.roles[0], slot, [made.purpose] * len(packages), made.usage)
        made.passes, made.reused = [], []
        return made.sizes

    def _pending(self, sha: str, digest: str) -> VisualPackage | None:
        with self._lock:
            return self._unkept.get((sha, digest))

    def _groups(self) -> dict[Hashable, list[TowerSlot]]:
        groups: dict[Hashable, list[TowerSlot]] = {}
        for slot in self.local_towers():
            assert slot.tower is not None
            groups.setdefault(slot.tower.prepare_key, []).append(slot)
        return groups

    def delete_image(self, sha256: str) -> None:
        """Every package of an image, in both tiers (the image was deleted)."""
        self.store.delete_image(sha256)
        if self.queries is not None:
            self.queries.delete_image(sha256)

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, role: str, slot: TowerSlot, purposes: Sequence[Purpose], usage: Usage | None) -> None:
        digest = slot.fingerprint.short
        with self._lock:
            for p in purposes:
                self._encodes[(role, digest, p.value)] += 1
        if usage is not None:
            for p in set(purposes):
                usage.add(role, p, sum(q == p for q in purposes))

    def encode_counts(self) -> dict[tuple[str, str, str], int]:
        """``{(role, tower digest[:12], purpose): encodes}`` since start (the /metrics counter)."""
        with self._lock:
            return dict(self._encodes)

    def role_stats(self, role: str) -> dict[str, int]:
        """What a model's ``stats`` reports of its images: encodes (any purpose), hits and misses."""
        with self._lock:
            encodes = sum(n for (r, _, _), n in self._encodes.items() if r == role)
            return {"vision_encodes": encodes, "package_hits": self._lookups[(role, "hits")],
                    "package_misses": self._lookups[(role, "misses")]}


class ModelPackages:
    """One model's view of the stage: its role, its tower slot, and get-or-encode under that tower."""

    def __init__(self, service: VisualPackages, role: str, slot: TowerSlot | None) -> None:
        self.service = service
        self.role = role
        self.slot = slot

    @property
    def fingerprint(self) -> Fingerprint | None:
        return None if self.slot is None else self.slot.fingerprint

    @property
    def local(self) -> bool:
        """Whether this model's packages can be made here (its tower, or an identical one, runs here)."""
        return self.slot is not None and self.slot.tower is not None

    def require_slot(self) -> TowerSlot:
        if self.slot is None:
            raise BackendUnavailable(f"the {self.role} model's vision tower is unknown here: no packages for it")
        return self.slot

    def get_or_encode(self, images: Sequence[ImageLike], *, purpose: Purpose | None = None,
                      usage: Usage | None = None) -> list[VisualPackage]:
        return self.service.get_or_encode(self, images, purpose=purpose, usage=usage)

    def find(self, images: Iterable[ImageLike]) -> dict[str, VisualPackage]:
        return self.service.find(self, images)

    def stats(self) -> dict[str, int]:
        return self.service.role_stats(self.role)
