"""Which module defines each family. Importing a family module imports torch; this file does not, so the
config can list the names cheaply and load the one it validates against."""

from __future__ import annotations

import importlib
from functools import lru_cache

FAMILY_MODULES: dict[str, str] = {
    "sd1": "ot_dist.models.families.sd",
    "sd2": "ot_dist.models.families.sd",
    "sdxl": "ot_dist.models.families.sdxl",
    "sd3": "ot_dist.models.families.sd3",
    "flux": "ot_dist.models.families.flux",
    "chroma": "ot_dist.models.families.flux",
    "pixart_alpha": "ot_dist.models.families.pixart",
    "pixart_sigma": "ot_dist.models.families.pixart",
    "stable_cascade": "ot_dist.models.families.stable_cascade",
    "wuerstchen_v2": "ot_dist.models.families.stable_cascade",
    "qwen_image": "ot_dist.models.families.qwen_image",
    "sana": "ot_dist.models.families.sana",
    "flux2": "ot_dist.models.families.flux2",
    "flux2_klein": "ot_dist.models.families.flux2",
    "lumina2": "ot_dist.models.families.lumina2",
    "z_image": "ot_dist.models.families.z_image",
    "hidream": "ot_dist.models.families.hidream",
    "flux_kontext": "ot_dist.models.families.flux",
    "qwen_image_edit": "ot_dist.models.families.qwen_image_edit",
    "qwen_image_edit_plus": "ot_dist.models.families.qwen_image_edit",
    "wan": "ot_dist.models.families.wan",
    "krea2": "ot_dist.models.families.krea2",
    "ernie_image": "ot_dist.models.families.ernie_image",
    "anima": "ot_dist.models.families.anima",
    "ideogram4": "ot_dist.models.families.ideogram4",
    "hunyuan_video": "ot_dist.models.families.hunyuan_video",
}

FAMILY_NAMES = tuple(FAMILY_MODULES)


@lru_cache(maxsize=None)
def get_family(name: str):
    """The Family instance registered under `name` (a module's FAMILIES dict holds its instances)."""
    if name not in FAMILY_MODULES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILY_NAMES)}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILIES[name]
