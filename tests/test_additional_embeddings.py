"""additional_embeddings (pivotal tuning): new token vectors trained together with a LoRA or a full finetune, on the
tiny SD 1.x model (SDXL's file keys from a prepared model, no training). What is checked:
- training moves the vectors and the LoRA and nothing else (base weights, a frozen embedding);
- the separate file loads through diffusers' load_textual_inversion and encodes as the trained encoder does;
- the bundled keys follow A1111 / Forge's rule for `bundle_emb` (written down below from its source), and ComfyUI's
  LoRA loader (tests/test_lora_layouts.py's oracle) loads every other key, leaving exactly the bundled ones;
- a full finetune exports the model with its own vocabulary and tokenizer, the vectors beside it;
- the config's refusals name the entry.
The 2-rank runs are tests/test_strategies.py's fsdp lora case and tests/test_family_strategies.py's SD 1.x LoRA cases
(ddp, fsdp, zero1/2/3; zero3's with an EMA and a sample), which carry an additional embedding; the prior of
prior_prediction concepts keeping the vectors is tests/test_concepts.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.train.trainer import Trainer

QUIET = lambda *_: None  # noqa: E731
SAMPLE = {"prompt": "a photo of <tok> with <old>", "seed": 1, "steps": 2, "width": 64, "height": 64}


def pivotal_config(model, data, out, method="lora", **extra):
    raw = base_config(model, None, out, method=method, **{"batch_size": 4, "max_steps": 3, "learning_rate": 5e-2,
                                                          **extra})
    # the token in every caption (a concept's caption_prefix); "<tok>" trains, "<old>" is used frozen
    raw["data"] = {"concepts": [{"path": str(data), "caption_prefix": "<tok> with <old>"}], "shards": f"{out}-shards"}
    return raw


@pytest.fixture(scope="module")
def frozen_file(tmp_path_factory):
    from ot_dist.models.tiny import TEXT_HIDDEN

    path = tmp_path_factory.mktemp("emb") / "old.safetensors"
    torch.manual_seed(3)
    from safetensors.torch import save_file

    save_file({"emp_params": torch.randn(1, TEXT_HIDDEN)}, path)  # OneTrainer's SD layout
    return path


@pytest.fixture(scope="module")
def lora_run(tiny_models, shapes_data, frozen_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("pivotal") / "out"
    raw = pivotal_config(tiny_models["sd1"], shapes_data, out, **{
        "lora.rank": 4, "bundle_additional_embeddings": True, "sampling.prompts": [SAMPLE],
        "additional_embeddings": [{"token": "<tok>", "vectors": 2, "init_text": "a cat", "stop_training_after": 2,
                                   "stop_training_after_unit": "step"},
                                  {"token": "<old>", "init_from": str(frozen_file), "train": False}]})
    lines = []
    trainer = Trainer(validate(raw), log=lines.append)
    trainer.log_lines = lines
    unet_before = {k: v.clone() for k, v in trainer.model.denoiser.state_dict().items()}
    text_before = {k: v.clone() for k, v in trainer.model.text_encoders["text_encoder"].state_dict().items()}
    result = trainer.train()
    return trainer, result, out, unet_before, text_before


def test_the_vectors_and_the_lora_train_and_nothing_else(lora_run, frozen_file):
    trainer, result, out, unet_before, text_before = lora_run
    assert [g.name for g in trainer.groups] == ["unet", "embedding/<tok>"]
    assert trainer.method.caption("a red circle, <TOK> with <old>") == "a red circle, <tok> <tok>_1 with <old>"
    unet = trainer.model.denoiser.state_dict()
    moved = {k for k in unet if not torch.equal(unet[k], unet_before[k])}
    assert moved and all("lora_" in k for k in moved), sorted(moved)[:5]
    text = trainer.model.text_encoders["text_encoder"].state_dict()
    moved = {k for k in text if not torch.equal(text[k], text_before[k])}
    assert moved == {"embeddings.token_embedding.additional.0"}  # transformers 5: no text_model.
    files = {p.name for p in result.exported}
    assert files == {"lora.safetensors", "tok.safetensors", "old.safetensors"}
    assert "embedding/<tok>: stopped training after 2 steps" in trainer.log_lines
    assert not trainer.groups[1].params[0].requires_grad
    assert torch.equal(load_file(out / "embeddings" / "old.safetensors")["<old>"],
                       load_file(frozen_file)["emp_params"])  # used, not trained


def test_ot_dist_export_of_the_checkpoint_writes_the_same_files(lora_run, tmp_path):
    from ot_dist.checkpoint.export_command import export_checkpoint

    _, result, out, _, _ = lora_run
    exported = export_checkpoint(str(result.checkpoint), None, False, str(tmp_path), log=QUIET)
    assert {p.relative_to(tmp_path) for p in exported} == {p.relative_to(out) for p in result.exported}
    for path in exported:
        assert load_file(path).keys() == load_file(out / path.relative_to(tmp_path)).keys()
        for key, value in load_file(path).items():
            assert torch.equal(value, load_file(out / path.relative_to(tmp_path))[key]), (path.name, key)


def test_the_embedding_file_loads_in_diffusers(lora_run, tiny_models):
    trainer, _, out, _, _ = lora_run
    pipe = DiffusionPipeline.from_pretrained(tiny_models["sd1"])
    pipe.load_textual_inversion(out / "embeddings" / "tok.safetensors")  # the file names its token
    prompt = "a photo of <tok> on a white background"
    expanded = pipe.maybe_convert_prompt(prompt, pipe.tokenizer)
    assert expanded == trainer.method.caption(prompt)  # diffusers expands the words as training did
    ids = lambda t: t(expanded, padding="max_length", max_length=77, return_tensors="pt").input_ids  # noqa: E731
    mine, theirs = ids(trainer.model.tokenizers["tokenizer"]), ids(pipe.tokenizer)
    assert torch.equal(mine, theirs)
    with torch.no_grad():
        got = pipe.text_encoder(theirs).last_hidden_state
        want = trainer.model.text_encoders["text_encoder"](mine).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_samples_use_the_embeddings_and_diffusers_refuses_the_bundled_file(lora_run, tiny_models, tmp_path):
    """The sample at the end is what diffusers draws with the LoRA and both embedding files loaded. diffusers'
    load_lora_weights refuses the kohya file with bundle_emb keys (why bundling is off by default): loaded here
    from a copy without them."""
    from safetensors.torch import save_file
    from test_sampling import assert_same_image, diffusers_pipeline, draw, pixels

    _, result, out, _, _ = lora_run
    (sample,) = (out / "samples" / f"step-{result.steps}").glob("*.png")
    pipe = diffusers_pipeline(tiny_models["sd1"])
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights(out, weight_name="lora.safetensors")
    plain = {k: v for k, v in load_file(out / "lora.safetensors").items() if not k.startswith("bundle_emb.")}
    save_file(plain, tmp_path / "plain.safetensors")
    pipe = diffusers_pipeline(tiny_models["sd1"])
    pipe.load_lora_weights(tmp_path, weight_name="plain.safetensors")
    pipe.unet.eval()
    for name in ("tok", "old"):
        pipe.load_textual_inversion(out / "embeddings" / f"{name}.safetensors")
    assert_same_image(pixels(sample), draw(pipe, SAMPLE))


def test_the_samples_read_the_trained_vectors(lora_run):
    """The sample taken at the end of training, drawn again by the run's sampler, and with each of <tok>'s two trained
    vectors zeroed in turn: each changes the image, so the samples read the trained rows, both of them (the prompt's
    <tok> expanded to its two words)."""
    from test_sampling import pixels

    trainer, result, out, _, _ = lora_run
    (taken,) = (out / "samples" / f"step-{result.steps}").glob("*.png")

    def drawn(step: int) -> np.ndarray:
        (path,) = trainer.sampler.sample(trainer, step)
        return pixels(path)

    assert np.array_equal(drawn(1000), pixels(taken))
    vectors = trainer.groups[1].params[0]
    trained = vectors.detach().clone()
    try:
        for row in range(2):
            with torch.no_grad():
                vectors.copy_(trained)
                vectors[row] = 0
            assert not np.array_equal(drawn(1001 + row), pixels(taken)), f"vector {row} zeroed drew the same image"
    finally:
        with torch.no_grad():
            vectors.copy_(trained)


def test_a_trained_token_in_no_caption_is_refused(shapes_data, tiny_models, frozen_file, tmp_path):
    """A trained token that no training caption holds would leave the run untrained: refused before the model loads,
    naming the entry. A used one (train: false) may be in no caption: sample prompts may be its only use. The captions
    are read only until every token is found."""
    from ot_dist.methods.additional_embeddings import check_tokens_in_captions

    raw = pivotal_config(tiny_models["sd1"], shapes_data, tmp_path / "o", **{"additional_embeddings": [
        {"token": "<tok>"}, {"token": "<none>"}, {"token": "<unused>", "init_from": str(frozen_file), "train": False}]})
    with pytest.raises(ConfigError, match=r"additional_embeddings\[1\].token: '<none>' is in no caption"):
        Trainer(validate(raw), log=QUIET)
    entries = validate(raw).additional_embeddings[:1]

    def captions():
        yield "a photo of <TOK>"  # in any case, as captions expand it
        raise AssertionError("read past the caption that held every token")

    check_tokens_in_captions(entries, captions())


# ---- A1111 / Forge's bundled embeddings -----------------------------------------------------------------------
# Read from lllyasviel/stable-diffusion-webui-forge (A1111's code before Forge's 2024 rework):
#   extensions-builtin/Lora/networks.py @ 9f1eb409^ load_network: key.partition(".") == "bundle_emb" ->
#     emb_name, vec_name = rest.split(".", 1); vec_name "string_to_param.<k>" -> data["string_to_param"] = {k: t},
#     else data[vec_name] = t; each name becomes an embedding (textual_inversion.create_embedding_from_data)
#   modules/textual_inversion/textual_inversion.py create_embedding_from_data: string_to_param with one tensor, or
#     clip_g + clip_l (SDXL), or one tensor of any name; else "Couldn't identify".
def forge_bundled_embeddings(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | dict]:
    bundles = {}
    for key, value in tensors.items():
        first, _, rest = key.partition(".")
        if first != "bundle_emb":
            continue
        name, vec_name = rest.split(".", 1)
        data = bundles.setdefault(name, {})
        if vec_name.split(".")[0] == "string_to_param":
            data["string_to_param"] = {vec_name.split(".", 1)[1]: value}
        else:
            data[vec_name] = value
    embeddings = {}
    for name, data in bundles.items():
        if "string_to_param" in data:
            (vectors,) = data["string_to_param"].values()
        elif "clip_g" in data and "clip_l" in data:
            vectors = {k: data[k] for k in ("clip_l", "clip_g")}
        elif len(data) == 1:
            vectors = next(iter(data.values()))
        else:
            raise AssertionError(f"Forge could not identify {name}: {sorted(data)}")
        embeddings[name] = vectors
    return embeddings


def test_the_bundled_embeddings_follow_forge_and_comfyui_loads_the_rest(lora_run, tiny_models):
    from test_lora_layouts import comfy_key_map, comfy_load

    trainer, _, out, _, _ = lora_run
    tensors = load_file(out / "lora.safetensors")
    bundled = forge_bundled_embeddings(tensors)
    assert set(bundled) == {"<tok>", "<old>"}
    for token in bundled:
        stem = token.strip("<>")
        torch.testing.assert_close(bundled[token], load_file(out / "embeddings" / f"{stem}.safetensors")[token])
    assert bundled["<tok>"].shape[0] == 2
    key_map = comfy_key_map("sd1", trainer.model.denoiser)
    patches, left = comfy_load(tensors, key_map)
    assert patches and left == {k for k in tensors if k.startswith("bundle_emb.")}  # ComfyUI: "lora key not loaded"


def test_sdxl_bundles_clip_l_and_clip_g(tiny_models, shapes_data, tmp_path):
    from ot_dist.methods.registry import build_method
    from ot_dist.models.loading import load_model

    raw = pivotal_config(tiny_models["sdxl"], shapes_data, tmp_path / "o", family="sdxl",
                         **{"bundle_additional_embeddings": True, "additional_embeddings": [{"token": "<x>"}]})
    raw["model"]["family"] = "sdxl"
    config = validate(raw)
    method, model = build_method(config), load_model(config.model)
    method.prepare(model)
    method.export(model, tmp_path)
    bundled = forge_bundled_embeddings(load_file(tmp_path / "lora.safetensors"))
    own = load_file(tmp_path / "embeddings" / "x.safetensors")
    assert set(bundled["<x>"]) == set(own) == {"clip_l", "clip_g"}
    for key in own:
        assert torch.equal(bundled["<x>"][key], own[key])


def test_a_full_finetune_exports_the_model_as_loaded_and_the_vectors_beside_it(tiny_models, shapes_data, tmp_path):
    out = tmp_path / "out"
    raw = pivotal_config(tiny_models["sd1"], shapes_data, out, method="full", max_steps=2, learning_rate=1e-3,
                         **{"text_encoder.train": True, "additional_embeddings": [{"token": "<tok>"}]})
    raw["data"]["concepts"][0]["caption_prefix"] = "<tok>"
    trainer = Trainer(validate(raw), log=QUIET)
    start = trainer.model.text_encoders["text_encoder"].get_input_embeddings().additional[0].detach().clone()
    result = trainer.train()
    assert {p.name for p in result.exported} == {"model", "model.safetensors", "tok.safetensors"}
    assert [g.name for g in trainer.groups] == ["unet", "text_encoder", "embedding/<tok>"]
    loaded = DiffusionPipeline.from_pretrained(out / "model")
    base = DiffusionPipeline.from_pretrained(tiny_models["sd1"])
    assert len(loaded.tokenizer) == len(base.tokenizer)  # the exported tokenizer knows no new token
    encoder = trainer.model.text_encoders["text_encoder"]
    assert torch.equal(loaded.text_encoder.get_input_embeddings().weight, encoder.get_input_embeddings().base.weight)
    vectors = load_file(out / "embeddings" / "tok.safetensors")["<tok>"]
    assert torch.equal(vectors, encoder.get_input_embeddings().additional[0].detach())
    assert not torch.allclose(vectors, start, atol=1e-4), "the vectors did not train"


def test_the_schedule_shows_a_stopped_embedding_at_lr_0(tmp_path):
    from ot_dist.optim.preview import compute_schedule
    from ot_dist.train.steps import StepPlan

    raw = base_config("m", tmp_path, tmp_path / "o", method="lora", learning_rate=1e-4, **{
        "embedding.learning_rate": 5e-3,
        "additional_embeddings": [{"token": "<a>", "stop_training_after": 2, "stop_training_after_unit": "step"},
                                  {"token": "<b>", "learning_rate": 1e-3}]})
    plan = StepPlan(global_batch=1, steps_per_epoch=4, total_steps=4, dataset_size=4)
    schedule = compute_schedule(validate(raw), plan)
    assert schedule.groups == ["unet", "embedding/<a>", "embedding/<b>"]
    assert [row[1:] for row in schedule.rows] == [[5e-3, 1e-3], [5e-3, 1e-3], [0.0, 1e-3], [0.0, 1e-3]]


def test_refusals(tiny_models, tmp_path):
    def check(match, method="lora", family="sd1", **extra):
        raw = base_config(tiny_models.get(family, tmp_path), tmp_path, tmp_path / "o", family=family, method=method,
                          **extra)
        with pytest.raises(ConfigError, match=match):
            validate(raw)

    two = [{"token": "<a>"}, {"token": "<A>"}]
    check(r"additional_embeddings\[1\].token: '<A>' and additional_embeddings\[0\].token '<a>' overlap",
          additional_embeddings=two)
    check(r"additional_embeddings\[0\].token: 'sks' and embedding.token 'sks' overlap", method="embedding",
          **{"embedding.token": "sks", "additional_embeddings": [{"token": "sks"}]})
    check("additional_embeddings: model family wan has no text encoder that takes embeddings",
          family="wan", additional_embeddings=[{"token": "<a>"}])
    check("data.cache_text: the additional embeddings", additional_embeddings=[{"token": "<a>"}],
          **{"data.cache_text": True})
    check("bundle_additional_embeddings: bundles them into the LoRA file; method full", method="full",
          additional_embeddings=[{"token": "<a>"}], bundle_additional_embeddings=True)
    check(r"has a '\.'", additional_embeddings=[{"token": "a.b"}])
    check("must be lower case", additional_embeddings=[{"token": "<A>", "vectors": 2}])
    check("train false keeps the vectors", additional_embeddings=[{"token": "<a>", "train": False}])
    check(r"additional_embeddings\[0\].stop_training_after: not supported with strategy fsdp", strategy="fsdp",
          additional_embeddings=[{"token": "<a>", "stop_training_after": 1}])


def test_beside_method_embedding_each_token_has_its_own_rows_and_file(tiny_models, shapes_data, tmp_path):
    from ot_dist.methods.registry import build_method
    from ot_dist.models.loading import load_model

    raw = pivotal_config(tiny_models["sd1"], shapes_data, tmp_path / "o", method="embedding",
                         **{"embedding.token": "<main>", "additional_embeddings": [{"token": "<tok>", "vectors": 2}]})
    config = validate(raw)
    method, model = build_method(config), load_model(config.model)
    groups = method.prepare(model)
    assert [g.name for g in groups] == ["embedding", "embedding/<tok>"]
    assert method.caption("a <tok> cat") == "<main> a <tok> <tok>_1 cat"
    with torch.no_grad():
        groups[1].params[0].fill_(0.5)
    paths = method.export(model, tmp_path)
    assert [p.name for p in paths] == ["embedding.safetensors", "tok.safetensors"]
    assert torch.equal(load_file(paths[1])["<tok>"], torch.full_like(groups[1].params[0], 0.5))
    assert not torch.equal(load_file(paths[0])["<main>"][0], load_file(paths[1])["<tok>"][0])
    ids = model.tokenizers["tokenizer"]("<main> <tok> <tok>_1", add_special_tokens=False).input_ids
    size = model.text_encoders["text_encoder"].get_input_embeddings().base.num_embeddings
    assert ids == [size, size + 1, size + 2]  # the rows follow in the order the tokens were added
