"""Output embeddings of Flux.1, SD3 / 3.5 and Sana (OneTrainer's is_output_embedding in its FluxModelEmbedding,
StableDiffusion3ModelEmbedding and SanaModelEmbedding; ot_dist/methods/output_vectors.py). OneTrainer's rule, written
out here from its source rather than taken from ot_dist:
- Flux: the T5 is an output encoder (FluxModel.encode_text applies `_apply_output_embeddings` to its last hidden
  state), the CLIP-L, read for its pooled output only, trains ordinary input vectors in the same embedding
  (FluxModelEmbedding: text_encoder_1_embedding with is_output_embedding=False);
- SD3: all three encoders are output encoders: the CLIPs' penultimate hidden states (encode_clip(default_layer=-2,
  add_layer_norm=False)) and the T5's last; the pooled outputs are the CLIPs' own, computed from zero input rows;
- Sana: the Gemma's last hidden state (encode_gemma(default_layer=-1): after the final norm), read with the mask.
What is checked, on the tiny models without training: the start (OneTrainer's create_output_embedding_fn: the read
states of init_text + one "*" per vector, at positions 1..n), the conditioning of one prompt against the base
encoders with OneTrainer's _apply_output_embeddings written out, the file against OneTrainer's savers
(Flux / StableDiffusion3 / Sana EmbeddingSaver `_to_state_dict`) and loader rule, init_from continuing from it
exactly. With training (Flux, which mixes both kinds of vectors in one embedding, SD3 and Sana, each with an
additional output embedding): only the vectors move, and the samples read them all; Flux stopped and resumed is the
uninterrupted run, bit for bit. 2 ranks: not here (by hand, fsdp and zero2 on Flux and SD3 ended within 4e-7 of one
process)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import base_config
from family_training import family_trainer
from safetensors.torch import load_file, save_file

from ot_dist.config.load import validate
from ot_dist.methods.registry import build_method
from ot_dist.models.loading import load_model

VECTORS = 2
SAMPLE = {"prompt": "a photo of <tok> with <add>", "seed": 1, "steps": 2, "width": 64, "height": 64}

# OneTrainer's savers, per family: the file keys of an output embedding, each with the encoder whose rows it holds and
# what it holds ("zeros": BaseModelEmbedding's input vector of an output embedding; "out": its output_vector; "input":
# the trained input vector of an encoder that is no output encoder). modules/modelSaver/flux/FluxEmbeddingSaver.py:
# clip_l <- text_encoder_1 .vector, t5 <- text_encoder_2 .vector, t5_out <- text_encoder_2 .output_vector;
# modules/modelSaver/stableDiffusion3/StableDiffusion3EmbeddingSaver.py: clip_l / clip_g / t5 <- .vector,
# clip_l_out / clip_g_out / t5_out <- .output_vector.
ONETRAINER_FILE = {
    "flux": {"clip_l": ("text_encoder", "input"), "t5": ("text_encoder_2", "zeros"),
             "t5_out": ("text_encoder_2", "out")},
    "sd3": {"clip_l": ("text_encoder", "zeros"), "clip_g": ("text_encoder_2", "zeros"),
            "t5": ("text_encoder_3", "zeros"), "clip_l_out": ("text_encoder", "out"),
            "clip_g_out": ("text_encoder_2", "out"), "t5_out": ("text_encoder_3", "out")},
    # modules/modelSaver/sana/SanaEmbeddingSaver.py: gemma <- .vector, gemma_out <- .output_vector
    "sana": {"gemma": ("text_encoder", "zeros"), "gemma_out": ("text_encoder", "out")},
}
T5_TABLES = ["shared", "encoder.embed_tokens"]
TOKENIZER = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
# The hidden states OneTrainer's encode_text gives _apply_output_embeddings, per output encoder
READ = {("flux", "text_encoder_2"): lambda out: out.last_hidden_state,
        ("sd3", "text_encoder"): lambda out: out.hidden_states[-2],
        ("sd3", "text_encoder_2"): lambda out: out.hidden_states[-2],
        ("sd3", "text_encoder_3"): lambda out: out.last_hidden_state,
        ("sana", "text_encoder"): lambda out: out.hidden_states[-1]}
# Encoders OneTrainer runs with the tokenizer's attention mask (Sana's encode_gemma; the CLIPs and Flux's / SD3's T5
# run without: encode_clip / encode_t5 with use_attention_mask=False)
MASKED = {("sana", "text_encoder")}


def pooled_outputs(family: str, outputs: dict) -> dict[str, torch.Tensor]:
    """The rest of OneTrainer's encode_text result beside the hidden states: Flux's CLIP-L pooled output, SD3's two
    CLIPs' projected pooled outputs side by side (combine_text_encoder_output)."""
    if family == "flux":
        return {"pooled": outputs["text_encoder"].pooler_output}
    if family == "sd3":
        return {"pooled": torch.cat([outputs["text_encoder"].text_embeds, outputs["text_encoder_2"].text_embeds], -1)}
    return {}


def onetrainer_apply(embedding_ids: torch.Tensor, vectors: torch.Tensor, tokens: torch.Tensor,
                     output: torch.Tensor) -> torch.Tensor:
    """BaseModel._apply_output_embeddings for one embedding, as OneTrainer writes it: `embedding_ids` ([n], its
    tokens' ids, joint_tokens_cache) expanded over the batch, every (batch, vector, position) where the prompt's token
    equals the vector's id found by broadcasting, and that position's output set to the vector."""
    output = output.to(torch.float32).clone()
    embedding_tokens = embedding_ids.unsqueeze(0).expand(output.shape[0], -1)
    idx_0, idx_1, idx_2 = (tokens.unsqueeze(1) == embedding_tokens.unsqueeze(2)).nonzero(as_tuple=True)
    output[idx_0, idx_2] = vectors[idx_1]
    return output


def onetrainer_reads(state: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """OneTrainer's loader rule (BaseFluxSetup / BaseStableDiffusion3Setup / BaseSanaSetup `_setup_embeddings`)."""
    return state.get(f"{key}_out", state.get(key, None))


class RowsAfter(torch.nn.Module):
    """A base token table that reads `rows` for the ids from `first` on (the embedding's tokens)."""

    def __init__(self, table: torch.nn.Embedding, first: int, rows: torch.Tensor):
        super().__init__()
        self.table, self.first, self.rows = table, first, rows
        self.embedding_dim = table.embedding_dim

    def forward(self, ids):
        new = ids >= self.first
        embeds = self.table(ids.clamp(max=self.first - 1)).clone()
        embeds[new] = self.rows[ids[new] - self.first].to(embeds.dtype)
        return embeds


def base_encoder(model_path, name: str, first: int | None = None, rows: torch.Tensor | None = None):
    """The model folder's own encoder (by the class model_index.json names), in eval mode; with `rows`, its table
    reads them at the ids from `first` on."""
    import transformers

    library, class_name = json.loads((model_path / "model_index.json").read_text())[name]
    assert library == "transformers"
    encoder = getattr(transformers, class_name).from_pretrained(model_path / name).eval()
    if rows is not None:
        encoder.set_input_embeddings(RowsAfter(encoder.get_input_embeddings(), first, rows))
    return encoder


def prepared(model_path, family: str, tmp_path, **embedding):
    raw = base_config(model_path, tmp_path, tmp_path / "o", family=family, method="embedding", **{"embedding": {
        "token": "<tok>", "vectors": VECTORS, "init_text": "a cat", "output_embedding": True, **embedding}})
    config = validate(raw)
    method, model = build_method(config), load_model(config.model)
    (group,) = method.prepare(model)
    return method, model, group, raw


def by_encoder(model, group) -> dict[str, torch.Tensor]:
    """The group's trained tensors by encoder: output vectors of the output encoders, input rows of the others."""
    names = [name for name in model.family.text_encoders if name in model.family.embedding_keys]
    return dict(zip(names, (p.detach() for p in group.params), strict=True))


@pytest.mark.parametrize("family", list(ONETRAINER_FILE))
def test_start_conditioning_and_file_are_onetrainers(family, family_models, tmp_path):
    path = family_models[family]
    method, model, group, raw = prepared(path, family, tmp_path)
    trained = by_encoder(model, group)
    outputs = model.family.output_embedding_keys
    prompt = [method.caption("a red circle, <tok> in the center")]
    tokens = model.family.tokenize(model.tokenizers, prompt)

    # the start: OneTrainer's _create_new_embedding with create_output_embedding_fn = encode_text(text)[i][0][1:],
    # cut to the vector count; the prompt "a cat" + "**" read at the length the conditioning reads, padded on the
    # right as the conditioning pads
    for name in outputs:
        tokenizer = model.tokenizers[TOKENIZER[name]]
        encoded = tokenizer(["a cat" + "*" * VECTORS], padding="max_length", max_length=tokens[name].shape[1],
                            truncation=True, padding_side="right", return_tensors="pt")
        mask = {"attention_mask": encoded.attention_mask} if (family, name) in MASKED else {}
        with torch.no_grad():
            out = base_encoder(path, name)(encoded.input_ids, output_hidden_states=True, **mask)
        torch.testing.assert_close(trained[name], READ[family, name](out)[0, 1:1 + VECTORS], rtol=0, atol=0)

    with torch.no_grad():
        for p in group.params:
            p.add_(torch.randn_like(p))  # "trained"
    (file,) = method.export(model, tmp_path)
    state = load_file(file)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        key: (VECTORS, model.text_encoders[name].get_input_embeddings().embedding_dim)
        for key, (name, _) in ONETRAINER_FILE[family].items()}
    for key, (name, holds) in ONETRAINER_FILE[family].items():
        assert torch.equal(state[key], torch.zeros_like(state[key]) if holds == "zeros" else trained[name]), key
    for key in {k.removesuffix("_out") for k in state}:  # what OneTrainer's loader makes of the file
        name = ONETRAINER_FILE[family][key][0]
        assert torch.equal(onetrainer_reads(state, key), trained[name]), key

    # the conditioning of the prompt: each encoder from disk, its table reading zeros (output encoders) or the
    # file's input vectors (Flux's CLIP-L) at the tokens' ids, the read states with the file's _out vectors applied
    with torch.no_grad():
        got = model.family.encode_text(model.text_encoders, tokens)
        read, outs = {}, {}
        for name in model.family.text_encoders:
            tokenizer = model.tokenizers[TOKENIZER[name]]
            embedding_ids = torch.tensor(tokenizer.convert_tokens_to_ids(method.token_strings()))
            assert (tokens[name] == embedding_ids[0]).any(), name
            key = model.family.embedding_keys[name]
            rows = state[key] if name not in outputs else torch.zeros_like(state[key])
            mask = {"attention_mask": tokens[f"{name}_mask"]} if (family, name) in MASKED else {}
            outs[name] = base_encoder(path, name, int(embedding_ids[0]), rows)(tokens[name], output_hidden_states=True,
                                                                              **mask)
            if name in outputs:
                read[name] = onetrainer_apply(embedding_ids, state[key + "_out"], tokens[name],
                                              READ[family, name](outs[name]))
    if family == "sd3":  # StableDiffusion3Model.combine_text_encoder_output
        clip = torch.cat([read["text_encoder"], read["text_encoder_2"]], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, read["text_encoder_3"].shape[-1] - clip.shape[-1]))
        hidden = torch.cat([clip, read["text_encoder_3"]], dim=-2)
    else:  # Flux's T5, Sana's Gemma
        (hidden,) = read.values()
    want = {"hidden": hidden, **pooled_outputs(family, outs)}
    if family == "sana":  # SanaModel.encode_text returns the mask beside the states
        want["mask"] = tokens["text_encoder_mask"]
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)

    # init_from the file continues from exactly its vectors (each encoder's, as OneTrainer's loader reads them); an
    # input embedding's file (its embedding keys only) gives its vectors as the output vectors, as that rule does
    plain = {model.family.embedding_keys[name]: vectors * 2 for name, vectors in trained.items()}
    save_file(plain, tmp_path / "input.safetensors")
    for init_from, want in ((file, trained), (tmp_path / "input.safetensors", dict(zip(trained, plain.values())))):
        raw["embedding"]["init_from"] = str(init_from)
        method, model = build_method(validate(raw)), load_model(validate(raw).model)
        (again,) = method.prepare(model)
        assert all(torch.equal(a.detach(), want[name]) for a, name in zip(again.params, want, strict=True)), init_from


def run_settings(data, out, **extra) -> dict:
    """Method embedding's output embedding of two vectors and an additional one (<add>, in every caption)."""
    return {"batch_size": 2, "learning_rate": 5e-2,
            "embedding": {"token": "<tok>", "vectors": VECTORS, "init_text": "a cat", "output_embedding": True},
            "additional_embeddings": [{"token": "<add>", "output_embedding": True}],
            "data.path": None, "data.concepts": [{"path": str(data), "caption_prefix": "<add>"}], **extra}


@pytest.fixture(scope="module", params=["flux", "sd3", "sana"])
def run(request, family_models, shapes_data, tmp_path_factory):
    """2 steps of run_settings' embeddings, with a sample at the end."""
    family = request.param
    out = tmp_path_factory.mktemp(f"output_{family}") / "out"
    trainer = family_trainer(family, family_models[family], None, out, method="embedding",
                             **run_settings(shapes_data, out, max_steps=2, **{"sampling.prompts": [SAMPLE]}))
    before = {name: {k: v.clone() for k, v in part.state_dict().items()} for name, part in trainer.model.parts().items()}
    result = trainer.train()
    return family, trainer, result, out, before


# Each encoder's token table in its state dict (a T5 names its table twice: `shared` and `encoder.embed_tokens`)
TABLES = {("flux", "text_encoder"): ["embeddings.token_embedding"], ("flux", "text_encoder_2"): T5_TABLES,
          ("sd3", "text_encoder"): ["text_model.embeddings.token_embedding"],
          ("sd3", "text_encoder_2"): ["text_model.embeddings.token_embedding"], ("sd3", "text_encoder_3"): T5_TABLES,
          ("sana", "text_encoder"): ["embed_tokens"]}


def test_training_moves_the_vectors_and_nothing_else(run):
    """Moved: per output encoder the output vectors of both embeddings (`<table>.outputs.extra` /
    `.outputs.additional.0`), per input encoder (Flux's CLIP-L) their rows (`<table>.extra` / `.additional.0`);
    nothing else, and the output encoders' input rows are still zeros. Both files hold OneTrainer's keys."""
    family, trainer, result, out, before = run
    assert [g.name for g in trainer.groups] == ["embedding", "embedding/<add>"]
    outputs = trainer.model.family.output_embedding_keys
    for name, part in trainer.model.parts().items():
        state = part.state_dict()
        moved = {k for k in state if not torch.equal(state[k], before[name][k])}
        where = "outputs." if name in outputs else ""
        assert moved == {f"{table}.{where}{rows}" for table in TABLES.get((family, name), [])
                         for rows in ("extra", "additional.0")}, name
        if name in outputs:
            assert not any(state[f"{table}.{rows}"].any() for table in TABLES[family, name]
                           for rows in ("extra", "additional.0")), name
    for path in (out / "embedding.safetensors", out / "embeddings" / "add.safetensors"):
        assert load_file(path).keys() == ONETRAINER_FILE[family].keys(), path.name


def test_the_samples_read_every_vector(run):
    """The sample taken at the end changes when any one of the trained tensors (each output encoder's vectors,
    Flux's CLIP-L rows; of either embedding) is zeroed: the sampling pipeline's encoders read them all (SD3's and
    Sana's pipelines with the token's words written out, Flux's expanding it itself)."""
    from test_sampling import pixels

    family, trainer, result, out, _ = run
    (taken,) = (out / "samples" / f"step-{result.steps}").glob("*.png")
    (again,) = trainer.sampler.sample(trainer, 1000)
    assert (pixels(again) == pixels(taken)).all()  # the draw itself is repeatable
    for group in trainer.groups:
        for i, vectors in enumerate(group.params):
            trained = vectors.detach().clone()
            try:
                with torch.no_grad():
                    vectors.zero_()
                (path,) = trainer.sampler.sample(trainer, 1001)
                assert (pixels(path) != pixels(taken)).any(), f"{group.name} [{i}] zeroed drew the same image"
            finally:
                with torch.no_grad():
                    vectors.copy_(trained)


def test_stopped_and_resumed_the_run_is_the_uninterrupted_one(family_models, shapes_data, tmp_path):
    """Flux (CLIP-L input rows and T5 output vectors in one embedding, with their optimizer state): stopped after
    step 2 of 4 and resumed, the losses and both files are the uninterrupted run's, bit for bit."""
    from test_checkpoint import assert_resumes_as_straight

    def raw(out):
        return base_config(family_models["flux"], None, out, family="flux", method="embedding",
                           **run_settings(shapes_data, out, max_steps=4))

    assert_resumes_as_straight(raw, tmp_path, ("embedding.safetensors", "embeddings/add.safetensors"))
