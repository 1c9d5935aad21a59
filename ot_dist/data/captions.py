"""Caption processing per concept, applied as a sample is read: OneTrainer's text options (tag dropout in its FULL,
RANDOM and RANDOM WEIGHTED modes with whitelisted / blacklisted special tags, capitalisation randomisation, Force
Lowercase, tag shuffling that keeps the first tags in place) and kohya's (whole-caption dropout, also every n-th
epoch, the keep-tags separator that fixes a head and a tail of the caption, the secondary separator).

The steps run in the peers' order, which matters where they meet:
  whole-caption dropout (kohya draws it first, on the caption with its prefix)
  -> split into fixed head, free tags, fixed tail (kohya's keep_tokens_separator, else keep_tags_count)
  -> tag dropout (mgds DropTags: special tags are matched before any case change)
  -> Force Lowercase and capitalisation randomisation (mgds CapitalizeTags: every tag, the kept ones too)
  -> shuffling of the free tags (mgds ShuffleTags; kohya shuffles before its dropout, which draws each tag
     independently, so the order of the two does not change what it gives)
  -> join, then the secondary separator becomes the tag delimiter (kohya, after dropping and shuffling).
Drawn from a generator keyed by (seed, epoch, sample id), like the noise: the same sample gets the same caption in an
epoch whatever the number of processes, and a new variation every epoch."""

from __future__ import annotations

import csv
import functools
import re
import string
from pathlib import Path

import torch

CAPS_MODES = ("capslock", "title", "first", "random")
SPECIAL_TAG_FILES = (".txt", ".csv")  # a special tags value ending so is a file, as mgds DropTags reads it
REGEX_CHARACTERS = set(".^$*+?{}[]|()\\")  # a special tag holding one of these is a pattern (mgds DropTags)

# The options that change a caption as it is read, in the order the docs list them: what data.cache_text refuses.
CAPTION_OPTIONS = ("tag_shuffling", "tag_dropout_probability", "caption_dropout_probability",
                   "caption_dropout_every_n_epochs", "caps_randomize_probability", "lowercase_caption",
                   "keep_tags_separator", "secondary_separator")


def vary_caption(caption: str, concept, gen: torch.Generator, epoch: int) -> str:
    """The caption after the concept's caption options (a ConceptConfig); unchanged when none is set. `epoch` counts
    from 0; a negative one is an evaluation, which caption_dropout_every_n_epochs leaves alone."""
    if concept is None or not caption_options(concept):
        return caption
    if _caption_dropped(concept, gen, epoch):
        return ""
    separated = bool(concept.keep_tags_separator) and concept.keep_tags_separator in caption
    if separated or concept.tag_dropout_probability or concept.caps_randomize_probability or concept.tag_shuffling:
        caption = _vary_tags(caption, concept, gen)
    elif concept.lowercase_caption:
        caption = caption.lower()
    if concept.secondary_separator:  # kohya puts the bare separator back: `a;;;b` becomes `a,b`
        caption = caption.replace(concept.secondary_separator, concept.tag_delimiter)
    return caption


def caption_options(concept) -> list[str]:
    """The names of the concept's options that change its captions as they are read."""
    return [name for name in CAPTION_OPTIONS if getattr(concept, name)]


def _caption_dropped(concept, gen: torch.Generator, epoch: int) -> bool:
    p = concept.caption_dropout_probability
    if p and float(torch.rand((), generator=gen)) < p:
        return True
    every = concept.caption_dropout_every_n_epochs  # kohya counts epochs from 1: dropped in the n-th, 2n-th, ...
    return bool(every) and epoch >= 0 and (epoch + 1) % every == 0


def _vary_tags(caption: str, concept, gen: torch.Generator) -> str:
    head, free, tail = split_tags(caption, concept)
    if concept.tag_dropout_probability and free:
        free = drop_tags(free, concept, gen)
    tags = head + free + tail
    if concept.lowercase_caption:
        tags = [t.lower() for t in tags]
    if concept.caps_randomize_probability:
        tags = randomize_caps(tags, concept.caps_randomize_probability, concept.caps_randomize_mode, gen)
    head, free, tail = tags[:len(head)], tags[len(head):len(tags) - len(tail)], tags[len(tags) - len(tail):]
    if concept.tag_shuffling and len(free) > 1:
        free = [free[i] for i in torch.randperm(len(free), generator=gen).tolist()]
    delimiter = concept.tag_delimiter
    if concept.caps_randomize_probability and not concept.tag_shuffling:
        joiner = delimiter  # mgds CapitalizeTags re-joins with the bare delimiter, and nothing after it re-joins
    else:
        joiner = delimiter if delimiter.endswith(" ") or not delimiter.strip() else delimiter + " "
    return joiner.join(head + free + tail)


def split_tags(caption: str, concept) -> tuple[list[str], list[str], list[str]]:
    """(fixed head, free tags, fixed tail). With keep_tags_separator in the caption (kohya's keep_tokens_separator):
    the tags before its first occurrence, between it and the next, and after that one; otherwise the first
    keep_tags_count tags, the rest, and no tail. Tags are stripped, empty ones left out."""
    delimiter, separator = concept.tag_delimiter, concept.keep_tags_separator

    def tags(text: str) -> list[str]:
        return [t.strip() for t in text.split(delimiter) if t.strip()]

    if separator and separator in caption:
        head, rest = caption.split(separator, 1)
        free, _, tail = rest.partition(separator)
        return tags(head), tags(free), tags(tail)
    every = tags(caption)
    keep = min(concept.keep_tags_count, len(every))
    return every[:keep], every[keep:], []


def drop_tags(free: list[str], concept, gen: torch.Generator) -> list[str]:
    """OneTrainer's tag dropout on the free tags. full: one draw, all of them dropped together; random: each on its
    own with the probability; random_weighted: the i-th of n (from 1) with probability x i / n, so the last tags go
    most often. A whitelisted special tag is never dropped; with a blacklist only the special tags can be."""
    p, mode = concept.tag_dropout_probability, concept.tag_dropout_special_tags_mode
    special = _special_matcher(concept) if mode != "none" else None

    def protected(tag: str) -> bool:
        return special is not None and special(tag) == (mode == "whitelist")

    if concept.tag_dropout_mode == "full":
        return free if float(torch.rand((), generator=gen)) >= p else [t for t in free if protected(t)]
    n, weighted = len(free), concept.tag_dropout_mode == "random_weighted"
    draws = torch.rand(n, generator=gen).tolist()
    return [t for i, (t, u) in enumerate(zip(free, draws)) if u >= (p * (i + 1) / n if weighted else p) or protected(t)]


def randomize_caps(tags: list[str], p: float, modes, gen: torch.Generator) -> list[str]:
    """Each tag, with probability p, in one of `modes` drawn uniformly (a mode listed twice is drawn twice as often):
    capslock: upper case; title: each word capitalised (string.capwords); first: the tag capitalised
    (str.capitalize: the rest lower case); random: each character upper or lower case, half the time each."""
    out = []
    for tag in tags:
        if float(torch.rand((), generator=gen)) < p:
            mode = modes[int(torch.randint(len(modes), (), generator=gen))]
            if mode == "capslock":
                tag = tag.upper()
            elif mode == "title":
                tag = string.capwords(tag)
            elif mode == "first":
                tag = tag.capitalize()
            else:
                upper = torch.rand(len(tag), generator=gen).tolist()
                tag = "".join(c.upper() if u < 0.5 else c.lower() for c, u in zip(tag, upper))
        out.append(tag)
    return out


def special_tags(value, delimiter: str) -> list[str]:
    """The special tags of tag_dropout_special_tags: a list as given; a string ending in .txt (one tag a line) or
    .csv (the first column) names a file; any other string is split at the tag delimiter."""
    if not isinstance(value, str):
        return [t.strip() for t in value if t.strip()]
    if value.endswith(SPECIAL_TAG_FILES):
        return list(_tags_in_file(value))
    return [t.strip() for t in value.split(delimiter) if t.strip()]


@functools.lru_cache(maxsize=64)
def _tags_in_file(path: str) -> tuple[str, ...]:
    with open(path, newline="", encoding="utf-8-sig") as file:  # a byte order mark would glue onto the first tag
        if path.endswith(".csv"):
            return tuple(row[0].strip() for row in csv.reader(file) if row and row[0].strip())
        return tuple(line.strip() for line in file if line.strip())


def special_patterns(tags: list[str], regex: bool) -> list:
    """With tag_dropout_special_tags_regex, a tag holding a regex character is a pattern that must match a whole tag
    (re.fullmatch); re.error for one that does not compile."""
    return [re.compile(t) if regex and REGEX_CHARACTERS & set(t) else t for t in tags]


def _special_matcher(concept):
    value = concept.tag_dropout_special_tags
    return _matcher(tuple(value) if isinstance(value, list) else value, concept.tag_delimiter,
                    concept.tag_dropout_special_tags_regex)


@functools.lru_cache(maxsize=64)
def _matcher(value, delimiter: str, regex: bool):
    """Whether a tag is special. Plain: the tag is one of them. Regex on (mgds DropTags), a tag also matches without
    the parentheses around it (`(red hair)`, a weighted tag): a pattern by re.fullmatch, a plain tag by equality."""
    tags = special_tags(list(value) if isinstance(value, tuple) else value, delimiter)
    if not regex:
        exact = set(tags)
        return exact.__contains__
    patterns = special_patterns(tags, regex)

    def matches(tag: str) -> bool:
        forms = (tag, tag.strip("()"))
        return any(p.fullmatch(f) if isinstance(p, re.Pattern) else p == f for p in patterns for f in forms)
    return matches


def special_tags_file_missing(value) -> Path | None:
    """The file tag_dropout_special_tags names when it does not exist (mgds would take the name for a tag)."""
    return Path(value) if isinstance(value, str) and value.endswith(SPECIAL_TAG_FILES) and not Path(value).is_file() \
        else None
