"""Caption variation per concept (issue 18): tag shuffling with kept tags, tag dropout, caption dropout. Drawn per
(seed, epoch, sample id): the same on every rank and world size, new every epoch."""

from __future__ import annotations

import json

import pytest
import torch
from test_data_shards import config, make_images, readers, take

from ot_dist.config.schema import ConceptConfig
from ot_dist.data.captions import vary_caption
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import build_shard_set
from ot_dist.errors import ConfigError

TAGS = "sks dog, red collar, grass, sunny day, park, bokeh"


def concept(**options) -> ConceptConfig:
    return ConceptConfig(**{"path": "x", **options})


def draw(options, seed) -> str:
    return vary_caption(TAGS, concept(**options), torch.Generator().manual_seed(seed), 0)


def test_no_option_leaves_the_caption_alone():
    assert draw({}, 0) == TAGS


def test_shuffling_keeps_the_first_tags_and_permutes_the_rest():
    rest = set(TAGS.split(", ")[1:])
    seen = set()
    for seed in range(30):
        tags = draw({"tag_shuffling": True}, seed).split(", ")
        assert tags[0] == "sks dog" and set(tags[1:]) == rest
        seen.add(tuple(tags))
    assert len(seen) > 10  # it does shuffle
    assert draw({"tag_shuffling": True}, 5) == draw({"tag_shuffling": True}, 5)  # deterministic per draw
    two = draw({"tag_shuffling": True, "keep_tags_count": 2}, 3).split(", ")
    assert two[:2] == ["sks dog", "red collar"]


def test_tag_dropout_drops_at_its_rate_and_never_a_kept_tag():
    kept = []
    for seed in range(400):
        tags = draw({"tag_dropout_probability": 0.3}, seed).split(", ")
        assert tags[0] == "sks dog"
        kept.append(len(tags) - 1)
    assert sum(kept) / (5 * len(kept)) == pytest.approx(0.7, abs=0.05)


def test_full_tag_dropout_leaves_all_tags_or_only_the_kept_ones_as_onetrainer_s_full_mode(tmp_path):
    """OneTrainer's tag dropout modes (mgds DropTags): FULL, its default, drops every tag after the kept ones at
    once with the probability; RANDOM drops each on its own. `ot-dist import onetrainer` keeps the mode."""
    from ot_dist.migrate.onetrainer import import_onetrainer

    counts = {"all": 0, "kept only": 0}
    for seed in range(400):
        tags = draw({"tag_dropout_probability": 0.3, "tag_dropout_mode": "FULL"}, seed).split(", ")
        assert tags == TAGS.split(", ") or tags == ["sks dog"], tags  # never a few tags left out
        counts["all" if len(tags) > 1 else "kept only"] += 1
    assert counts["kept only"] / 400 == pytest.approx(0.3, abs=0.05)
    text = {"tag_dropout_enable": True, "tag_dropout_probability": 0.3}
    config = {"__version": 11, "model_type": "STABLE_DIFFUSION_15", "training_method": "LORA", "base_model_name": "m",
              "concepts": [{"path": str(tmp_path), "text": text},  # OneTrainer's default mode: FULL
                           {"path": str(tmp_path), "text": {**text, "tag_dropout_mode": "RANDOM"}}]}
    (tmp_path / "ot.json").write_text(json.dumps(config))
    imported = import_onetrainer(tmp_path / "ot.json").config["data"]["concepts"]
    assert [(c["tag_dropout_mode"], c["tag_dropout_probability"]) for c in imported] == [("full", 0.3), ("random", 0.3)]


def test_caption_dropout_empties_whole_captions_at_its_rate():
    empty = sum(draw({"caption_dropout_probability": 0.2}, seed) == "" for seed in range(500))
    assert empty / 500 == pytest.approx(0.2, abs=0.05)
    assert draw({"caption_dropout_probability": 1.0}, 0) == ""


def test_the_reader_varies_per_epoch_and_agrees_across_world_sizes(tmp_path):
    folder = make_images(tmp_path / "imgs", [(64, 64)] * 8)
    for i in range(8):
        (folder / f"{i:04d}.txt").write_text(f"trigger, tag a {i}, tag b, tag c, tag d\n")
    cfg = config({"concepts": [{"path": str(folder), "tag_shuffling": True, "tag_dropout_probability": 0.2}]})
    build_shard_set(cfg, tmp_path / "set", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "set", cfg)

    def captions(world_size, epoch):
        out = {}
        for reader in readers(dataset, world_size=world_size, batch_size=2):
            for batch in take(reader, epoch):
                out |= dict(zip(batch["sample_id"].tolist(), batch["caption"]))
        return out

    one, two = captions(1, 0), captions(2, 0)
    assert one == two and len(one) == 8  # a sample's caption does not depend on which rank reads it
    assert all(c.startswith("trigger, ") for c in one.values())
    assert captions(1, 1) != one  # a new variation every epoch
    assert len({c for c in one.values()}) == 8


def test_cached_text_cannot_follow_varied_captions(tmp_path):
    with pytest.raises(ConfigError, match=r"data.cache_text: data.concepts\[0\] varies its captions"):
        from ot_dist.config.load import validate

        validate({"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o",
                  "data": {"concepts": [{"path": "x", "tag_shuffling": True}], "cache_text": True}})


# ---- image augmentation (the same module boundary: what a sample looks like, drawn per (seed, epoch, sample)) ----

def test_flip_and_colour_jitter_are_drawn_per_epoch_and_agree_across_world_sizes(tmp_path):
    import numpy as np

    folder = make_images(tmp_path / "imgs", [(64, 64)] * 8, masks=True)
    cfg = config({"concepts": [{"path": str(folder), "flip_probability": 0.5, "brightness": 0.3}]})
    plain_cfg = config({"concepts": [{"path": str(folder)}]})
    build_shard_set(cfg, tmp_path / "set", log=lambda *_: None)
    dataset, plain = ShardDataset(tmp_path / "set", cfg), ShardDataset(tmp_path / "set", plain_cfg)
    flips = 0
    for sample_id in range(8):
        a, b = dataset.load(sample_id, epoch=0), plain.load(sample_id, epoch=0)
        assert torch.equal(a["pixels"], dataset.load(sample_id, epoch=0)["pixels"])  # deterministic
        mirrored = torch.equal(a["mask"], b["mask"].flip(-1)) and not torch.equal(a["mask"], b["mask"])
        flips += mirrored
        if mirrored:  # the mask follows the image; the brightness factor leaves the image's structure
            assert torch.corrcoef(torch.stack([a["pixels"].flatten(), b["pixels"].flip(-1).flatten()]))[0, 1] > 0.9
        else:
            assert torch.equal(a["mask"], b["mask"])
    assert 1 <= flips <= 7  # about half, with 8 draws
    assert not torch.equal(dataset.load(0, epoch=0)["pixels"], dataset.load(0, epoch=1)["pixels"])
    _ = np  # numpy is the reader's


def test_hue_shift_turns_red_to_green():
    from PIL import Image

    from ot_dist.data.augment import shift_hue

    red = Image.new("RGB", (4, 4), (255, 0, 0))
    r, g, b = shift_hue(red, 1 / 3).getpixel((0, 0))
    assert g > 200 and r < 40 and b < 40


def test_hue_shift_keeps_every_colour_but_its_hue():
    """The hue turns in floating point, as torchvision's adjust_hue that OneTrainer applies: no turn leaves every pixel
    as it was, a third of a turn is the channel rotation R -> G -> B, any turn is colorsys' HSV rotation within the
    last 8-bit rounding (Pillow's 8-bit HSV round trip was up to 6 levels off with no turn, 11 at a third)."""
    import colorsys

    import numpy as np
    from PIL import Image

    from ot_dist.data.augment import shift_hue

    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    assert np.array_equal(np.asarray(shift_hue(image, 0.0)), pixels)
    assert np.array_equal(np.asarray(shift_hue(image, 1 / 3)), pixels[..., [2, 0, 1]])

    def turned(rgb, turn):
        hue, saturation, value = colorsys.rgb_to_hsv(*(rgb / 255))
        return colorsys.hsv_to_rgb((hue + turn) % 1.0, saturation, value)

    expected = np.rint(np.array([[turned(rgb, 0.05) for rgb in row] for row in pixels.astype(float)]) * 255)
    assert np.abs(np.asarray(shift_hue(image, 0.05)).astype(int) - expected).max() <= 1


def test_jitter_strengths_of_1_or_more_clamp_the_factor_at_0_as_onetrainer():
    """mgds RandomBrightness / RandomContrast / RandomSaturation draw a factor in [1-s, 1+s] and take max(0, factor):
    a strength of 1 or more is legal there (and `ot-dist import onetrainer` of it was a config error here). A factor
    clamped at 0 is the mean grey for contrast, not the inverted image a negative factor gives."""
    import numpy as np
    from PIL import Image, ImageEnhance

    from ot_dist.data.augment import augment

    concept = ConceptConfig(path="x", contrast=3.0)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    clamped = 0
    for seed in range(12):
        draws = torch.rand(6, generator=torch.Generator().manual_seed(seed)).tolist()
        factor = max(0.0, 1 + (2 * draws[3] - 1) * 3.0)
        out, _ = augment(image, None, concept, torch.Generator().manual_seed(seed))
        assert np.array_equal(np.asarray(out), np.asarray(ImageEnhance.Contrast(image).enhance(factor)))
        clamped += factor == 0.0
    assert clamped  # some draws fell below 0


def test_cached_latents_cannot_hold_augmented_images():
    from ot_dist.config.load import validate

    with pytest.raises(ConfigError, match=r"data.cache_latents: data.concepts\[0\] augments its images"):
        validate({"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o",
                  "data": {"concepts": [{"path": "x", "flip_probability": 0.5}], "cache_latents": True}})


def test_caption_text_reads_as_a_caption_file_one_caption_per_line(tmp_path):
    """A YAML block scalar (`caption_text: >`) ends with a newline: it is one caption, not that caption and an empty
    one drawn every other epoch; several lines are several captions, each with the prefix."""
    import yaml

    from ot_dist.data.concepts import read_caption

    folded = yaml.safe_load("path: x\ncaption_source: text\ncaption_prefix: 'sks, '\ncaption_text: >\n  photo of\n"
                            "  a dog\n")
    assert folded["caption_text"] == "photo of a dog\n"
    # normalised in the config, so a shard set built from the old reading has another fingerprint and is rebuilt
    assert ConceptConfig(**folded).caption_text == "photo of a dog"
    assert read_caption(ConceptConfig(**folded), tmp_path / "a.png") == "sks, photo of a dog"
    lines = concept(caption_source="text", caption_prefix="sks, ", caption_text="a dog\n\n  on grass \n")
    assert read_caption(lines, tmp_path / "a.png") == "sks, a dog\nsks, on grass"


def test_a_byte_order_mark_is_no_part_of_a_caption(tmp_path):
    """Windows Notepad (before 2019) saves UTF-8 with a byte order mark; read as text it stays in front of the
    caption, where CLIP's tokenizer makes three byte tokens of it and the first tag matches no kept or special tag."""
    from ot_dist.data.captions import special_tags
    from ot_dist.data.concepts import read_caption
    from ot_dist.data.external import caption_text

    (tmp_path / "a.txt").write_bytes("\ufeffsks dog, grass\n".encode())
    assert read_caption(concept(caption_prefix="p, "), tmp_path / "a.png") == "p, sks dog, grass"
    assert caption_text("\ufeffsks dog".encode(), "txt", "caption", "tar a.tar: sample a") == "sks dog"
    (tmp_path / "tags.txt").write_bytes("\ufeffsks dog\ngrass\n".encode())
    assert special_tags(str(tmp_path / "tags.txt"), ",") == ["sks dog", "grass"]


def test_caption_extension_without_its_dot_names_the_same_files(tmp_path):
    """`txt` (how `ot-dist shard index --caption-ext` spells it) was a ValueError traceback from pathlib."""
    from ot_dist.data.concepts import classify_files, read_caption

    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "a.caption").write_text("a red circle\n")
    spelled = concept(path=str(tmp_path), caption_extension="caption")
    assert spelled.caption_extension == ".caption"
    assert classify_files("concepts[0]", spelled) == ([tmp_path / "a.png"], [])
    assert read_caption(spelled, tmp_path / "a.png") == "a red circle"


def test_tag_dropout_probability_one_keeps_only_the_kept_tags():
    """OneTrainer's tag dropout probability runs "from 0 to 1" (its UI); 1 was refused, also on import."""
    for mode in ("random", "full"):
        assert draw({"tag_dropout_probability": 1.0, "tag_dropout_mode": mode, "keep_tags_count": 2}, 0) == \
            "sks dog, red collar"


@pytest.mark.parametrize("prefix,caption", [("sks", "sks a dog, grass"), ("sks,", "sks, a dog, grass"),
                                            ("photo of sks, ", "photo of sks, a dog, grass"), ("", "a dog, grass")])
def test_caption_prefix_is_followed_by_a_space_as_kohyas(tmp_path, prefix, caption):
    """kohya's sd-scripts (train_util.py process_caption) put `caption_prefix + " " + caption`; a prefix written
    without its space glued the trigger word to the caption's first word (`sksa dog`)."""
    from ot_dist.data.concepts import read_caption

    (tmp_path / "a.txt").write_text("a dog, grass\n")
    assert read_caption(concept(caption_prefix=prefix), tmp_path / "a.png") == caption
    # the config holds the prefix with its space: a shard set built with the glued prefix is rebuilt, not reused
    assert concept(caption_prefix=prefix).caption_prefix == caption.removesuffix("a dog, grass")


@pytest.mark.parametrize("suffix,caption", [("sks", "a dog, grass sks"), (", sks", "a dog, grass , sks"),
                                            ("", "a dog, grass")])
def test_caption_suffix_follows_a_space_before_shuffling_as_kohyas(tmp_path, suffix, caption):
    """kohya's process_caption puts `caption + " " + caption_suffix` (after the prefix), before dropout and
    shuffling: the suffix is one more tag to shuffle, unless the keep-tags separator keeps it in the tail."""
    from ot_dist.data.concepts import read_caption

    (tmp_path / "a.txt").write_text("a dog, grass\n")
    assert read_caption(concept(caption_suffix=suffix, caption_prefix="p"), tmp_path / "a.png") == "p " + caption
    (tmp_path / "a.txt").write_text("\n")  # an empty caption is the suffix alone, no space before it
    assert read_caption(concept(caption_suffix=suffix), tmp_path / "a.png") == suffix.lstrip()
    if suffix == ", sks":  # stored with the caption: shuffling moves it like any free tag
        (tmp_path / "a.txt").write_text("a, b, c, d\n")
        stored = read_caption(concept(caption_suffix=suffix), tmp_path / "a.png")
        shuffle = concept(caption_suffix=suffix, tag_shuffling=True, keep_tags_count=0)
        firsts = {vary_caption(stored, shuffle, torch.Generator().manual_seed(seed), 0).split(", ")[0]
                  for seed in range(20)}
        assert "sks" in firsts and len(firsts) > 2


def test_caption_suffix_is_in_the_shard_settings_only_when_set():
    """The suffix is stored in the shards: a set is rebuilt when it changes; sets built before the option existed
    (no suffix) keep their fingerprint, so it is not in their settings at all."""
    from test_data_shards import config as train_config

    from ot_dist.data.shards import build_settings

    def settings(**options):
        return build_settings(train_config({"concepts": [{"path": "x", **options}]}))["concepts"][0]

    assert "caption_suffix" not in settings() and settings(caption_suffix="sks")["caption_suffix"] == " sks"
