"""Cached variations: OneTrainer's per-concept `image_variations` / `text_variations`.

A latent cache of an augmenting concept holds N versions of each image (a text cache of a concept whose captions
vary: N versions of each caption line), and each pass over the concept reads one of them. Version v is what the
uncached pipeline reads in epoch v: the augmentation (caption variation) drawn from the generator keyed by (seed, v,
sample index), so the cache is a pure function of the seed, the sample and v: a rerun, a resume or a cache computed
on another number of processes reads the same versions.

Which version a pass reads is mgds DiskCache's rule (OneTrainer's caching): a concept of n images drawing m samples an
epoch (its balancing) reads, in its output position k of epoch e, version floor((k + e m) / n) mod N: the number of
passes over its images made before, mod N. Epoch e of a concept with balancing 1 reads version e mod N; with repeats
R the copy c of an image (sample id = index + c x samples) reads (e R + c) mod N. ot_dist draws a fractional repeat's
part at random instead of OneTrainer's running window, and takes floor(e m / n) + c passes for its copies: OneTrainer's
count for whole repeats, the same count on average for fractions.

A concept that does not augment (does not vary its captions) has one version whatever N says: its versions would be
equal. A cache whose concepts all have one version keeps its key and members: caches computed before are valid.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from ot_dist.data.augment import AUGMENTATION_FIELDS, has_augmentation
from ot_dist.data.captions import caption_options, special_tags

KINDS = {"latents": "image_variations", "text": "text_variations"}  # cache kind -> the concept option
# The concept options a text version depends on: captions.py's options and the settings they read.
TEXT_FIELDS = ("tag_shuffling", "tag_delimiter", "keep_tags_count", "tag_dropout_probability", "tag_dropout_mode",
               "tag_dropout_special_tags_mode", "tag_dropout_special_tags", "tag_dropout_special_tags_regex",
               "caps_randomize_probability", "caps_randomize_mode", "lowercase_caption", "keep_tags_separator",
               "secondary_separator", "caption_dropout_probability", "caption_dropout_every_n_epochs")


def variation_count(kind: str, concept) -> int:
    """The versions a concept's samples have in a `kind` cache: its option's N where what it caches varies, else 1."""
    if concept is None:
        return 1
    varies = has_augmentation(concept) if kind == "latents" else bool(caption_options(concept))
    return getattr(concept, KINDS[kind]) if varies else 1


def member_name(member: str, variation: int) -> str:
    """The cache member of a version: version 0 keeps the name a cache without variations has
    (`64.latent.safetensors`), version v is `64.latent.v<v>.safetensors`."""
    return member if variation == 0 else member.replace(".safetensors", f".v{variation}.safetensors")


class Variations:
    """Of a shard set's `kind` cache: each concept's versions, and which version a sample reads in an epoch. Holds a
    few numbers per concept, nothing per sample (a dataset pickled to a loader worker stays small)."""

    def __init__(self, kind: str, concepts: dict, concept_column, seed: int):
        self.kind, self.concepts, self.seed = kind, concepts, seed
        self.samples = len(concept_column)
        self.per_concept = np.ones(max(concepts, default=-1) + 2, dtype=np.int32)  # the last: a concept not configured
        for index, concept in concepts.items():
            self.per_concept[index] = variation_count(kind, concept)
        self.draws: dict[int, tuple[int, int]] = {}
        if self.most > 1:  # concept -> (samples it draws an epoch, its images): mgds DiskCache's output and group sizes
            images = np.bincount(np.asarray(concept_column), minlength=len(self.per_concept))
            self.draws = {index: (int(c.balancing) if c.balancing_strategy == "samples"
                                  else math.floor(int(images[index]) * c.balancing), max(1, int(images[index])))
                          for index, c in concepts.items()}

    @property
    def most(self) -> int:
        return int(self.per_concept.max())

    def count(self, concept: int) -> int:
        return int(self.per_concept[min(concept, len(self.per_concept) - 1)])

    def counts(self, concept_column) -> np.ndarray:
        """Per sample (of `concept_column`, the samples' concepts): its versions."""
        column = np.asarray(concept_column)
        return self.per_concept[np.minimum(column, len(self.per_concept) - 1)] if len(column) else np.ones(0, np.int32)

    def of(self, sample_id: int, concept: int, epoch: int) -> int:
        """The version sample `sample_id` (a copy's id: index + copy x samples) of `concept` reads in `epoch`; an
        evaluation (a negative epoch) reads version 0."""
        count = self.count(concept)
        if count == 1 or epoch < 0:
            return 0
        drawn, images = self.draws[concept]
        return (epoch * drawn // images + sample_id // self.samples) % count

    def signature(self) -> dict | None:
        """What the cached versions depend on besides the model and the shard set; None without versions (the cache
        keeps the key and record it had before variations existed)."""
        if self.most == 1:
            return None
        fields = AUGMENTATION_FIELDS if self.kind == "latents" else TEXT_FIELDS
        concepts = []
        for index in sorted(self.concepts):
            concept, count = self.concepts[index], variation_count(self.kind, self.concepts[index])
            settings = {name: getattr(concept, name) for name in fields} if count > 1 else {}
            if count > 1 and self.kind == "text" and concept.tag_dropout_special_tags_mode != "none":
                settings["special_tags"] = special_tags(concept.tag_dropout_special_tags, concept.tag_delimiter)
            concepts.append([count, settings])
        return {"seed": self.seed, "concepts": concepts}


def keyed(key: str, signature: dict | None) -> str:
    """The cache key of a model key with variations: another folder for other versions."""
    if signature is None:
        return key
    return hashlib.sha256(f"{key} {json.dumps(signature, sort_keys=True, default=str)}".encode()).hexdigest()
