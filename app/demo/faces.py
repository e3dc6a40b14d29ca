"""Generated faces: the demo reference set, the demo models' training data and a held-out evaluation set.

Stylised cat and fox faces drawn with PIL (no downloads, no binary files in git) vary along five attributes
a rubric can name: species (cat | fox), fur colour, ear shape (triangular | round), dark forehead stripes
(yes | no) and eye colour. Everything else (position, size, tilt, background, fur and eye shade) is random
nuisance, so a model has to learn the attributes rather than memorise pixels. A sixth, optional attribute, a
collar (red | blue | none), is off unless a face names one (:func:`with_collars`): the demo models never saw it,
so it is what the learning test teaches (``bench/learning_curve.py``); a face without it draws the same bytes as
before it existed, so the demo models and their training are unchanged.

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
import math
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
# the optional attribute: a large coloured region (a band under the chin), which a 16-token tower can carry
# where thin lines are at the edge of what it shows (the stripes)
COLLARS: dict[str, RGB] = {"red": (206, 32, 44), "blue": (36, 78, 214)}
COLLAR_VALUES = (*COLLARS, "none")
# half-width (of the head's), top (of the head's half height), drop below the chin: a linear probe on the demo
# tower's packages reads this band's colour far better than a narrower, shorter one (docs/fine-tuning.md)
COLLAR_BAND = (1.05, 0.5, 44)


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
    collar: str | None = None  # None: the attribute is off (not drawn, not in the name); "none": off and named

    def value(self, attribute: str) -> str:
        if attribute == "stripes":
            return "stripes" if self.stripes else "plain"
        if attribute == "collar":
            return self.collar or "none"
        return str(getattr(self, attribute))

    @property
    def key(self) -> tuple[str, ...]:
        """The attribute values alone: two faces with equal keys show the same subject."""
        return tuple(self.value(a) for a in ATTRIBUTES)

    @property
    def name(self) -> str:
        stripes = "stripes" if self.stripes else "plain"
        collar = "" if self.collar is None else f"{self.collar}-collar-"
        return f"{self.species}-{self.fur}-{self.ears}-ears-{stripes}-{self.eyes}-eyes-{collar}{self.index:02d}.png"

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
        if a == "collar" and v == "none":  # like stripes: "no collar" is the none value, or a collar negated
            return "a collar" if self.negated else "no collar"
        phrase = {"species": f"a {v}", "fur": f"{v} fur", "eyes": f"{v} eyes",
                  "ears": ("triangular ears" if v == "triangle" else "round ears"), "collar": f"a {v} collar"}[a]
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


@dataclass(frozen=True)
class _Layout:
    """The nuisance of one drawing (drawn from its seed in a fixed order) and the head's geometry, in the
    double-size canvas: :func:`draw_face` draws from it and :func:`regions` reads the attributes' places off it."""

    big: int
    background: RGB
    s: float  # scale
    cx: float
    cy: float
    fur: RGB
    iris: RGB
    tilt: float  # degrees, counter-clockwise, about the canvas centre
    half_w: float
    half_h: float


def _layout(face: Face, size: int, seed: int) -> _Layout:
    rng = random.Random(f"{face.split}:{seed}:{face.index}:{face.name}")
    big = size * 2
    background = _shade(rng.choice(BACKGROUNDS), rng.uniform(0.94, 1.04))
    s = big / 256.0 * rng.uniform(0.86, 1.06)
    cx = big / 2 + rng.uniform(-14, 14) * big / 256
    cy = big * 0.56 + rng.uniform(-10, 10) * big / 256
    fur = _shade(FUR[face.fur], rng.uniform(0.9, 1.1))
    iris = _shade(EYES[face.eyes], rng.uniform(0.9, 1.1))
    tilt = rng.uniform(-8, 8)
    fox = face.species == "fox"
    return _Layout(big, background, s, cx, cy, fur, iris, tilt, (70 if fox else 82) * s, (66 if fox else 74) * s)


Point = tuple[float, float]


def _ear_shapes(face: Face, lay: _Layout) -> list[tuple[str, list[Point]]]:
    """Per ear: its outer shape (a triangle's corners or an ellipse's box) and its inner one, as
    ``("polygon" | "ellipse", points)``."""
    s, cx, cy, half_w, half_h = lay.s, lay.cx, lay.cy, lay.half_w, lay.half_h
    fox = face.species == "fox"
    shapes: list[tuple[str, list[Point]]] = []
    for side in (-1, 1):
        ex = cx + side * half_w * 0.62
        if face.ears == "triangle":
            tip = (ex + side * 18 * s, cy - half_h - (62 if fox else 48) * s)
            base = [(ex - 34 * s, cy - half_h * 0.45), (ex + 34 * s, cy - half_h * 0.45)]
            itip = (tip[0] - side * 4 * s, tip[1] + 22 * s)
            shapes += [("polygon", [base[0], tip, base[1]]),
                       ("polygon", [(ex - 18 * s, cy - half_h * 0.55), itip, (ex + 18 * s, cy - half_h * 0.55)])]
        else:
            # large and high enough to read at 16 visual tokens: a linear probe on the demo tower reads these ears
            # far better than smaller, lower ones (docs/demo.md, "Vision tower pre-training")
            r = 36 * s
            ey = cy - half_h * 0.98
            shapes += [("ellipse", [(ex - r, ey - r), (ex + r, ey + r)]),
                       ("ellipse", [(ex - r * 0.55, ey - r * 0.55), (ex + r * 0.55, ey + r * 0.55)])]
    return shapes


def _stripe_lines(lay: _Layout) -> list[tuple[Point, Point]]:
    s, cx, cy, half_h = lay.s, lay.cx, lay.cy, lay.half_h
    top = cy - half_h * 0.92
    return [((cx + dx * s, top), (cx + dx * s + dx * 0.15 * s, top + 40 * s)) for dx in (-22, 0, 22)]


def _stripe_width(lay: _Layout) -> int:
    return max(2, round(8 * lay.s))


def _eye_boxes(face: Face, lay: _Layout) -> list[tuple[Point, Point]]:
    s, cx, cy = lay.s, lay.cx, lay.cy
    rx, ry = 16 * s, (14 if face.species == "fox" else 17) * s
    return [((cx + side * 32 * s - rx, cy - 6 * s - ry), (cx + side * 32 * s + rx, cy - 6 * s + ry))
            for side in (-1, 1)]


def draw_face(face: Face, *, size: int = DEFAULT_SIZE, seed: int = 0) -> Image.Image:
    """One face, drawn at twice ``size`` and downsampled (smooth edges); ``seed`` and the face's split and
    index choose the nuisance (position, scale, tilt, background, shades), so no two images are identical."""
    lay = _layout(face, size, seed)
    big, s, cx, cy, half_w, half_h = lay.big, lay.s, lay.cx, lay.cy, lay.half_w, lay.half_h
    img = Image.new("RGB", (big, big), lay.background)
    d = ImageDraw.Draw(img)
    fur = lay.fur
    dark = _shade(fur, 0.45) if face.fur != "black" else (14, 12, 14)
    inner = (236, 160, 170) if face.fur != "black" else (150, 90, 100)
    fox = face.species == "fox"
    width = max(1, round(2 * s))

    # ears first, so the head overlaps their base: each ear's outer shape, then its inner one
    for i, (kind, points) in enumerate(_ear_shapes(face, lay)):
        outer = i % 2 == 0
        if kind == "polygon":
            d.polygon(points, fill=fur if outer else inner, outline=dark if outer else None)
        else:
            d.ellipse([*points[0], *points[1]], fill=fur if outer else inner, outline=dark if outer else None)

    if face.collar in COLLARS:  # under the head, which covers its top edge
        wide, top, low = COLLAR_BAND
        d.rounded_rectangle([cx - half_w * wide, cy + half_h * top, cx + half_w * wide, cy + half_h + low * s],
                            radius=12 * s, fill=COLLARS[face.collar], outline=_shade(COLLARS[face.collar], 0.5),
                            width=width)

    # head: a round cat face, or a fox face narrowing into a snout with pale cheeks
    d.ellipse([cx - half_w, cy - half_h, cx + half_w, cy + half_h], fill=fur, outline=dark, width=width)
    if fox:
        cheek = (246, 242, 232)
        d.polygon([(cx - half_w * 0.95, cy + 4 * s), (cx, cy + half_h + 26 * s), (cx + half_w * 0.95, cy + 4 * s),
                   (cx, cy + 26 * s)], fill=cheek)
        d.polygon([(cx - 26 * s, cy + 18 * s), (cx, cy + half_h + 28 * s), (cx + 26 * s, cy + 18 * s)], fill=fur)

    if face.stripes:
        for line in _stripe_lines(lay):
            d.line(list(line), fill=dark, width=_stripe_width(lay))

    # eyes: coloured iris with a slit (cat) or round (fox) pupil
    for (x0, y0), (x1, y1) in _eye_boxes(face, lay):
        ex, ey, ry = (x0 + x1) / 2, (y0 + y1) / 2, (y1 - y0) / 2
        d.ellipse([x0, y0, x1, y1], fill=lay.iris, outline=(20, 20, 20), width=width)
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
    img = img.rotate(lay.tilt, resample=Image.Resampling.BICUBIC, fillcolor=lay.background)
    return img.resize((size, size), Image.Resampling.LANCZOS)


REGION_ATTRIBUTES = ("ears", "stripes", "eyes")  # the attributes drawn at one place of the face
RegionBox = tuple[float, float, float, float]  # left, top, right, bottom in image pixels


def regions(face: Face, *, size: int = DEFAULT_SIZE, seed: int = 0) -> dict[str, list[RegionBox]]:
    """Where :func:`draw_face` draws the ears (one box per ear), the forehead (the stripes' place: where they are
    drawn, or would be on a plain face) and the eyes (one box per eye), in the ``size``-pixel image: each box
    bounds the shape's outline after the tilt."""
    lay = _layout(face, size, seed)
    ears = _ear_shapes(face, lay)
    pad = _stripe_width(lay) / 2
    stripe_points = [p for line in _stripe_lines(lay) for p in line]
    forehead = [(min(x for x, _ in stripe_points) - pad, min(y for _, y in stripe_points) - pad),
                (max(x for x, _ in stripe_points) + pad, max(y for _, y in stripe_points) + pad)]
    boxes = {
        "ears": [_box(lay, kind, points) for kind, points in ears[0::2]],  # the outer shapes
        "stripes": [_box(lay, "polygon", _corners(*forehead))],
        "eyes": [_box(lay, "ellipse", list(box)) for box in _eye_boxes(face, lay)],
    }
    return boxes


def _corners(a: Point, b: Point) -> list[Point]:
    return [a, (b[0], a[1]), b, (a[0], b[1])]


def _box(lay: _Layout, kind: str, points: list[Point]) -> RegionBox:
    """The bounding box, in the final image, of a polygon (its corners) or an ellipse (its bounding box's two
    corners) after the tilt about the canvas centre and the halving to the final size."""
    if kind == "ellipse":
        (x0, y0), (x1, y1) = points
        ex, ey, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
        points = [(ex + rx * math.cos(a), ey + ry * math.sin(a)) for a in (2 * math.pi * k / 64 for k in range(64))]
    theta = math.radians(lay.tilt)
    c = lay.big / 2
    turned = [(c + (x - c) * math.cos(theta) + (y - c) * math.sin(theta),
               c - (x - c) * math.sin(theta) + (y - c) * math.cos(theta)) for x, y in points]
    xs, ys = [x / 2 for x, _ in turned], [y / 2 for _, y in turned]
    return (min(xs), min(ys), max(xs), max(ys))


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


def with_collars(chosen: list[Face], *, seed: int = 0) -> list[Face]:
    """The faces with the optional collar on: red, blue and none in equal shares, in a seeded order
    independent of the other attributes."""
    values = [COLLAR_VALUES[i % len(COLLAR_VALUES)] for i in range(len(chosen))]
    random.Random(f"collar:{seed}").shuffle(values)
    return [replace(face, collar=value) for face, value in zip(chosen, values, strict=True)]


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
