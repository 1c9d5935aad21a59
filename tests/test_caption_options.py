"""The peers' caption options (data.md, "Caption processing"): OneTrainer's RANDOM WEIGHTED tag dropout, special tags,
caps randomisation and Force Lowercase (mgds DropTags -> CapitalizeTags -> ShuffleTags), kohya's keep-tags separator,
secondary separator and caption dropout every n epochs (sd-scripts process_caption). Seeded draws are checked against
the documented rule; random ones by their frequencies over a few thousand seeds (the peers' own functions, run on the
same inputs with their RNG, gave the frequencies quoted in the comments)."""

from __future__ import annotations

import json

import pytest
import torch

from ot_dist.config.schema import ConceptConfig
from ot_dist.data.captions import vary_caption
from ot_dist.errors import ConfigError

TAGS = "sks dog, (red collar), grass, sunny day, park, bokeh"
DRAWS = 2000


def concept(**options) -> ConceptConfig:
    return ConceptConfig(**{"path": "x", **options})


def draws(caption: str, options: dict, n: int = DRAWS, epoch: int = 0) -> list[str]:
    c = concept(**options)
    return [vary_caption(caption, c, torch.Generator().manual_seed(seed), epoch) for seed in range(n)]


def presence(outputs: list[str], tag: str) -> float:
    return sum(tag in [t.strip() for t in o.split(",")] for o in outputs) / len(outputs)


def test_random_weighted_drops_the_i_th_of_n_tags_with_p_times_i_over_n():
    """OneTrainer's RANDOM WEIGHTED: after the kept tag, the i-th of the 5 droppable tags goes with 0.6 x i / 5
    (mgds gave presences 0.879 0.757 0.640 0.516 0.399 over 20000 draws)."""
    out = draws(TAGS, {"tag_dropout_probability": 0.6, "tag_dropout_mode": "RANDOM WEIGHTED"})
    assert all(o.startswith("sks dog") for o in out)
    for i, tag in enumerate(["(red collar)", "grass", "sunny day", "park", "bokeh"], start=1):
        assert presence(out, tag) == pytest.approx(1 - 0.6 * i / 5, abs=0.04), tag


def test_whitelisted_tags_are_never_dropped_and_blacklist_limits_dropout_to_its_tags():
    white = draws(TAGS, {"tag_dropout_probability": 0.5, "tag_dropout_special_tags_mode": "WHITELIST",
                         "tag_dropout_special_tags": "grass, park"})
    assert presence(white, "grass") == presence(white, "park") == 1.0
    assert presence(white, "sunny day") == pytest.approx(0.5, abs=0.04)
    # FULL with a regex blacklist: one draw drops the tags the patterns match in full, a weighted tag's
    # parentheses aside; the others stay (mgds: the two captions, 0.600 / 0.400)
    black = draws(TAGS, {"tag_dropout_probability": 0.4, "tag_dropout_mode": "full",
                         "tag_dropout_special_tags_mode": "blacklist", "tag_dropout_special_tags": "red.*, s.*y, bokeh",
                         "tag_dropout_special_tags_regex": True})
    assert set(black) == {TAGS, "sks dog, grass, park"}
    assert black.count("sks dog, grass, park") / DRAWS == pytest.approx(0.4, abs=0.04)
    # without regex a special tag is compared as it is written: `red.*` is no tag of the caption
    plain = draws(TAGS, {"tag_dropout_probability": 1.0, "tag_dropout_mode": "full",
                         "tag_dropout_special_tags_mode": "blacklist", "tag_dropout_special_tags": "red.*, bokeh"}, 1)
    assert plain == ["sks dog, (red collar), grass, sunny day, park"]


def test_special_tags_from_a_txt_or_csv_file_and_errors_that_name_the_field(tmp_path):
    (tmp_path / "keep.txt").write_text("grass\r\n\npark\n")
    (tmp_path / "keep.csv").write_text("grass,a note\npark,\n")
    for name in ("keep.txt", "keep.csv"):
        out = draws(TAGS, {"tag_dropout_probability": 1.0, "tag_dropout_special_tags_mode": "whitelist",
                           "tag_dropout_special_tags": str(tmp_path / name)}, 1)
        assert out == ["sks dog, grass, park"], name
    from ot_dist.config.load import validate

    base = {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o"}
    for options, message in [
        ({"tag_dropout_special_tags_mode": "whitelist", "tag_dropout_special_tags": "gone.txt"},
         "concept x: tag_dropout_special_tags: 'gone.txt' names a special tags file"),
        ({"tag_dropout_special_tags_mode": "whitelist"}, "concept x: tag_dropout_special_tags_mode: whitelist needs"),
        ({"tag_dropout_special_tags_mode": "whitelist", "tag_dropout_special_tags": "a[",
          "tag_dropout_special_tags_regex": True}, "tag_dropout_special_tags: 'a\\[' is no regular expression"),
        ({"caps_randomize_mode": "capslock, shout"}, "data.concepts.0.caps_randomize_mode.1: Input should be"),
        ({"keep_tags_separator": ","}, "concept x: keep_tags_separator: ',' is the tag_delimiter"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate({**base, "data": {"concepts": [{"path": "x", **options}]}})


def test_caps_randomisation_draws_each_mode_alike_for_every_tag_and_joins_as_onetrainer():
    """A tag changes with the probability, to one of the modes drawn uniformly; the kept tags too. mgds re-joins
    with the bare delimiter (`A B,C D`) unless shuffling comes after and re-joins with a space."""
    assert draws("a b, c d", {"caps_randomize_probability": 1.0, "caps_randomize_mode": "capslock"}, 1) == ["A B,C D"]
    shuffled = draws("a b, c d", {"caps_randomize_probability": 1.0, "caps_randomize_mode": "capslock",
                                  "tag_shuffling": True, "keep_tags_count": 0}, 40)
    assert set(shuffled) == {"A B, C D", "C D, A B"}
    out = [o.split(",")[0] for o in draws("sks dog, grass", {"caps_randomize_probability": 0.5})]
    # unchanged half the time (and when `random` happens to give it, 1 in 64), each other mode an eighth
    for form, expected in [("sks dog", 0.5 + 0.125 / 64), ("SKS DOG", 0.125 * 65 / 64), ("Sks Dog", 0.125 * 65 / 64),
                           ("Sks dog", 0.125 * 65 / 64)]:
        assert out.count(form) / DRAWS == pytest.approx(expected, abs=0.03), form
    letters = "".join(draws("abcdefghijklmnopqrst", {"caps_randomize_probability": 1.0,
                                                     "caps_randomize_mode": ["random"]}, 100))
    assert sum(c.isupper() for c in letters) / len(letters) == pytest.approx(0.5, abs=0.03)


def test_force_lowercase_comes_after_tag_dropout_and_alone_leaves_the_text_as_written():
    assert draws("Sks Dog,  Red Collar,GRASS", {"lowercase_caption": True}, 1) == ["sks dog,  red collar,grass"]
    # the whitelist is matched before lower-casing (mgds DropTags runs before CapitalizeTags)
    out = draws("Sks, Red, GRASS", {"lowercase_caption": True, "tag_dropout_probability": 1.0,
                                    "tag_dropout_special_tags_mode": "whitelist", "tag_dropout_special_tags": ["GRASS"]}, 1)
    assert out == ["sks, grass"]


def test_kohya_keep_tags_separator_fixes_a_head_and_a_tail():
    """kohya's documented example: `aaa, bbb ||| ccc, ddd, eee, fff ||| ggg, hhh` keeps `aaa, bbb` first and
    `ggg, hhh` last, the middle shuffled and dropped (kohya: each middle tag present 0.75 at rate 0.25)."""
    out = draws("aaa, bbb ||| ccc, ddd, eee, fff ||| ggg, hhh",
                {"tag_shuffling": True, "tag_dropout_probability": 0.25, "keep_tags_separator": "|||"})
    assert all(o.startswith("aaa, bbb, ") and o.endswith(", ggg, hhh") and "|" not in o for o in out)
    assert presence(out, "ccc") == pytest.approx(0.75, abs=0.04)
    assert {o.split(", ")[2] for o in out} == {"ccc", "ddd", "eee", "fff", "ggg"}  # shuffled; `ggg` when all dropped
    # keep_tags_count counts only where the caption has no separator; without shuffling the separator goes too
    assert draws("a, b, c", {"keep_tags_separator": "|||", "keep_tags_count": 2, "tag_dropout_probability": 1.0},
                 1) == ["a, b"]
    assert draws("a ||| b, c", {"keep_tags_separator": "|||"}, 1) == ["a, b, c"]


def test_kohya_secondary_separator_keeps_a_group_together_then_becomes_the_delimiter():
    out = draws("a;;;b, c, d;;;e, f", {"tag_shuffling": True, "keep_tags_count": 0, "secondary_separator": ";;;"}, 200)
    assert all(sorted(o.split(", ")) == ["a,b", "c", "d,e", "f"] for o in out)
    assert len(set(out)) > 12  # 24 orders
    assert draws("a;;;b, c", {"secondary_separator": ";;;"}, 1) == ["a,b, c"]


def test_caption_dropout_every_n_epochs_counts_epochs_from_one_as_kohya():
    """kohya: `current_epoch % n == 0`, its epochs from 1: with n 3 the 3rd and 6th epoch (ot_dist's 2 and 5) have
    empty captions; an evaluation (epoch -1) never."""
    c = concept(caption_dropout_every_n_epochs=3)
    got = [vary_caption("a, b", c, torch.Generator(), epoch) for epoch in range(-1, 6)]
    assert got == ["a, b", "a, b", "a, b", "", "a, b", "a, b", ""]


def test_cached_text_refusal_names_the_option():
    from ot_dist.config.load import validate

    with pytest.raises(ConfigError, match=r"data.concepts\[0\].lowercase_caption"):
        validate({"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o",
                  "data": {"concepts": [{"path": "x", "lowercase_caption": True}], "cache_text": True}})


def test_onetrainer_import_maps_the_tag_and_caps_options(tmp_path):
    from ot_dist.config.load import validate
    from ot_dist.migrate.onetrainer import import_onetrainer

    (tmp_path / "special.csv").write_text("grass\n")
    text = {"tag_dropout_enable": True, "tag_dropout_probability": 0.4, "tag_dropout_mode": "RANDOM WEIGHTED",
            "tag_dropout_special_tags_mode": "BLACKLIST", "tag_dropout_special_tags": "red.*; old.txt",
            "tag_dropout_special_tags_regex": True, "tag_delimiter": ";", "caps_randomize_enable": True,
            "caps_randomize_probability": 0.3, "caps_randomize_mode": "capslock, first, Shout",
            "caps_randomize_lowercase": True}
    config = {"__version": 11, "model_type": "STABLE_DIFFUSION_15", "training_method": "LORA", "base_model_name": "m",
              "concepts": [{"path": str(tmp_path), "text": text},
                           {"path": str(tmp_path), "text": {**text, "tag_dropout_special_tags": str(tmp_path / "special.csv"),
                                                            "tag_dropout_special_tags_mode": "WHITELIST"}}]}
    (tmp_path / "ot.json").write_text(json.dumps(config))
    imported = import_onetrainer(tmp_path / "ot.json")
    first, second = validate(imported.config).data.concepts
    assert (first.tag_dropout_mode, first.tag_dropout_probability, first.tag_delimiter) == ("random_weighted", 0.4, ";")
    # an inline name ending in .txt that is no file is a tag to mgds, so it is written as one
    assert (first.tag_dropout_special_tags_mode, first.tag_dropout_special_tags) == ("blacklist", ["red.*", "old.txt"])
    assert first.tag_dropout_special_tags_regex and first.lowercase_caption
    assert (first.caps_randomize_probability, first.caps_randomize_mode) == (0.3, ["capslock", "first"])
    assert (second.tag_dropout_special_tags_mode, second.tag_dropout_special_tags) == \
        ("whitelist", str(tmp_path / "special.csv"))
    assert sum("caps_randomize_mode: Shout" in line for line in imported.not_honoured) == 2, imported.not_honoured
    assert not any("tag_dropout" in line or "lowercase" in line for line in imported.not_honoured)
