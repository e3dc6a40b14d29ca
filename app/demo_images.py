"""Generated demo images: stylised cat and fox faces drawn with PIL (no downloads, no binary files in git).

Each face varies along attributes a rubric can name: species (cat | fox), fur colour, ear shape
(triangle | round), forehead stripes (yes | no) and eye colour. The attributes are in the file name,
so a person trying the demo can see at a glance whether a ranking follows the criteria.
The same ``seed`` always gives the same bytes, so re-running the demo deduplicates instead of re-ingesting.
"""

from __future__ import annotations

import io
import itertools
import random
import zipfile
from dataclasses import dataclass

from PIL import Image, ImageDraw

RGB = tuple[int, int, int]

FUR: dict[str, RGB] = {
    "ginger": (214, 118, 42),
    "grey": (132, 134, 146),
    "black": (44, 40, 44),
    "cream": (236, 214, 168),
    "brown": (118, 74, 42),
}
EYES: dict[str, RGB] = {"green": (60, 170, 70), "amber": (230, 160, 20), "blue": (60, 120, 220)}
BACKGROUNDS: tuple[RGB, ...] = ((222, 236, 246), (236, 244, 226), (246, 236, 226), (238, 230, 246), (240, 240, 240))
SPECIES = ("cat", "fox")
EARS = ("triangle", "round")


@dataclass(frozen=True)
class Face:
    """The attributes of one generated face; ``name`` is its file name."""

    species: str
    fur: str
    ears: str
    stripes: bool
    eyes: str
    index: int

    @property
    def name(self) -> str:
        stripes = "stripes" if self.stripes else "plain"
        return f"{self.species}-{self.fur}-{self.ears}-ears-{stripes}-{self.eyes}-eyes-{self.index:02d}.png"

    def describe(self) -> str:
        stripes = "dark forehead stripes" if self.stripes else "no forehead stripes"
        return f"{self.fur} {self.species}, {self.ears} ears, {stripes}, {self.eyes} eyes"


def _shade(color: RGB, factor: float) -> RGB:
    r, g, b = (max(0, min(255, round(c * factor))) for c in color)
    return (r, g, b)


def draw_face(face: Face, *, size: int = 256, seed: int = 0) -> Image.Image:
    """One face; ``seed`` adds small jitter (position, background) so no two images are identical."""
    rng = random.Random(f"{seed}:{face.name}")
    img = Image.new("RGB", (size, size), rng.choice(BACKGROUNDS))
    d = ImageDraw.Draw(img)
    s = size / 256.0
    cx = size / 2 + rng.uniform(-10, 10) * s
    cy = size * 0.56 + rng.uniform(-8, 8) * s
    fur = FUR[face.fur]
    dark = _shade(fur, 0.45) if face.fur != "black" else (14, 12, 14)
    inner = (236, 160, 170) if face.fur != "black" else (150, 90, 100)
    fox = face.species == "fox"
    half_w = (70 if fox else 82) * s
    half_h = (66 if fox else 74) * s

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
            r = 30 * s
            ey = cy - half_h * 0.82
            d.ellipse([ex - r, ey - r, ex + r, ey + r], fill=fur, outline=dark)
            d.ellipse([ex - r * 0.55, ey - r * 0.55, ex + r * 0.55, ey + r * 0.55], fill=inner)

    # head: a round cat face, or a fox face narrowing into a snout with pale cheeks
    d.ellipse([cx - half_w, cy - half_h, cx + half_w, cy + half_h], fill=fur, outline=dark, width=max(1, round(2 * s)))
    if fox:
        cheek = (246, 242, 232)
        d.polygon([(cx - half_w * 0.95, cy + 4 * s), (cx, cy + half_h + 26 * s), (cx + half_w * 0.95, cy + 4 * s),
                   (cx, cy + 26 * s)], fill=cheek)
        d.polygon([(cx - 26 * s, cy + 18 * s), (cx, cy + half_h + 28 * s), (cx + 26 * s, cy + 18 * s)], fill=fur)

    if face.stripes:
        for dx in (-22, 0, 22):
            x = cx + dx * s
            top = cy - half_h * 0.92
            d.line([(x, top), (x + dx * 0.15 * s, top + 40 * s)], fill=dark, width=max(2, round(7 * s)))

    # eyes: coloured iris with a slit (cat) or round (fox) pupil
    for side in (-1, 1):
        ex, ey = cx + side * 32 * s, cy - 6 * s
        rx, ry = 15 * s, (13 if fox else 16) * s
        d.ellipse([ex - rx, ey - ry, ex + rx, ey + ry], fill=EYES[face.eyes], outline=(20, 20, 20),
                  width=max(1, round(2 * s)))
        if fox:
            d.ellipse([ex - 5 * s, ey - 5 * s, ex + 5 * s, ey + 5 * s], fill=(10, 10, 10))
        else:
            d.ellipse([ex - 3.5 * s, ey - ry * 0.85, ex + 3.5 * s, ey + ry * 0.85], fill=(10, 10, 10))
        d.ellipse([ex + 3 * s, ey - 8 * s, ex + 7 * s, ey - 4 * s], fill=(255, 255, 255))

    # nose, mouth, whiskers
    ny = cy + (32 if fox else 24) * s
    d.polygon([(cx - 9 * s, ny - 6 * s), (cx + 9 * s, ny - 6 * s), (cx, ny + 4 * s)], fill=(40, 28, 30))
    d.line([(cx, ny + 4 * s), (cx - 10 * s, ny + 14 * s)], fill=(40, 28, 30), width=max(1, round(2 * s)))
    d.line([(cx, ny + 4 * s), (cx + 10 * s, ny + 14 * s)], fill=(40, 28, 30), width=max(1, round(2 * s)))
    whisker = (250, 250, 250) if face.fur in ("black", "brown") else (60, 60, 60)
    for side in (-1, 1):
        for dy in (-6, 2, 10):
            d.line([(cx + side * 16 * s, ny + dy * s), (cx + side * 72 * s, ny + (dy * 1.8 - 4) * s)],
                   fill=whisker, width=1)
    return img


def demo_faces(count: int = 40, *, seed: int = 7) -> list[Face]:
    """``count`` faces covering the attribute grid evenly (every attribute value appears), in a fixed order."""
    grid = list(itertools.product(SPECIES, FUR, EARS, (True, False), EYES))
    random.Random(seed).shuffle(grid)
    faces = []
    for i in range(count):
        species, fur, ears, stripes, eyes = grid[i % len(grid)]
        faces.append(Face(species, fur, ears, stripes, eyes, i + 1))
    return faces


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def demo_images(count: int = 40, *, seed: int = 7, size: int = 256) -> list[tuple[str, bytes]]:
    """``(file name, PNG bytes)`` for the demo reference set."""
    return [(f.name, png_bytes(draw_face(f, size=size, seed=seed))) for f in demo_faces(count, seed=seed)]


def candidate_images(*, seed: int = 1234, size: int = 256) -> list[tuple[str, bytes]]:
    """A few faces that are NOT in the reference set, to drop onto the compare page as candidates."""
    picks = [Face("cat", "ginger", "triangle", True, "green", 0), Face("fox", "brown", "round", False, "amber", 0),
             Face("cat", "black", "round", False, "blue", 0)]
    return [(f"candidate-{f.name}", png_bytes(draw_face(f, size=size, seed=seed))) for f in picks]


def zip_bytes(files: list[tuple[str, bytes]]) -> bytes:
    """A zip archive of ``(name, data)`` files (what an admin would upload)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            zf.writestr(name, data)
    return buf.getvalue()
