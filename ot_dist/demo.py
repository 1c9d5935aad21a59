"""The embedded demo: a tiny SD model and a small generated dataset in which something is learnable
(coloured shapes whose captions name colour, shape and background)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle")


def _draw(shape: str, color, background, size: int, rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    r = rng.randint(size // 5, size // 3)
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=color)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    return img


def make_demo_dataset(folder: str | Path, count: int = 48, size: int = 64, seed: int = 0) -> Path:
    """Write `count` images (PNG) with same-name .txt captions."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    combos = list(itertools.product(SHAPES, COLORS, BACKGROUNDS))
    for i in range(count):
        shape, color, background = combos[i % len(combos)]
        _draw(shape, COLORS[color], BACKGROUNDS[background], size, rng).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(f"a {color} {shape} on a {background} background\n")
    return folder


def prepare_demo(root: str | Path, families=("sd1",)) -> dict[str, Path]:
    """Create the demo's model(s) and dataset under `root` (idempotent: existing ones are kept)."""
    from ot_dist.models.tiny import make_tiny_model

    root = Path(root)
    made = {}
    for family in families:
        model_dir = root / f"tiny-{family}"
        if not (model_dir / "model_index.json").is_file():
            make_tiny_model(model_dir, family)
        made[family] = model_dir
    data_dir = root / "shapes"
    if not any(data_dir.glob("*.png")):
        make_demo_dataset(data_dir)
    made["data"] = data_dir
    return made
