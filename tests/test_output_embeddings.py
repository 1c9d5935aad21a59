"""Output embeddings (OneTrainer's is_output_embedding, ot_dist/methods/output_vectors.py): the trained vectors
replace the text encoder's hidden states at their tokens. On the tiny SD 1.x model (one run of method embedding with an
additional output embedding beside it); SDXL, Stable Cascade and Würstchen v2 without training (start, conditioning,
file keys); Flux, SD3 and Sana: tests/test_output_embeddings_flow_families.py. What is checked:
- the conditioning is the base encoder's output (its vocabulary extended by zero rows, OneTrainer's input vectors of
  an output embedding) with the trained vectors written at the tokens' positions, computed here by hand;
- training moves those vectors and nothing else (the zero input rows stay zero);
- the files hold OneTrainer's keys and shapes, and OneTrainer's loader rule (written down below) reads the vectors;
- the vectors start as OneTrainer starts them, and init_from continues from exactly a file's vectors;
- the samples are drawn with the vectors (diffusers with the hand-computed conditioning draws the same image);
- stopped and resumed, the run is the uninterrupted one; the config's refusals name the field.
2 ranks == 1 process: tests/test_strategies.py's fsdp case of method embedding with an output embedding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file, save_file

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.methods.registry import build_method
from ot_dist.models.loading import load_model
from ot_dist.train.trainer import Trainer

QUIET = lambda *_: None  # noqa: E731
SAMPLE = {"prompt": "a photo of <tok> with <add>", "seed": 1, "steps": 2, "width": 64, "height": 64}


def output_config(model, data, out, family="sd1", **extra):
    raw = base_config(model, None, out, family=family, method="embedding", **{
        "batch_size": 4, "max_steps": 3, "learning_rate": 5e-2,
        "embedding": {"token": "<tok>", "vectors": 2, "init_text": "a cat", "output_embedding": True},
        "additional_embeddings": [{"token": "<add>", "output_embedding": True}], **extra})
    # method embedding prepends <tok> where a caption lacks it; the additional token is written into every caption
    raw["data"] = {"concepts": [{"path": str(data), "caption_prefix": "<add>"}], "shards": f"{out}-shards"}
    return raw


def onetrainer_reads(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """OneTrainer's loader rule (modules/modelSetup/BaseStableDiffusionSetup.py and BaseStableDiffusionXLSetup.py
    `_setup_embeddings`: `embedding_state.get("<key>_out", embedding_state.get("<key>", None))`): the vectors of an
    encoder are `<key>_out` if the file has it, else `<key>`; with is_output_embedding they become the embedding's
    output_vector and its token_count is their first dimension (BaseModelEmbedding)."""
    return state.get(f"{key}_out", state.get(key, None))


def extended_base_encoder(model_path, encoder_name: str, rows: int):
    """The model's own encoder from disk, its vocabulary extended by `rows` zero rows: OneTrainer's input vectors of
    an output embedding's tokens."""
    import json
    from pathlib import Path

    import transformers

    library, class_name = json.loads((Path(model_path) / "model_index.json").read_text())[encoder_name]
    assert library == "transformers"
    encoder = getattr(transformers, class_name).from_pretrained(Path(model_path) / encoder_name)
    table = encoder.get_input_embeddings()
    weight = torch.cat([table.weight.detach(), torch.zeros(rows, table.embedding_dim)])
    encoder.set_input_embeddings(torch.nn.Embedding.from_pretrained(weight))
    return encoder.eval()


def by_hand(hidden: torch.Tensor, ids: torch.Tensor, first_id: int, vectors: torch.Tensor) -> torch.Tensor:
    """`hidden` with row [b, s] = vectors[ids[b, s] - first_id] wherever ids[b, s] is one of the vectors' tokens."""
    out = hidden.clone()
    for b, s in zip(*torch.nonzero((ids >= first_id) & (ids < first_id + len(vectors)), as_tuple=True)):
        out[b, s] = vectors[ids[b, s] - first_id]
    return out


@pytest.fixture(scope="module")
def run(tiny_models, shapes_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("output") / "out"
    trainer = Trainer(validate(output_config(tiny_models["sd1"], shapes_data, out, **{"sampling.prompts": [SAMPLE]})),
                      log=QUIET)
    unet_before = {k: v.clone() for k, v in trainer.model.denoiser.state_dict().items()}
    text_before = {k: v.clone() for k, v in trainer.model.text_encoders["text_encoder"].state_dict().items()}
    result = trainer.train()
    return trainer, result, out, unet_before, text_before


def test_training_moves_the_output_vectors_and_nothing_else(run):
    trainer, result, out, unet_before, text_before = run
    assert [g.name for g in trainer.groups] == ["embedding", "embedding/<add>"]
    unet = trainer.model.denoiser.state_dict()
    assert all(torch.equal(unet[k], unet_before[k]) for k in unet)
    text = trainer.model.text_encoders["text_encoder"].state_dict()
    moved = {k for k in text if not torch.equal(text[k], text_before[k])}
    assert moved == {"embeddings.token_embedding.outputs.extra", "embeddings.token_embedding.outputs.additional.0"}
    for rows in ("extra", "additional.0"):  # the input rows of the tokens: zeros, as OneTrainer's
        assert not text[f"embeddings.token_embedding.{rows}"].any()
    assert {p.name for p in result.exported} == {"embedding.safetensors", "add.safetensors"}


def test_the_files_are_onetrainers_and_its_loader_reads_the_vectors(run):
    trainer, _, out, _, _ = run
    encoder = trainer.model.text_encoders["text_encoder"].get_input_embeddings()
    for path, vectors in ((out / "embedding.safetensors", encoder.outputs.extra),
                          (out / "embeddings" / "add.safetensors", encoder.outputs.additional["0"])):
        state = load_file(path)
        # OneTrainer's StableDiffusionEmbeddingSaver: emp_params (the zero input vectors), emp_params_out
        assert state.keys() == {"emp_params", "emp_params_out"}, path.name
        assert state["emp_params"].shape == state["emp_params_out"].shape == vectors.shape
        assert not state["emp_params"].any()
        assert torch.equal(onetrainer_reads(state, "emp_params"), vectors.detach())
    assert vectors.shape[0] == 1 and encoder.outputs.extra.shape[0] == 2


def test_ot_dist_export_of_the_checkpoint_writes_the_same_files(run, tmp_path):
    from ot_dist.checkpoint.export_command import export_checkpoint

    _, result, out, _, _ = run
    exported = export_checkpoint(str(result.checkpoint), None, False, str(tmp_path), log=QUIET)
    assert {p.relative_to(tmp_path) for p in exported} == {p.relative_to(out) for p in result.exported}
    for path in exported:
        want, got = load_file(out / path.relative_to(tmp_path)), load_file(path)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), path.name


def test_the_conditioning_is_the_encoder_output_with_the_vectors_in_place(run, tiny_models):
    """Both embeddings in one caption, in a batch of two captions (one without them): the conditioning the family
    computes equals the base encoder's last hidden state (zero rows for the new tokens) with the trained vectors
    written by hand at the tokens' positions; and it differs from that encoder's output without them."""
    trainer, _, out, _, _ = run
    model = trainer.model
    captions = [trainer.method.caption("a red circle, <add> and <tok>"), "a blue square"]
    tokens = model.family.tokenize(model.tokenizers, captions)
    ids = tokens["text_encoder"]
    size = model.text_encoders["text_encoder"].get_input_embeddings().base.num_embeddings
    assert {size, size + 1, size + 2} <= set(ids[0].tolist())  # <tok>, <tok>_1, <add>
    with torch.no_grad():
        got = model.family.encode_text(model.text_encoders, tokens)["hidden"]
        plain = extended_base_encoder(tiny_models["sd1"], "text_encoder", 3)(ids).last_hidden_state
    main = load_file(out / "embedding.safetensors")["emp_params_out"]
    add = load_file(out / "embeddings" / "add.safetensors")["emp_params_out"]
    want = by_hand(by_hand(plain, ids, size, main), ids, size + 2, add)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_the_samples_are_drawn_with_the_vectors(run, tiny_models):
    """The sample taken at the end is what diffusers draws from the base model with the hand-computed conditioning of
    the prompt (the pipeline expands <tok> to its two words, as training's captions); zeroing the vectors of either
    embedding changes the image."""
    from test_sampling import diffusers_pipeline, draw, pixels

    trainer, result, out, _, _ = run
    (taken,) = (out / "samples" / f"step-{result.steps}").glob("*.png")
    model = trainer.model
    ids = model.family.tokenize(model.tokenizers, [trainer.method.caption(SAMPLE["prompt"])])["text_encoder"]
    size = model.text_encoders["text_encoder"].get_input_embeddings().base.num_embeddings
    with torch.no_grad():
        plain = extended_base_encoder(tiny_models["sd1"], "text_encoder", 3)(ids).last_hidden_state
    main = load_file(out / "embedding.safetensors")["emp_params_out"]
    add = load_file(out / "embeddings" / "add.safetensors")["emp_params_out"]
    pipe = diffusers_pipeline(tiny_models["sd1"])
    hand = by_hand(by_hand(plain, ids, size, main), ids, size + 2, add)
    assert np.array_equal(pixels(taken), draw(pipe, {**SAMPLE, "prompt": None}, prompt_embeds=hand))

    def drawn(step: int) -> np.ndarray:
        (path,) = trainer.sampler.sample(trainer, step)
        return pixels(path)

    for group in trainer.groups:
        vectors = group.params[0]
        trained = vectors.detach().clone()
        try:
            with torch.no_grad():
                vectors.zero_()
            assert not np.array_equal(drawn(1000), pixels(taken)), f"{group.name} zeroed drew the same image"
        finally:
            with torch.no_grad():
                vectors.copy_(trained)


# The layer of each encoder's output that the family's conditioning reads (OneTrainer's encode_text: SD's
# encode_clip(default_layer=-1, add_layer_norm=True), SDXL's (-2, no norm), Stable Cascade's hidden_states[-1],
# Würstchen v2's final_layer_norm(hidden_states[-1])), written out here rather than taken from the family.
READ_LAYER = {"sd1": lambda out: out.last_hidden_state, "sdxl": lambda out: out.hidden_states[-2],
              "stable_cascade": lambda out: out.hidden_states[-1], "wuerstchen_v2": lambda out: out.last_hidden_state}


@pytest.mark.parametrize("family", list(READ_LAYER))
def test_the_vectors_start_as_onetrainers_and_continue_from_a_file(tiny_models, family_models, tmp_path, family):
    """OneTrainer's start (ModelSetupEmbeddingMixin._create_new_embedding with the family's encode_text): the hidden
    states the model reads of init_text followed by one "*" per vector, at the positions after the start token. With
    the vectors moved, the conditioning of every family is the base encoders' read layer with the vectors written in
    by hand. The exported file (SDXL: clip_l / clip_g and their _out; Stable Cascade / Würstchen v2: clip_g) continues
    from exactly its vectors; an input embedding's file (no _out keys) gives its vectors as the output vectors, as
    OneTrainer's loader does."""
    path = tiny_models[family] if family in tiny_models else family_models[family]
    raw = base_config(path, tmp_path, tmp_path / "o", family=family, method="embedding",
                      resolution=64 if family in tiny_models else 128,  # the cascades' bucket step: 128
                      **{"embedding": {"token": "<tok>", "vectors": 3, "init_text": "a cat", "output_embedding": True}})
    method, model = build_method(validate(raw)), load_model(validate(raw).model)
    (group,) = method.prepare(model)
    keys = model.family.output_embedding_keys
    tokenizer_of = dict(zip(model.family.text_encoders, model.family.tokenizers))
    for name, vectors in zip(keys, group.params, strict=True):
        tokenizer = model.tokenizers[tokenizer_of[name]]
        ids = tokenizer(["a cat***"], padding="max_length", max_length=tokenizer.model_max_length,
                        return_tensors="pt").input_ids
        with torch.no_grad():
            out = extended_base_encoder(path, name, 0)(ids, output_hidden_states=True)
        torch.testing.assert_close(vectors.detach(), READ_LAYER[family](out)[0, 1:4], rtol=0, atol=0)
    with torch.no_grad():
        for p in group.params:
            p.add_(torch.randn_like(p))  # "trained"

    tokens = model.family.tokenize(model.tokenizers, [method.caption("a <tok> on grass"), "a cat"])
    with torch.no_grad():
        got = model.family.encode_text(model.text_encoders, tokens)["hidden"]
        want = []
        for name, vectors in zip(keys, group.params, strict=True):
            ids, mask = tokens[name], tokens.get(f"{name}_mask")
            size = model.text_encoders[name].get_input_embeddings().base.num_embeddings
            out = extended_base_encoder(path, name, 3)(ids, attention_mask=mask, output_hidden_states=True)
            want.append(by_hand(READ_LAYER[family](out), ids, size, vectors))
    torch.testing.assert_close(got, torch.cat(want, dim=-1), rtol=0, atol=0)

    (file,) = method.export(model, tmp_path, suffix="_saved")
    state = load_file(file)
    assert state.keys() == {k + s for k in keys.values() for s in ("", "_out")}
    for base_key, vectors in zip(keys.values(), group.params, strict=True):
        assert torch.equal(onetrainer_reads(state, base_key), vectors.detach())
        assert not state[base_key].any() and state[base_key].shape == vectors.shape

    raw["embedding"]["init_from"] = str(file)
    method, model = build_method(validate(raw)), load_model(validate(raw).model)
    (again,) = method.prepare(model)
    assert all(torch.equal(a, b) for a, b in zip(again.params, group.params, strict=True))
    plain = tmp_path / "input.safetensors"
    save_file({k: state[k + "_out"] * 2 for k in keys.values()}, plain)  # an input embedding's layout
    raw["embedding"]["init_from"] = str(plain)
    method, model = build_method(validate(raw)), load_model(validate(raw).model)
    (input_file,) = method.prepare(model)
    assert all(torch.equal(a, b * 2) for a, b in zip(input_file.params, group.params, strict=True))


def test_stopped_and_resumed_the_run_is_the_uninterrupted_one(tiny_models, shapes_data, tmp_path):
    from test_checkpoint import assert_resumes_as_straight

    def raw(out):
        return output_config(tiny_models["sd1"], shapes_data, out, batch_size=2, max_steps=5)

    assert_resumes_as_straight(raw, tmp_path, ("embedding.safetensors", "embeddings/add.safetensors"))


def test_refusals(tiny_models, tmp_path):
    def check(match, family="sd1", method="embedding", **extra):
        raw = base_config(tiny_models.get(family, tmp_path), tmp_path, tmp_path / "o", family=family, method=method,
                          **extra)
        with pytest.raises(ConfigError, match=match):
            validate(raw)

    check("embedding.output_embedding: model family lumina2 takes no output embeddings", family="lumina2",
          **{"embedding.output_embedding": True})
    check(r"additional_embeddings\[0\].output_embedding: model family hidream takes no output embeddings",
          family="hidream", method="lora", additional_embeddings=[{"token": "<a>", "output_embedding": True}])
    check("embedding.output_embedding: with model.text_encoder_layer_skip", **{
        "embedding.output_embedding": True, "model.text_encoder_layer_skip": 1})
    check("embedding.output_embedding: with model.text_encoder_layer_skip", family="sana", **{
        "embedding.output_embedding": True, "model.text_encoder_layer_skip": 1})
    check(r"bundle_additional_embeddings: additional_embeddings\[0\] is an output embedding", method="lora",
          bundle_additional_embeddings=True, additional_embeddings=[{"token": "<a>", "output_embedding": True}])
    # SDXL's layer skip reads a layer the encoder returns as is: allowed
    validate(base_config(tiny_models["sdxl"], tmp_path, tmp_path / "o", family="sdxl", method="embedding",
                         **{"embedding.output_embedding": True, "model.text_encoder_layer_skip": 1}))
