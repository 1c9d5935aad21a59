"""Embedding vectors in the T5 encoders (SD3, Flux, Chroma, PixArt-α / Σ): method embedding's and the additional
embeddings' tokens get rows in the T5 as in the CLIPs (OneTrainer's *ModelEmbedding: a vector per text encoder).
What is checked:
- the T5's conditioning is the base T5 (from disk) fed by hand with the file's vectors at the token's positions, for
  every family (the new ids stand exactly where the caption has the token; a caption without it is untouched);
- a T5 whose matrix has more rows than its tokenizer has tokens (T5-XXL: 32128 rows, 32100 tokens): the new ids
  follow the tokenizer, as OneTrainer's AdditionalEmbeddingWrapper places them, and the padding rows stay in exports;
- one process's training (Flux: CLIP-L and T5) moves those rows and nothing else;
- the file holds OneTrainer's `t5` and ComfyUI's `t5xxl`, which OneTrainer's, ComfyUI's and diffusers'
  (load_textual_inversion into FluxPipeline's T5) rules read back as the trained conditioning;
- init_from continues from `t5` or `t5xxl`; a CLIP-only file starts the T5's vectors from init_text.
2 ranks == 1 process: tests/test_family_strategies.py's Flux LoRA cases carry an additional embedding."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file, save_file

from ot_dist.config.load import validate
from ot_dist.methods.registry import build_method
from ot_dist.models.loading import load_model
from ot_dist.train.trainer import Trainer

QUIET = lambda *_: None  # noqa: E731
# family -> its T5's component name and tokenizer
T5_OF = {"sd3": ("text_encoder_3", "tokenizer_3"), "flux": ("text_encoder_2", "tokenizer_2"),
         "chroma": ("text_encoder", "tokenizer"), "pixart_alpha": ("text_encoder", "tokenizer"),
         "pixart_sigma": ("text_encoder", "tokenizer")}
RESOLUTION = {"pixart_alpha": 64, "pixart_sigma": 64}


class ByHand(torch.nn.Module):
    """The base T5 from disk, its input at the new token ids (first_id, first_id + 1, ...) written by hand from
    `vectors`; called as the families call their T5 (ids, attention_mask, output_hidden_states)."""

    def __init__(self, base, first_id: int, vectors: torch.Tensor):
        super().__init__()
        self.base, self.first_id, self.vectors = base, first_id, vectors
        self.device = torch.device("cpu")

    def forward(self, ids, attention_mask=None, output_hidden_states=False):
        table = self.base.get_input_embeddings().weight
        new = ids >= self.first_id
        embeds = table[ids.clamp(max=self.first_id - 1)].clone()
        embeds[new] = self.vectors[ids[new] - self.first_id].to(embeds.dtype)
        return self.base(inputs_embeds=embeds, attention_mask=attention_mask, output_hidden_states=output_hidden_states)


def base_t5(model_path, encoder: str):
    from transformers import T5EncoderModel

    return T5EncoderModel.from_pretrained(model_path / encoder).eval()


def prepared(model_path, family: str, tmp_path, **embedding):
    raw = base_config(model_path, tmp_path, tmp_path / "o", family=family, method="embedding",
                      resolution=RESOLUTION.get(family, 64),
                      **{"embedding": {k: v for k, v in {"token": "<tok>", "vectors": 2, "init_text": "a cat",
                                                         **embedding}.items() if v is not None}})
    config = validate(raw)
    method, model = build_method(config), load_model(config.model)
    return method, model


def conditioning(model, captions: list[str], encoders: dict | None = None) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model.family.encode_text({**model.text_encoders, **(encoders or {})},
                                        model.family.tokenize(model.tokenizers, captions))


@pytest.mark.parametrize("family", list(T5_OF))
def test_the_t5_reads_the_files_vectors_exactly_where_the_token_stands(family, family_models, tmp_path):
    """Vectors set at random, exported, then the family's conditioning of [a caption with the token, one without]
    against the same with the base T5 fed the file's `t5` vectors by hand at the new ids; the ids themselves are the
    caption's without the token, with the token's two ids where it was written. Moving the vectors changes the
    caption with the token only."""
    method, model = prepared(family_models[family], family, tmp_path)
    groups = method.prepare(model)
    encoder, tokenizer_name = T5_OF[family]
    t5 = model.text_encoders[encoder]
    with torch.no_grad():
        for p in groups[0].params:
            p.copy_(torch.randn_like(p))
    (file,) = method.export(model, tmp_path)
    state = load_file(file)
    vectors = state["t5"]
    assert torch.equal(vectors, state["t5xxl"]) and vectors.shape == (2, t5.get_input_embeddings().embedding_dim)
    assert torch.equal(vectors, t5.get_input_embeddings().extra.detach())

    tokenizer = model.tokenizers[tokenizer_name]
    first = len(tokenizer) - 2  # the tokens were added last
    captions = [method.caption("a red circle, <tok> in the center"), "a red circle, in the center"]
    ids = model.family.tokenize(model.tokenizers, captions)[encoder]
    plain = tokenizer(captions[1:], padding="max_length", max_length=ids.shape[1], truncation=True,
                      return_tensors="pt").input_ids[0]
    where = (ids[0] >= first).nonzero().flatten().tolist()
    assert ids[0, where].tolist() == [first, first + 1] and where[1] == where[0] + 1
    kept = [i for i in ids[0].tolist() if i < first]
    assert kept == plain.tolist()[:len(kept)]  # the rest of the caption, in order (padding cut by the two ids)
    assert tokenizer.convert_ids_to_tokens(ids[0, :where[0]].tolist())[-1] != "▁"  # no stray word start before it
    assert torch.equal(ids[1], plain)

    got = conditioning(model, captions)
    want = conditioning(model, captions, {encoder: ByHand(base_t5(family_models[family], encoder), first, vectors)})
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    with torch.no_grad():
        t5.get_input_embeddings().extra.add_(1.0)
    moved = conditioning(model, captions)
    key = "hidden"
    assert not torch.equal(moved[key][0], got[key][0]) and torch.equal(moved[key][1], got[key][1])


def test_new_ids_follow_the_tokenizer_in_a_padded_t5(family_models, tmp_path):
    """Chroma with a T5 of 28 rows more than its tokenizer (T5-XXL's 32128 for 32100 tokens): the token's ids are
    the tokenizer's next, its vectors are read there (the padding rows never), and the encoder's export without the
    token rows keeps every base row under its own name."""
    from transformers import T5EncoderModel

    from ot_dist.methods.token_vectors import without_token_rows

    method, model = prepared(family_models["chroma"], "chroma", tmp_path)
    small = model.pipeline.text_encoder
    config = small.config.to_dict() | {"vocab_size": small.config.vocab_size + 28}
    padded = T5EncoderModel(type(small.config).from_dict(config)).eval()
    state = small.state_dict()
    pad_rows = torch.randn(28, small.config.d_model)
    for key in ("shared.weight", "encoder.embed_tokens.weight"):
        state[key] = torch.cat([state[key], pad_rows])
    padded.load_state_dict(state)
    model.pipeline.text_encoder = padded
    tokenizer = model.tokenizers["tokenizer"]
    vocabulary = len(tokenizer)
    assert vocabulary == small.config.vocab_size

    (group,) = method.prepare(model)
    assert tokenizer.convert_tokens_to_ids(["<tok>", "<tok>_1"]) == [vocabulary, vocabulary + 1]
    with torch.no_grad():
        group.params[0].copy_(torch.randn_like(group.params[0]))
    captions = [method.caption("a dot"), "a dot"]
    got = conditioning(model, captions)
    want = conditioning(model, captions, {"text_encoder": ByHand(small, vocabulary, group.params[0].detach())})
    torch.testing.assert_close(got["hidden"], want["hidden"], rtol=0, atol=0)
    exported = without_token_rows(padded.state_dict())
    assert torch.equal(exported["shared.weight"][vocabulary:], pad_rows)
    assert not any("extra" in key or ".base." in key for key in exported)


def comfyui_load_embed(state: dict[str, torch.Tensor], embed_key: str, embedding_size: int) -> torch.Tensor | None:
    """ComfyUI's rule for a .safetensors embedding (comfy/sd1_clip.py load_embed, then SDTokenizer's shape check):
    `embed_key` if the file has it (the T5-XXL tokenizers of SD3, Flux, PixArt and Chroma pass 't5xxl', CLIP-L's
    'clip_l': comfy/text_encoders/sd3_clip.py, flux.py, pixart_t5.py), else a `bundle_emb.` key, else the file's first
    tensor; a width other than the encoder's is ignored ("shape mismatch when trying to apply embedding")."""
    if embed_key in state:
        found = state[embed_key]
    else:
        found = next(iter(state.values()))
    return found if found.shape[-1] == embedding_size else None


def onetrainer_reads(state: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """OneTrainer's loader rule (modules/modelSetup/BaseFluxSetup.py, BaseStableDiffusion3Setup.py, BaseChromaSetup.py,
    BasePixArtAlphaSetup.py `_setup_embeddings`: `embedding_state.get("t5_out", embedding_state.get("t5", None))`)."""
    return state.get(f"{key}_out", state.get(key, None))


@pytest.fixture(scope="module")
def flux_run(family_models, shapes_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("flux_emb") / "out"
    raw = base_config(family_models["flux"], shapes_data, out, family="flux", method="embedding", batch_size=4,
                      max_steps=3, learning_rate=5e-2, gradient_checkpointing=True,
                      **{"embedding": {"token": "<tok>", "vectors": 2, "init_text": "a cat"},
                         "additional_embeddings": [{"token": "<add>"}]})
    raw["data"] = {"concepts": [{"path": str(shapes_data), "caption_prefix": "<add>"}], "shards": f"{out}-shards"}
    trainer = Trainer(validate(raw), log=QUIET)
    before = {name: {k: v.clone() for k, v in part.state_dict().items()} for name, part in trainer.model.parts().items()}
    result = trainer.train()
    return trainer, result, out, before


def test_training_moves_the_token_rows_and_nothing_else(flux_run):
    trainer, result, out, before = flux_run
    assert [g.name for g in trainer.groups] == ["embedding", "embedding/<add>"]
    rows = {"extra", "additional.0"}
    want = {"text_encoder": {f"embeddings.token_embedding.{r}" for r in rows},
            "text_encoder_2": {f"{m}.{r}" for m in ("shared", "encoder.embed_tokens") for r in rows}}
    for name, part in trainer.model.parts().items():
        state = part.state_dict()
        moved = {k for k in state if k not in before[name] or not torch.equal(state[k], before[name][k])}
        assert moved == want.get(name, set()), name
    assert {p.name for p in result.exported} == {"embedding.safetensors", "add.safetensors"}


def test_the_encoders_read_the_rows_without_dropout_but_checkpointed(flux_run):
    """OneTrainer's embedding setups put the text encoders in eval mode (FluxEmbeddingSetup.setup_train_device): the
    T5's dropout (0.1 in T5 v1.1's config) stays off while its rows train; its blocks keep the train flag that
    transformers checkpoints them by (gradient_checkpointing: true)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    trainer, _, _, _ = flux_run
    t5 = trainer.model.text_encoders["text_encoder_2"]
    assert t5.config.dropout_rate > 0
    blocks = [m for m in t5.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert blocks and all(m.training and m.gradient_checkpointing for m in blocks)
    assert not any(m.training for m in t5.modules() if not isinstance(m, GradientCheckpointingLayer))


def test_the_files_are_read_by_onetrainer_comfyui_and_diffusers(flux_run, family_models):
    """Each file holds clip_l, t5 and t5xxl, the trained rows; OneTrainer's and ComfyUI's rules find the T5's vectors
    (ComfyUI's CLIP-L the clip_l); diffusers' load_textual_inversion into FluxPipeline's CLIP-L and T5 (the pipeline
    expands the token to its words in both prompts, maybe_convert_prompt) encodes the prompt as the trained model."""
    from diffusers import FluxPipeline

    trainer, _, out, _ = flux_run
    model = trainer.model
    t5 = model.text_encoders["text_encoder_2"].get_input_embeddings()
    clip = model.text_encoders["text_encoder"].get_input_embeddings()
    files = {"<tok>": (out / "embedding.safetensors", "extra"),
             "<add>": (out / "embeddings" / "add.safetensors", "additional.0")}
    pipe = FluxPipeline.from_pretrained(family_models["flux"], local_files_only=True)
    for token, (path, rows) in files.items():
        state = load_file(path)
        assert state.keys() == {"clip_l", "t5", "t5xxl"}, path.name
        trained_t5 = t5.get_parameter(rows).detach()
        assert torch.equal(onetrainer_reads(state, "t5"), trained_t5)
        assert torch.equal(comfyui_load_embed(state, "t5xxl", t5.embedding_dim), trained_t5)
        assert torch.equal(comfyui_load_embed(state, "clip_l", clip.embedding_dim), clip.get_parameter(rows).detach())
        pipe.load_textual_inversion(state["clip_l"], token=token, text_encoder=pipe.text_encoder,
                                    tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(state["t5"], token=token, text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)
    prompt = "<add> a red circle, <tok>"
    with torch.no_grad():
        hidden, pooled, _ = pipe.encode_prompt(prompt, max_sequence_length=model.family.max_tokens(
            "tokenizer_2", model.tokenizers["tokenizer_2"]))
    ours = conditioning(model, [trainer.method.caption(prompt)])
    torch.testing.assert_close(hidden, ours["hidden"], rtol=0, atol=1e-6)
    torch.testing.assert_close(pooled, ours["pooled"], rtol=0, atol=1e-6)


def test_init_from_reads_t5_or_t5xxl_and_a_clip_only_file_starts_the_t5_from_init_text(flux_run, family_models,
                                                                                       tmp_path):
    trainer, _, out, _ = flux_run
    model = trainer.model
    trained = {name: model.text_encoders[name].get_input_embeddings().extra.detach()
               for name in ("text_encoder", "text_encoder_2")}
    state = load_file(out / "embedding.safetensors")
    comfy = tmp_path / "comfy.safetensors"
    save_file({"clip_l": state["clip_l"], "t5xxl": state["t5xxl"]}, comfy)
    clip_only = tmp_path / "clip_only.safetensors"
    save_file({"clip_l": state["clip_l"]}, clip_only)
    for path in (out / "embedding.safetensors", comfy, clip_only):
        method, again = prepared(family_models["flux"], "flux", tmp_path, init_from=str(path), vectors=None)
        (group,) = method.prepare(again)
        clip_rows, t5_rows = (p.detach() for p in group.params)
        assert torch.equal(clip_rows, trained["text_encoder"]), path.name
        if path != clip_only:
            assert torch.equal(t5_rows, trained["text_encoder_2"]), path.name
            continue
        table = again.text_encoders["text_encoder_2"].get_input_embeddings().base.weight
        ids = again.tokenizers["tokenizer_2"]("a cat", add_special_tokens=False).input_ids
        assert torch.equal(t5_rows, table[(ids * 2)[:2]].detach())  # init_text's rows, as without a file
