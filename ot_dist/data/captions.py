"""Caption variation per concept (OneTrainer's text options): tag shuffling that keeps the first tags in place, tag
dropout (each tag on its own, or all but the kept ones at once: OneTrainer's RANDOM and FULL modes), and whole-caption
dropout (an empty caption, so the model also learns the unconditional prediction that
classifier-free guidance needs). Drawn from a generator keyed by (seed, epoch, sample id), like the noise: the same
sample gets the same caption in an epoch whatever the number of processes, and a new variation every epoch."""

from __future__ import annotations

import torch


def vary_caption(caption: str, concept, gen: torch.Generator) -> str:
    """The caption after the concept's variation options (a ConceptConfig); unchanged when none is set."""
    if concept is None or not has_variation(concept):
        return caption
    if concept.caption_dropout_probability and float(torch.rand((), generator=gen)) < concept.caption_dropout_probability:
        return ""
    delimiter = concept.tag_delimiter
    tags = [t.strip() for t in caption.split(delimiter) if t.strip()]
    keep = min(concept.keep_tags_count, len(tags))
    fixed, rest = tags[:keep], tags[keep:]
    if concept.tag_dropout_probability and rest:
        if concept.tag_dropout_mode == "full":  # OneTrainer's FULL: all the droppable tags at once, or none
            rest = [] if float(torch.rand((), generator=gen)) < concept.tag_dropout_probability else rest
        else:  # OneTrainer's RANDOM: each tag on its own
            draws = torch.rand(len(rest), generator=gen).tolist()
            rest = [t for t, u in zip(rest, draws) if u >= concept.tag_dropout_probability]
    if concept.tag_shuffling and len(rest) > 1:
        rest = [rest[i] for i in torch.randperm(len(rest), generator=gen).tolist()]
    joiner = delimiter if delimiter.endswith(" ") or not delimiter.strip() else delimiter + " "
    return joiner.join(fixed + rest)


def has_variation(concept) -> bool:
    return bool(concept.tag_shuffling or concept.tag_dropout_probability or concept.caption_dropout_probability)
