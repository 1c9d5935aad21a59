"""`ot-dist import diffusers` of the edit scripts: train_dreambooth_lora_flux_kontext.py (flux_kontext) and
train_dreambooth_lora_flux2{,_klein}_img2img.py (flux2 / flux2_klein with references). They read each training image's
reference from `--cond_image_column` of `--dataset_name`; for a local imagefolder that column is a metadata key
`<column>_file_name` (datasets makes an image column of it, as of `file_name`), which the import turns into a folder
of links paired by name with the captions folder's: the concept's reference_path. Their defaults are their parsers'
(diffusers_defaults: the text-to-image script each was written from, less what it dropped, with its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from ot_dist.config.load import load_config
from ot_dist.data.concepts import list_images, read_caption, reference_partners
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.diffusers import import_diffusers
from ot_dist.migrate.diffusers_defaults import defaults
from tests.test_import_diffusers import not_honoured, run_import

EDIT_SCRIPTS = {"train_dreambooth_lora_flux_kontext.py": ("flux_kontext", "train_dreambooth_lora_flux.py"),
                "train_dreambooth_lora_flux2_img2img.py": ("flux2", "train_dreambooth_lora_flux2.py"),
                "train_dreambooth_lora_flux2_klein_img2img.py": ("flux2_klein", "train_dreambooth_lora_flux2_klein.py")}


def edit_folder(tmp_path: Path, rows: list[dict] | None = None) -> Path:
    """An imagefolder of edits: after/i.png (the training image), before/i.jpg (its reference), the instruction."""
    folder = tmp_path / "edits"
    for sub in ("after", "before"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for i in range(2):
        Image.new("RGB", (32, 32), (200, i * 40, 0)).save(folder / "after" / f"{i}.png")
        Image.new("RGB", (32, 32), (0, i * 40, 200)).save(folder / "before" / f"{i}.jpg")
    rows = rows or [{"file_name": f"after/{i}.png", "cond_file_name": f"before/{i}.jpg", "prompt": f"make it red {i}"}
                    for i in range(2)]
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return folder


def command(script: str, folder: Path, extra: str = "") -> str:
    return (f"accelerate launch {script} --pretrained_model_name_or_path m --dataset_name {folder} "
            f"--cond_image_column cond --caption_column prompt {extra}")


@pytest.mark.parametrize("script", sorted(EDIT_SCRIPTS))
def test_edit_pairs_become_a_concept_with_its_reference_folder(tmp_path, script):
    """Each row's image, instruction and reference: the written folders pair every image with its reference (by
    ot_dist's own pairing), its caption the row's; the script's defaults are its base script's (learning rate, batch,
    unshifted flow draw, Kontext's / [dev]'s guidance 3.5)."""
    family, base = EDIT_SCRIPTS[script]
    folder = edit_folder(tmp_path)
    c, text, _ = run_import(tmp_path, command(script, folder))
    assert (c["model"]["family"], c["method"]) == (family, "lora")
    d = defaults(script)
    assert c["learning_rate"] == d["learning_rate"] == defaults(base)["learning_rate"]
    assert c["batch_size"] == d["train_batch_size"]
    assert c["loss"]["timestep_shift"] == 1.0 and c["loss"]["dynamic_timestep_shifting"] is False
    assert c["model"].get("guidance_scale") == (3.5 if family != "flux2_klein" else None)
    concept = load_config(tmp_path / "out.yaml").data.concepts[0]
    images = list_images("concepts[0]", concept)
    partners = reference_partners("concepts[0]", concept, images)
    assert sorted(p.name for p in images) == ["0.png", "1.png"]
    for image in images:
        i = image.stem
        assert image.resolve() == (folder / "after" / f"{i}.png").resolve()
        assert [p.resolve() for p in partners[image]] == [(folder / "before" / f"{i}.jpg").resolve()]
        assert read_caption(concept, image) == f"make it red {i}"
    listed = not_honoured(text)
    assert any(line.startswith("vae_encode_mode: mode") for line in listed) == (family == "flux_kontext")


def test_kontext_lora_targets_validation_image_and_t5_length(tmp_path):
    """The Kontext script adapts Flux's list of modules; its validation image is each sample's reference_image; a
    caption length other than 512 is model.t5_max_tokens, as for Flux."""
    folder = edit_folder(tmp_path)
    Image.new("RGB", (32, 32)).save(tmp_path / "v.png")
    c, _, _ = run_import(tmp_path, command("train_dreambooth_lora_flux_kontext.py", folder,
                                           f"--validation_prompt 'make it blue' --validation_image {tmp_path / 'v.png'}"
                                           " --num_validation_images 2 --max_sequence_length 256"))
    assert "ff_context.net.2" in c["lora"]["transformer_targets"] and "proj_mlp" not in c["lora"]["transformer_targets"]
    assert [p["reference_image"] for p in c["sampling"]["prompts"]] == [str(tmp_path / "v.png")] * 2
    assert c["model"]["t5_max_tokens"] == 256


def test_the_img2img_scripts_encode_with_the_pipelines_layers(tmp_path):
    """The FLUX.2 img2img scripts have no text_encoder_out_layers (the pipeline's encode_prompt layers, ot_dist's):
    nothing listed; their text-to-image scripts' prior preservation is not theirs (an error naming it)."""
    folder = edit_folder(tmp_path)
    _, text, _ = run_import(tmp_path, command("train_dreambooth_lora_flux2_klein_img2img.py", folder))
    assert not any(line.startswith("text_encoder_out_layers") for line in not_honoured(text))
    assert "text_encoder_out_layers" not in defaults("train_dreambooth_lora_flux2_img2img.py")
    (tmp_path / "cmd.sh").write_text(command("train_dreambooth_lora_flux2_img2img.py", folder,
                                             "--with_prior_preservation"), encoding="utf-8")
    with pytest.raises(InputFileError, match="--with_prior_preservation is not an argument"):
        import_diffusers(str(tmp_path / "cmd.sh"), captions_folder=str(tmp_path / "c"))


@pytest.mark.parametrize("extra, rows, message", [
    ("", None, None),  # filled in below: no cond_image_column
    ("", [{"file_name": "after/0.png", "cond": "before/0.jpg", "prompt": "p"}], "'cond' is a text column"),
    ("", [{"file_name": "after/0.png", "other_file_name": "before/0.jpg", "prompt": "p"}],
     "the metadata has no cond_file_name key"),
    ("", [{"file_name": "after/0.png", "cond_file_name": "before/9.jpg", "prompt": "p"}], "before/9.jpg"),
])
def test_what_cannot_map_is_refused_naming_the_argument(tmp_path, extra, rows, message):
    folder = edit_folder(tmp_path, rows)
    if message is None:  # Kontext without a cond column trains text-to-image: ot_dist's flux_kontext cannot
        text = command("train_dreambooth_lora_flux_kontext.py", folder).replace("--cond_image_column cond", "")
        message = "cond_image_column: not set"
    else:
        text = command("train_dreambooth_lora_flux_kontext.py", folder, extra)
    (tmp_path / "cmd.sh").write_text(text, encoding="utf-8")
    with pytest.raises((ConfigError, InputFileError), match=message):
        import_diffusers(str(tmp_path / "cmd.sh"), captions_folder=str(tmp_path / "c"))


def test_a_folder_of_images_or_no_caption_column_is_refused(tmp_path):
    """--instance_data_dir has no columns (the script reads references from --dataset_name only); without
    --caption_column the script stops."""
    folder = edit_folder(tmp_path)
    for text, message in ((command("train_dreambooth_lora_flux2_img2img.py", folder).replace(
                              f"--dataset_name {folder}", f"--instance_data_dir {folder / 'after'} --instance_prompt p"),
                           "a folder of images \\(--instance_data_dir\\) has none"),
                          (command("train_dreambooth_lora_flux2_img2img.py", folder).replace(
                              "--caption_column prompt", ""), "caption_column: not set")):
        (tmp_path / "cmd.sh").write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError, match=message):
            import_diffusers(str(tmp_path / "cmd.sh"), captions_folder=str(tmp_path / "c"))
