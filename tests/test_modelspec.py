"""The ModelSpec header (`modelspec.*`, Stability AI's model metadata spec 1.0.1, github.com/Stability-AI/ModelSpec) in
every LoRA, single-file and embedding file ot_dist writes (ot_dist/checkpoint/modelspec.py).

The expected strings are the documented ones, with their source:
- kohya sd-scripts, library/sai_model_spec.py (Feb 2026): ARCH_SD_V1 "stable-diffusion-v1", ARCH_SD_V2_512,
  ARCH_SD_V2_768_V, ARCH_SD_XL_V1_BASE, ARCH_FLUX_1_DEV / _SCHNELL "flux-1-dev" / "flux-1-schnell", ARCH_FLUX_1_CHROMA
  "chroma"; suffixes "/lora" and "/textual-inversion"; IMPL_STABILITY_AI for checkpoints, embeddings and SDXL LoRAs,
  "diffusers" for SD 1.x / 2.x / SD3 LoRAs, IMPL_FLUX, IMPL_CHROMA; prediction_type "epsilon" / "v", none for Flux.
- the spec's architecture list: "stable-diffusion-v1-inpainting", "stable-diffusion-v2-inpainting",
  "stable-diffusion-v3-medium" (also ComfyUI's CheckpointSave for SD3 and OneTrainer's), "stable-cascade-v1-stage-c".
- SwarmUI (src/Text2Image/T2IModelClassSorter.cs), which reads them: "stable-diffusion-v3.5-large" / "-medium".
- OneTrainer (resources/sd_model_spec/*.json), the only writer with ids for PixArt and Würstchen v2: "pixart-alpha",
  "pixart-sigma", "wuerstchen-v2-prior".
kohya's own build_metadata, run outside the repository on the same settings, gives these values for every case it
covers except where noted in docs/lora.md (SD3's ids, its prediction type, Flux / Chroma LoRAs' implementation).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
import torch
from conftest import base_config
from safetensors import safe_open

from ot_dist.checkpoint.modelspec import FileFacts, modelspec_header, run_facts
from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.methods.registry import build_method
from ot_dist.models.families.registry import FAMILY_NAMES, get_family
from ot_dist.models.loading import load_model

STABILITY = "https://github.com/Stability-AI/generative-models"
BFL = "https://github.com/black-forest-labs/flux"
CHROMA = "https://huggingface.co/lodestones/Chroma"
CASCADE = "https://github.com/Stability-AI/StableCascade"
# The published denoiser configs' fields that tell the variants apart (their config.json on the Hub)
SD3_MEDIUM = {"qk_norm": None, "dual_attention_layers": ()}
SD35_LARGE = {"qk_norm": "rms_norm", "dual_attention_layers": ()}
SD35_MEDIUM = {"qk_norm": "rms_norm", "dual_attention_layers": tuple(range(13))}
FLUX_DEV, FLUX_SCHNELL = {"guidance_embeds": True}, {"guidance_embeds": False}

# (family, denoiser config, prediction type, inpainting, kind, LoRA layout) -> (architecture, implementation)
DOCUMENTED = [
    ("sd1", {}, "epsilon", False, "lora", "kohya", "stable-diffusion-v1/lora", "diffusers"),
    ("sd1", {}, "epsilon", False, "checkpoint", None, "stable-diffusion-v1", STABILITY),
    ("sd1", {}, "v_prediction", False, "embedding", None, "stable-diffusion-v1/textual-inversion", STABILITY),
    ("sd1", {}, "epsilon", True, "checkpoint", None, "stable-diffusion-v1-inpainting", STABILITY),
    ("sd1", {}, "epsilon", False, "lora", "diffusers", "stable-diffusion-v1/lora", "diffusers"),
    ("sd2", {}, "v_prediction", False, "lora", "kohya", "stable-diffusion-v2-768-v/lora", "diffusers"),
    ("sd2", {}, "epsilon", False, "checkpoint", None, "stable-diffusion-v2-512", STABILITY),
    ("sd2", {}, "v_prediction", False, "embedding", None, "stable-diffusion-v2-768-v/textual-inversion", STABILITY),
    ("sd2", {}, "epsilon", True, "checkpoint", None, "stable-diffusion-v2-inpainting", STABILITY),
    ("sdxl", {}, "epsilon", False, "lora", "kohya", "stable-diffusion-xl-v1-base/lora", STABILITY),
    ("sdxl", {}, "v_prediction", False, "checkpoint", None, "stable-diffusion-xl-v1-base", STABILITY),
    ("sdxl", {}, "epsilon", False, "embedding", None, "stable-diffusion-xl-v1-base/textual-inversion", STABILITY),
    ("sd3", SD3_MEDIUM, None, False, "checkpoint", None, "stable-diffusion-v3-medium", STABILITY),
    ("sd3", SD35_LARGE, None, False, "lora", "diffusers", "stable-diffusion-v3.5-large/lora", "diffusers"),
    ("sd3", SD35_MEDIUM, None, False, "embedding", None, "stable-diffusion-v3.5-medium/textual-inversion", STABILITY),
    ("flux", FLUX_DEV, None, False, "checkpoint", None, "flux-1-dev", BFL),
    ("flux", FLUX_SCHNELL, None, False, "lora", "diffusers", "flux-1-schnell/lora", "diffusers"),
    ("flux", FLUX_DEV, None, False, "embedding", None, "flux-1-dev/textual-inversion", BFL),
    ("chroma", {}, None, False, "checkpoint", None, "chroma", CHROMA),
    ("chroma", {}, None, False, "lora", "diffusers", "chroma/lora", "diffusers"),
    ("pixart_alpha", {}, "epsilon", False, "lora", "diffusers", "pixart-alpha/lora", "diffusers"),
    ("pixart_sigma", {}, "epsilon", False, "lora", "diffusers", "pixart-sigma/lora", "diffusers"),
    ("stable_cascade", {}, "epsilon", False, "checkpoint", None, "stable-cascade-v1-stage-c", CASCADE),
    ("stable_cascade", {}, "epsilon", False, "lora", "kohya", "stable-cascade-v1-stage-c/lora", CASCADE),
    ("stable_cascade", {}, "epsilon", False, "embedding", None, "stable-cascade-v1-stage-c/textual-inversion", CASCADE),
    ("wuerstchen_v2", {}, "epsilon", False, "lora", "diffusers", "wuerstchen-v2-prior/lora", "diffusers"),
    ("qwen_image", {}, None, False, "checkpoint", None, "qwen-image", "diffusers"),  # ComfyUI's names are diffusers'
    ("qwen_image", {}, None, False, "lora", "diffusers", "qwen-image/lora", "diffusers"),
    ("sana", {}, None, False, "lora", "diffusers", "sana/lora", "diffusers"),
    ("lumina2", {}, None, False, "lora", "diffusers", "lumina-2/lora", "diffusers"),  # kohya's ARCH_LUMINA_2
    ("z_image", {}, None, False, "lora", "diffusers", "z-image/lora", "diffusers"),  # SwarmUI's class ids
    ("z_image", {}, None, False, "checkpoint", None, "z-image", "https://github.com/Tongyi-MAI/Z-Image"),
    ("flux2", {}, None, False, "lora", "diffusers", "flux-2-dev/lora", "diffusers"),
    ("flux2_klein", {}, None, False, "checkpoint", None, "flux-2-klein", "https://github.com/black-forest-labs/flux2"),
    ("hidream", {}, None, False, "lora", "diffusers", "hidream-i1/lora", "diffusers"),  # OneTrainer's id
    ("hidream", {}, None, False, "checkpoint", None, "hidream-i1", "diffusers"),  # ComfyUI's names are diffusers'
    # SwarmUI's class id (T2IModelClassSorter: Flux.1-dev/kontext, matched lowercased); kohya has no Kontext id
    ("flux_kontext", FLUX_DEV, None, False, "checkpoint", None, "flux.1-dev/kontext", BFL),
    ("flux_kontext", FLUX_DEV, None, False, "lora", "diffusers", "flux.1-dev/kontext/lora", "diffusers"),
    # SwarmUI's class id (T2IModelClassSorter: qwen-image-edit); ComfyUI's names are diffusers'
    ("qwen_image_edit", {}, None, False, "checkpoint", None, "qwen-image-edit", "diffusers"),
    ("qwen_image_edit", {}, None, False, "lora", "diffusers", "qwen-image-edit/lora", "diffusers"),
    ("qwen_image_edit_plus", {}, None, False, "lora", "diffusers", "qwen-image-edit-plus/lora", "diffusers"),
    # SwarmUI's class ids for Wan 2.1 T2V, by the transformer's width (12 x 128: 1.3B, 40 x 128: 14B)
    ("wan", {"num_attention_heads": 12, "attention_head_dim": 128}, None, False, "lora", "diffusers",
     "wan-2_1-text2video-1_3b/lora", "diffusers"),
    ("wan", {"num_attention_heads": 40, "attention_head_dim": 128}, None, False, "checkpoint", None,
     "wan-2_1-text2video-14b", "diffusers"),
    ("krea2", {}, None, False, "lora", "diffusers", "krea-2/lora", "diffusers"),  # OneTrainer: Krea-2/lora
    ("krea2", {}, None, False, "checkpoint", None, "krea-2", "https://github.com/krea-ai/krea-2"),
    # diffusers' modular ERNIE-Image blocks' model_name; ComfyUI's names are diffusers'
    ("ernie_image", {}, None, False, "lora", "diffusers", "ernie-image/lora", "diffusers"),
    ("ernie_image", {}, None, False, "checkpoint", None, "ernie-image", "diffusers"),
    # Flux.1 Fill [dev] (flux with a 384-channel transformer): SwarmUI's class id (T2IModelClassSorter:
    # Flux.1-dev/inpaint, matched lowercased); kohya has no Fill id
    ("flux", FLUX_DEV, None, True, "checkpoint", None, "flux.1-dev/inpaint", BFL),
    ("flux", FLUX_DEV, None, True, "lora", "diffusers", "flux.1-dev/inpaint/lora", "diffusers"),
    # SD 2.0 depth (sd2 with a 5-channel UNet): the spec's stable-diffusion-v2-depth
    ("sd2", {"in_channels": 5}, "epsilon", False, "checkpoint", None, "stable-diffusion-v2-depth", STABILITY),
    ("sd2", {"in_channels": 5}, "epsilon", False, "lora", "kohya", "stable-diffusion-v2-depth/lora", "diffusers"),
    # OneTrainer's ids for Anima (resources/sd_model_spec/anima.json, anima-lora.json)
    ("anima", {}, None, False, "lora", "diffusers", "Anima/lora", "diffusers"),
    ("anima", {}, None, False, "checkpoint", None, "Anima", "diffusers"),
    # SwarmUI's class ids (T2IModelClassSorter: ideogram-4, ideogram-4/lora); OneTrainer writes "Ideogram"
    ("ideogram4", {}, None, False, "lora", "diffusers", "ideogram-4/lora", "diffusers"),
    # OneTrainer's ids (resources/sd_model_spec/hunyuan_video*.json)
    ("hunyuan_video", {}, None, False, "lora", "diffusers", "hunyuan-video/lora", "diffusers"),
    ("hunyuan_video", {}, None, False, "checkpoint", None, "hunyuan-video", "diffusers"),
]
FACTS = FileFacts(title="my-run", resolution=1024, created=1764177771.0)
MUST = ("modelspec.sai_model_spec", "modelspec.architecture", "modelspec.implementation", "modelspec.title",
        "modelspec.resolution")


def test_every_family_has_a_documented_identity():
    assert {row[0] for row in DOCUMENTED} == set(FAMILY_NAMES)


@pytest.mark.parametrize("family, config, prediction, inpainting, kind, layout, architecture, implementation",
                         DOCUMENTED, ids=[f"{r[0]}-{r[4]}-{r[6]}" for r in DOCUMENTED])
def test_each_family_and_file_kind_writes_the_documented_ids(family, config, prediction, inpainting, kind, layout,
                                                             architecture, implementation):
    header = modelspec_header(get_family(family), kind, config, prediction, FACTS, lora_layout=layout,
                              inpainting=inpainting)
    assert header["modelspec.architecture"] == architecture
    assert header["modelspec.implementation"] == implementation
    # the spec's words for what a DDPM denoiser predicts; flow matching has none (kohya leaves it out for Flux)
    spec_word = {"epsilon": "epsilon", "v_prediction": "v", None: None}[prediction]
    assert header.get("modelspec.prediction_type") == spec_word
    assert_follows_the_spec(header)


def assert_follows_the_spec(header: dict) -> None:
    assert all(isinstance(v, str) for v in header.values()), header  # a safetensors header holds strings only
    assert set(MUST) <= set(header), set(MUST) - set(header)
    assert header["modelspec.sai_model_spec"] == "1.0.1"
    width, height = header["modelspec.resolution"].split("x")  # `<width>x<height>`, as SwarmUI parses it
    assert int(width) > 0 and int(height) > 0
    assert datetime.fromisoformat(header["modelspec.date"]).tzinfo is not None  # ISO-8601, and which clock
    assert header["modelspec.title"]


def test_the_run_gives_title_resolution_date_timesteps_and_clip_skip(tiny_models, shapes_data, tmp_path):
    sd1 = get_family("sd1")
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "portrait-v3", resolution=[384, 512],
                                  **{"loss.min_timestep": 100, "model.text_encoder_layer_skip": 1}))
    header = modelspec_header(sd1, "lora", {}, "epsilon", run_facts(config, 1764177771.0, "_ema"), lora_layout="kohya")
    assert header["modelspec.title"] == "portrait-v3_ema"  # output_dir's name, with the export's suffix
    assert header["modelspec.resolution"] == "512x512"  # the largest side trained
    assert header["modelspec.date"] == "2025-11-26T17:22:51Z"  # the run's start, in UTC
    assert header["modelspec.timestep_range"] == "100,999"  # both ends trained (the spec's `0,499` / `500,999`)
    assert header["modelspec.encoder_layer"] == "2"  # A1111's clip skip 2: one layer before the last
    named = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "o", **{
        "metadata.title": "Portrait v3", "metadata.author": "me", "metadata.tags": "Person,Style",
        "loss.max_timestep": 499}))
    header = modelspec_header(sd1, "lora", {}, "epsilon", run_facts(named), lora_layout="kohya")
    assert (header["modelspec.title"], header["modelspec.author"], header["modelspec.tags"]) == \
        ("Portrait v3", "me", "Person,Style")
    assert header["modelspec.timestep_range"] == "0,499"
    ema = modelspec_header(sd1, "lora", {}, "epsilon", run_facts(named, suffix="_ema"), lora_layout="kohya")
    assert ema["modelspec.title"] == "Portrait v3_ema"  # another model, another title
    assert "modelspec.encoder_layer" not in header and "modelspec.description" not in header
    assert_follows_the_spec(header)


def test_a_run_dates_its_exports_by_its_start(tiny_models, shapes_data, tmp_path):
    """Through the trainer: the LoRA and its EMA copy say the run's start (run.json, which a resume keeps) and their
    titles; `ot-dist export` of the run's checkpoint writes the same header (tests/test_frozen_export.py: the same
    bytes)."""
    import json

    from ot_dist.train.trainer import Trainer

    out = tmp_path / "style-lora"
    raw = base_config(tiny_models["sd1"], shapes_data, out, method="lora", max_steps=1,
                      **{"ema.enabled": True, "checkpoint.at_end": False})
    Trainer(validate(raw), log=lambda *_: None).train()
    started = json.loads((out / "run.json").read_text())["started_at"]
    date = datetime.fromtimestamp(int(started)).astimezone().strftime("%Y-%m-%dT%H:%M:%S")
    for name, title in (("lora.safetensors", "style-lora"), ("lora_ema.safetensors", "style-lora_ema")):
        metadata = metadata_of(out / name)
        assert metadata["modelspec.title"] == title
        assert datetime.fromisoformat(metadata["modelspec.date"]).astimezone().strftime("%Y-%m-%dT%H:%M:%S") == date
        assert metadata["modelspec.architecture"] == "stable-diffusion-v1/lora"


def metadata_of(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def export(model_path, shapes_data, out: Path, family: str, method: str, created=1764177771.0, **settings):
    config = validate(base_config(model_path, shapes_data, out, family=family, method=method, **settings))
    model = load_model(config.model)
    trainer_method = build_method(config)
    trainer_method.prepare(model)
    extra = {"formats": ("single-file",)} if method == "full" else {}
    return trainer_method.export(model, out, created=created, **extra)


@pytest.mark.parametrize("layout", ["kohya", "diffusers"])
def test_a_written_sd1_lora_carries_the_header_beside_kohyas_keys(layout, tiny_models, shapes_data, tmp_path):
    """Both layouts (the diffusers one through diffusers' own save_lora_weights, whose header is extended)."""
    (path,) = export(tiny_models["sd1"], shapes_data, tmp_path / "my-lora", "sd1", "lora",
                     **{"lora.file_layout": layout, "lora.rank": 4})
    metadata = metadata_of(path)
    assert metadata["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert metadata["modelspec.implementation"] == "diffusers"
    assert metadata["modelspec.title"] == "my-lora"
    assert metadata["modelspec.resolution"] == "64x64" and metadata["modelspec.prediction_type"] == "epsilon"
    assert metadata["modelspec.date"] == "2025-11-26T17:22:51Z"
    if layout == "kohya":  # kohya's keys stay as they were
        assert metadata["ss_network_dim"] == "4" and metadata["ss_base_model_version"] == "sd_v1"
    else:  # diffusers' adapter metadata too
        assert "lora_adapter_metadata" in metadata
    assert_follows_the_spec({k: v for k, v in metadata.items() if k.startswith("modelspec.")})


def test_a_v_prediction_sd2_single_file_is_the_768_v_architecture(tiny_models, shapes_data, tmp_path):
    (path,) = export(tiny_models["sd2"], shapes_data, tmp_path / "o", "sd2", "full")
    metadata = metadata_of(path)
    assert (metadata["modelspec.architecture"], metadata["modelspec.prediction_type"]) == \
        ("stable-diffusion-v2-768-v", "v")
    assert metadata["modelspec.implementation"] == STABILITY and metadata["ot_dist.family"] == "sd2"
    with safe_open(str(path), framework="pt") as f:
        assert "v_pred" in f.keys()  # ComfyUI's marker stays
    (path,) = export(tiny_models["sd2"], shapes_data, tmp_path / "e", "sd2", "full",
                     **{"model.prediction_type": "epsilon"})
    assert metadata_of(path)["modelspec.architecture"] == "stable-diffusion-v2-512"


def test_an_sdxl_embedding_is_a_textual_inversion_of_sdxl(tiny_models, shapes_data, tmp_path):
    (path,) = export(tiny_models["sdxl"], shapes_data, tmp_path / "o", "sdxl", "embedding",
                     **{"embedding.token": "sks"})
    metadata = metadata_of(path)
    assert metadata["token"] == "sks"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/textual-inversion"
    assert metadata["modelspec.implementation"] == STABILITY
    assert_follows_the_spec({k: v for k, v in metadata.items() if k.startswith("modelspec.")})


def test_flux_files_name_dev_or_schnell_and_no_prediction_type(family_models, shapes_data, tmp_path):
    (path,) = export(family_models["flux"], shapes_data, tmp_path / "o", "flux", "lora",
                     **{"text_encoder_2.train": True})  # with the T5 part: the peft layout written by ot_dist
    metadata = metadata_of(path)
    assert metadata["modelspec.architecture"] == "flux-1-dev/lora"
    assert metadata["modelspec.implementation"] == "diffusers" and "modelspec.prediction_type" not in metadata
    (path,) = export(family_models["flux"], shapes_data, tmp_path / "s", "flux", "full")
    assert metadata_of(path)["modelspec.architecture"] == "flux-1-dev"
    assert metadata_of(path)["modelspec.implementation"] == BFL


def test_an_sd35_lora_is_told_apart_by_its_transformer_config(shapes_data, tmp_path):
    from ot_dist.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "sd35", "sd3", variant="sd35")  # qk RMS norms and a dual-attention layer
    (path,) = export(model, shapes_data, tmp_path / "o", "sd3", "lora")
    assert metadata_of(path)["modelspec.architecture"] == "stable-diffusion-v3.5-medium/lora"


def test_lora_tools_write_the_header_of_their_file(tmp_path):
    """`lora merge` into a single file: a checkpoint of the base's architecture, titled after the file, merged from
    the base and the LoRA's title; `lora extract`: a LoRA of the tuned model's architecture. The base predicts v on
    a zero-terminal-SNR schedule: SwarmUI's `v-zsnr` (with "v" it samples on the ordinary schedule)."""
    import json

    from safetensors.torch import save_file

    from ot_dist.lora_tools.extract import extract_command
    from ot_dist.lora_tools.merge import merge_command
    from ot_dist.models.tiny import make_tiny_model

    base = make_tiny_model(tmp_path / "vz", "sd1", prediction_type="v_prediction")
    scheduler_file = base / "scheduler" / "scheduler_config.json"
    scheduler_file.write_text(json.dumps({**json.loads(scheduler_file.read_text()), "rescale_betas_zero_snr": True}))
    path = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    width = load_model(ModelConfig(family="sd1", path=str(base))).denoiser.get_submodule(path).weight
    name = "lora_unet_" + path.replace(".", "_")
    save_file({f"{name}.lora_down.weight": torch.full((2, width.shape[1]), 0.1),
               f"{name}.lora_up.weight": torch.full((width.shape[0], 2), 0.1), f"{name}.alpha": torch.tensor(2.0)},
              str(tmp_path / "style.safetensors"), metadata={"modelspec.title": "My Style"})
    quiet = lambda *_: None  # noqa: E731
    merged = merge_command(str(base), "sd1", [str(tmp_path / "style.safetensors")], [1.0],
                           str(tmp_path / "merged.safetensors"), "single-file", None, "float32", log=quiet)
    metadata = metadata_of(merged)
    assert metadata["modelspec.architecture"] == "stable-diffusion-v1"
    assert metadata["modelspec.title"] == "merged" and metadata["modelspec.merged_from"] == f"{base.name}, My Style"
    assert metadata["modelspec.resolution"] == "512x512"  # SD 1.x's own side: a merge trained nothing
    assert metadata["modelspec.prediction_type"] == "v-zsnr"
    assert_follows_the_spec({k: v for k, v in metadata.items() if k.startswith("modelspec.")})
    tuned = merge_command(str(base), "sd1", [str(tmp_path / "style.safetensors")], [1.0], str(tmp_path / "tuned"),
                          "diffusers", None, "float32", log=quiet)
    extract_command(str(base), str(tuned), "sd1", 2, str(tmp_path / "x.safetensors"), 0.0, "float32", log=quiet)
    metadata = metadata_of(tmp_path / "x.safetensors")
    assert metadata["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert metadata["modelspec.title"] == "x" and metadata["ss_network_dim"] == "2"
    assert metadata["modelspec.prediction_type"] == "v-zsnr"
