"""Generated faces: the demo reference set, the demo models' training data and a held-out evaluation set.

Stylised cat and fox faces drawn with PIL (no downloads, no binary files in git) vary along five attributes
a rubric can name: species (cat | fox), fur colour, ear shape (triangular | round), dark forehead stripes
(yes | no) and eye colour. Everything else (position, size, tilt, background, fur and eye shade) is random
nuisance, so a model has to learn the attributes rather than memorise pixels.

Splits never share an image: ``train`` (what the demo models learn from), ``eval`` (held out: the quality
benchmark and the tests' quality floors), ``tune`` (held out: what the trainer measures the rerank policy
on, ``app/demo/policy.py``), ``demo`` (the reference set ``make demo`` ingests) and
``candidate`` (query images). Every face keeps its attributes, the ground truth for evaluation, and the
demo files carry them in their names, so a person can see at a glance whether a ranking follows the
criteria. The same split, count and seed always give the same bytes.
"""

from __future__ import annotations

import io
import itertools
import random
import zipfile
from dataclasses import dataclass, replace
from typing import Literal

from PIL import Image, ImageDraw

RGB = tuple[int, int, int]
Split = Literal["train", "eval", "tune", "demo", "candidate"]

FUR: dict[str, RGB] = {
    "ginger": (214, 118, 42),
    "grey": (132, 134, 146),
    "black": (44, 40, 44),
    "cream": (236, 214, 168),
    "brown": (118, 74, 42),
}
EYES: dict[str, RGB] = {"green": (60, 170, 70), "amber": (230, 160, 20), "blue": (60, 120, 220)}
BACKGROUNDS: tuple[RGB, ...] = ((222, 236, 246), (236, 244, 226), (246, 236, 226), (238, 230, 246), (240, 240, 240),
                                (250, 246, 220), (226, 240, 240), (244, 226, 236))
SPECIES = ("cat", "fox")
EARS = ("triangle", "round")
STRIPES = ("stripes", "plain")
ATTRIBUTES = ("species", "fur", "ears", "stripes", "eyes")
VALUES: dict[str, tuple[str, ...]] = {"species": SPECIES, "fur": tuple(FUR), "ears": EARS, "stripes": STRIPES,
                                      "eyes": tuple(EYES)}
DEFAULT_SIZE = 128  # what the demo models are trained at (16 visual tokens per image)


@dataclass(frozen=True)
class Face:
    """The attributes of one generated face (the ground truth); ``name`` is its file name."""

    species: str
    fur: str
    ears: str
    stripes: bool
    eyes: str
    index: int
    split: Split = "demo"

    def value(self, attribute: str) -> str:
        if attribute == "stripes":
            return "stripes" if self.stripes else "plain"
        return str(getattr(self, attribute))

    @property
    def key(self) -> tuple[str, ...]:
        """The attribute values alone: two faces with equal keys show the same subject."""
        return tuple(self.value(a) for a in ATTRIBUTES)

    @property
    def name(self) -> str:
        stripes = "stripes" if self.stripes else "plain"
        return f"{self.species}-{self.fur}-{self.ears}-ears-{stripes}-{self.eyes}-eyes-{self.index:02d}.png"

    def describe(self) -> str:
        return "; ".join(Criterion(a, self.value(a)).text for a in ATTRIBUTES)


@dataclass(frozen=True)
class Criterion:
    """One rubric criterion about one attribute, e.g. "triangular ears" or (negated) "no ginger fur"."""

    attribute: str
    value: str
    negated: bool = False

    @property
    def text(self) -> str:
        a, v = self.attribute, self.value
        if a == "stripes":  # "no forehead stripes" is both the plain value and the negated stripes value
            present = (v == "stripes") != self.negated
            return "dark forehead stripes" if present else "no forehead stripes"
        phrase = {"species": f"a {v}", "fur": f"{v} fur", "eyes": f"{v} eyes",
                  "ears": ("triangular ears" if v == "triangle" else "round ears")}[a]
        if not self.negated:
            return phrase
        return f"not {phrase}" if a == "species" else f"no {phrase}"

    @property
    def negative(self) -> bool:
        """Whether the criterion names an absence ("no …", "not …")."""
        return self.text.startswith(("no ", "not "))

    def holds(self, face: Face) -> bool:
        return (face.value(self.attribute) == self.value) != self.negated


def _shade(color: RGB, factor: float) -> RGB:
    r, g, b = (max(0, min(255, round(c * factor))) for c in color)
    return (r, g, b)


def draw_face(face: Face, *, size: int = DEFAULT_SIZE, seed: int = 0) -> Image.Image:
    """One face, drawn at twice ``size`` and downsampled (smooth edges); ``seed`` and the face's split and
    index choose the nuisance (position, scale, tilt, background, shades), so no two images are identical."""
    rng = random.Random(f"{face.split}:{seed}:{face.index}:{face.name}")
    big = size * 2
    background = _shade(rng.choice(BACKGROUNDS), rng.uniform(0.94, 1.04))
    img = Image.new("RGB", (big, big), background)
    d = ImageDraw.Draw(img)
    s = big / 256.0 * rng.uniform(0.86, 1.06)
    cx = big / 2 + rng.uniform(-14, 14) * big / 256
    cy = big * 0.56 + rng.uniform(-10, 10) * big / 256
    fur = _shade(FUR[face.fur], rng.uniform(0.9, 1.1))
    dark = _shade(fur, 0.45) if face.fur != "black" else (14, 12, 14)
    inner = (236, 160, 170) if face.fur != "black" else (150, 90, 100)
    fox = face.species == "fox"
    half_w = (70 if fox else 82) * s
    half_h = (66 if fox else 74) * s
    width = max(1, round(2 * s))

    # ears first, so the head overlaps their base
    for side in (-1, 1):
        ex = cx + side * half_w * 0.62
        if face.ears == "triangle":
            tip = (ex + side * 18 * s, cy - half_h - (62 if fox else 48) * s)
            base = [(ex - 34 * s, cy - half_h * 0.45), (ex + 34 * s, cy - half_h * 0.45)]
            d.polygon([base[0], tip, base[1]], fill=fur, outline=dark)
            itip = (tip[0] - side * 4 * s, tip[1] + 22 * s)
            d.polygon([(ex - 18 * s, cy - half_h * 0.55), itip, (ex + 18 * s, cy - half_h * 0.55)], fill=inner)
        else:
            # large and high enough to read at 16 visual tokens: a linear probe on the demo tower reads these ears
            # far better than smaller, lower ones (docs/demo.md, "Vision tower pre-training")
            r = 36 * s
            ey = cy - half_h * 0.98
            d.ellipse([ex - r, ey - r, ex + r, ey + r], fill=fur, outline=dark)
            d.ellipse([ex - r * 0.55, ey - r * 0.55, ex + r * 0.55, ey + r * 0.55], fill=inner)

    # head: a round cat face, or a fox face narrowing into a snout with pale cheeks
    d.ellipse([cx - half_w, cy - half_h, cx + half_w, cy + half_h], fill=fur, outline=dark, width=width)
    if fox:
        cheek = (246, 242, 232)
        d.polygon([(cx - half_w * 0.95, cy + 4 * s), (cx, cy + half_h + 26 * s), (cx + half_w * 0.95, cy + 4 * s),
                   (cx, cy + 26 * s)], fill=cheek)
        d.polygon([(cx - 26 * s, cy + 18 * s), (cx, cy + half_h + 28 * s), (cx + 26 * s, cy + 18 * s)], fill=fur)

    if face.stripes:
        for dx in (-22, 0, 22):
            x = cx + dx * s
            top = cy - half_h * 0.92
            d.line([(x, top), (x + dx * 0.15 * s, top + 40 * s)], fill=dark, width=max(2, round(8 * s)))

    # eyes: coloured iris with a slit (cat) or round (fox) pupil
    iris = _shade(EYES[face.eyes], rng.uniform(0.9, 1.1))
    for side in (-1, 1):
        ex, ey = cx + side * 32 * s, cy - 6 * s
        rx, ry = 16 * s, (14 if fox else 17) * s
        d.ellipse([ex - rx, ey - ry, ex + rx, ey + ry], fill=iris, outline=(20, 20, 20), width=width)
        if fox:
            d.ellipse([ex - 5 * s, ey - 5 * s, ex + 5 * s, ey + 5 * s], fill=(10, 10, 10))
        else:
            d.ellipse([ex - 3.5 * s, ey - ry * 0.85, ex + 3.5 * s, ey + ry * 0.85], fill=(10, 10, 10))
        d.ellipse([ex + 3 * s, ey - 8 * s, ex + 7 * s, ey - 4 * s], fill=(255, 255, 255))

    # nose, mouth, whiskers
    ny = cy + (32 if fox else 24) * s
    d.polygon([(cx - 9 * s, ny - 6 * s), (cx + 9 * s, ny - 6 * s), (cx, ny + 4 * s)], fill=(40, 28, 30))
    d.line([(cx, ny + 4 * s), (cx - 10 * s, ny + 14 * s)], fill=(40, 28, 30), width=width)
    d.line([(cx, ny + 4 * s), (cx + 10 * s, ny + 14 * s)], fill=(40, 28, 30), width=width)
    whisker = (250, 250, 250) if face.fur in ("black", "brown") else (60, 60, 60)
    for side in (-1, 1):
        for dy in (-6, 2, 10):
            d.line([(cx + side * 16 * s, ny + dy * s), (cx + side * 72 * s, ny + (dy * 1.8 - 4) * s)],
                   fill=whisker, width=width)
    tilt = rng.uniform(-8, 8)
    img = img.rotate(tilt, resample=Image.Resampling.BICUBIC, fillcolor=background)
    return img.resize((size, size), Image.Resampling.LANCZOS)


def faces(split: Split, count: int, *, seed: int = 0) -> list[Face]:
    """``count`` faces of a split covering the attribute grid evenly (each pass over the 120 combinations
    in its own shuffled order, so every attribute value appears), in a fixed order."""
    grid = list(itertools.product(SPECIES, FUR, EARS, (True, False), EYES))
    rng = random.Random(f"{split}:{seed}")
    out: list[Face] = []
    while len(out) < count:
        rng.shuffle(grid)
        for species, fur, ears, stripes, eyes in grid[: count - len(out)]:
            out.append(Face(species, fur, ears, stripes, eyes, len(out) + 1, split))
    return out


def demo_faces(count: int = 40, *, seed: int = 7) -> list[Face]:
    """The demo reference set's faces (drawn from neither the training nor the evaluation split): every animal
    drawn twice, in another pose, size, background and shade, so a candidate-only search has true same-subject
    matches and the set's same-subject pairs calibrate it (``app/calibration_pairs.py``); the subjects of the
    Compare page's candidates (:data:`CANDIDATES`) are among them."""
    subjects = [replace(c, index=0, split="demo") for c in CANDIDATES][: (count + 1) // 2]
    for face in faces("demo", count, seed=seed):
        if len(subjects) >= (count + 1) // 2:
            break
        if face.key not in {s.key for s in subjects}:
            subjects.append(face)
    drawn = (subjects * 2)[:count]
    random.Random(f"demo:{seed}:order").shuffle(drawn)
    return [replace(face, index=i, split="demo") for i, face in enumerate(drawn, 1)]


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def demo_images(count: int = 40, *, seed: int = 7, size: int = DEFAULT_SIZE) -> list[tuple[str, bytes]]:
    """``(file name, PNG bytes)`` for the demo reference set."""
    return [(f.name, png_bytes(draw_face(f, size=size, seed=seed))) for f in demo_faces(count, seed=seed)]


CANDIDATES = (Face("cat", "ginger", "triangle", True, "green", 0, "candidate"),
              Face("fox", "brown", "round", False, "amber", 0, "candidate"),
              Face("cat", "black", "round", False, "blue", 0, "candidate"))


def candidate_images(*, seed: int = 1234, size: int = DEFAULT_SIZE) -> list[tuple[str, bytes]]:
    """A few faces that are NOT in the reference set, to drop onto the compare page as candidates."""
    return [(f"candidate-{f.name}", png_bytes(draw_face(f, size=size, seed=seed))) for f in CANDIDATES]


def zip_bytes(files: list[tuple[str, bytes]]) -> bytes:
    """A zip archive of ``(name, data)`` files (what an admin would upload)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            zf.writestr(name, data)
    return buf.getvalue()
