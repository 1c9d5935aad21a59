"""Embedding vectors in the language-model text encoders: the T5s (SD3, Flux, Chroma, PixArt-α / Σ, HiDream), Gemma
(Sana, Lumina 2) and Llama (HiDream). Method embedding's and the additional embeddings' tokens get rows there as in
the CLIPs (OneTrainer's *ModelEmbedding: a vector per text encoder). What is checked:
- each such encoder's conditioning is the base encoder (from disk) fed by hand with the file's vectors at the token's
  positions, for every family (the new ids stand exactly where the caption has the token, with no piece for the space
  before it; a caption without it is untouched; Gemma scales the new rows as its vocabulary's);
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
# family -> its language-model encoders: (component, tokenizer, the file's key)
T5 = ("t5",)
ENCODERS = {"sd3": [("text_encoder_3", "tokenizer_3", "t5")], "flux": [("text_encoder_2", "tokenizer_2", "t5")],
            "chroma": [("text_encoder", "tokenizer", "t5")], "pixart_alpha": [("text_encoder", "tokenizer", "t5")],
            "pixart_sigma": [("text_encoder", "tokenizer", "t5")], "sana": [("text_encoder", "tokenizer", "gemma")],
            "lumina2": [("text_encoder", "tokenizer", "gemma")],
            "hidream": [("text_encoder_3", "tokenizer_3", "t5"), ("text_encoder_4", "tokenizer_4", "llama")]}


class ByHand(torch.nn.Module):
    """The base encoder from disk, its input at the new token ids (first_id, first_id + 1, ...) written by hand from
    `vectors` (times the table's own scale, Gemma's sqrt(width), which its table applies to every row it reads);
    called as the families call their encoder."""

    def __init__(self, base, first_id: int, vectors: torch.Tensor):
        super().__init__()
        self.base, self.first_id, self.vectors = base, first_id, vectors
        self.device = torch.device("cpu")

    def forward(self, ids, *args, **kwargs):
        table = self.base.get_input_embeddings()
        new = ids >= self.first_id
        embeds = table(ids.clamp(max=self.first_id - 1)).clone()
        scale = getattr(table, "embed_scale", torch.tensor(1.0))
        embeds[new] = (self.vectors[ids[new] - self.first_id] * scale).to(embeds.dtype)
        return self.base(*args, inputs_embeds=embeds, **kwargs)


def base_encoder(model_path, encoder: str):
    """The model folder's own encoder, by the class model_index.json names."""
    import json

    import transformers

    library, class_name = json.loads((model_path / "model_index.json").read_text())[encoder]
    assert library == "transformers"
    return getattr(transformers, class_name).from_pretrained(model_path / encoder).eval()


def prepared(model_path, family: str, tmp_path, **embedding):
    raw = base_config(model_path, tmp_path, tmp_path / "o", family=family, method="embedding",
                      resolution=64,
                      **{"embedding": {k: v for k, v in {"token": "<tok>", "vectors": 2, "init_text": "a cat",
                                                         **embedding}.items() if v is not None}})
    config = validate(raw)
    method, model = build_method(config), load_model(config.model)
    return method, model


def states(model) -> dict[str, dict[str, torch.Tensor]]:
    """Every part's state dict, cloned (what training may move)."""
    return {name: {k: v.clone() for k, v in part.state_dict().items()} for name, part in model.parts().items()}


def conditioning(model, captions: list[str], encoders: dict | None = None) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model.family.encode_text({**model.text_encoders, **(encoders or {})},
                                        model.family.tokenize(model.tokenizers, captions))


@pytest.mark.parametrize("family", list(ENCODERS))
def test_the_encoder_reads_the_files_vectors_exactly_where_the_token_stands(family, family_models, tmp_path):
    """Vectors set at random, exported, then the family's conditioning of [a caption with the token, one without]
    against the same with each language-model encoder replaced by its base fed the file's vectors by hand at the new
    ids; the ids themselves are the caption's without the token, with the token's two ids where it was written (no
    piece for the space before it). Moving one encoder's vectors changes the caption with the token only."""
    method, model = prepared(family_models[family], family, tmp_path)
    groups = method.prepare(model)
    with torch.no_grad():
        for p in groups[0].params:
            p.copy_(torch.randn_like(p))
    (file,) = method.export(model, tmp_path)
    state = load_file(file)
    captions = [method.caption("a red circle, <tok> in the center"), "a red circle, in the center"]
    tokens = model.family.tokenize(model.tokenizers, captions)
    by_hand = {}
    for encoder, tokenizer_name, key in ENCODERS[family]:
        table = model.text_encoders[encoder].get_input_embeddings()
        vectors = state[key]
        assert vectors.shape == (2, table.embedding_dim) and torch.equal(vectors, table.extra.detach())
        if key in T5:
            assert torch.equal(vectors, state["t5xxl"])  # ComfyUI's key, a copy
        tokenizer = model.tokenizers[tokenizer_name]
        first = len(tokenizer) - 2  # the tokens were added last
        ids = tokens[encoder]
        where = (ids[0] >= first).nonzero().flatten().tolist()
        assert ids[0, where].tolist() == [first, first + 1] and where[1] == where[0] + 1, encoder
        kept = [i for i in ids[0].tolist() if i < first]
        assert kept == ids[1].tolist()[:len(kept)], encoder  # the rest of the caption, in order
        before = tokenizer.convert_ids_to_tokens(ids[0, where[0] - 1].item())
        assert before.strip("▁Ġ "), f"{encoder}: a piece of its own for the space before the token: {before!r}"
        by_hand[encoder] = ByHand(base_encoder(family_models[family], encoder), first, vectors)

    got = conditioning(model, captions)
    want = conditioning(model, captions, by_hand)
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    for encoder, _, _ in ENCODERS[family]:
        with torch.no_grad():
            model.text_encoders[encoder].get_input_embeddings().extra.add_(1.0)
        moved = conditioning(model, captions)
        assert any(not torch.equal(moved[k][0], got[k][0]) for k in got), encoder
        assert all(torch.equal(moved[k][1], got[k][1]) for k in got), encoder
        got = moved


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
    before = states(trainer.model)
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


def test_one_process_training_of_gemma_vectors_moves_those_rows_only(family_models, shapes_data, tmp_path):
    """Sana (Gemma 2 alone, captions lower-cased): method embedding trains the rows of its token in Gemma's table and
    nothing else; the file holds them under OneTrainer's `gemma`."""
    out = tmp_path / "out"
    raw = base_config(family_models["sana"], shapes_data, out, family="sana", method="embedding", batch_size=4,
                      max_steps=2, learning_rate=5e-2, **{"embedding": {"token": "<tok>", "init_text": "a cat"}})
    trainer = Trainer(validate(raw), log=QUIET)
    before = states(trainer.model)
    trainer.train()
    for name, part in trainer.model.parts().items():
        state = part.state_dict()
        moved = {k for k in state if k not in before[name] or not torch.equal(state[k], before[name][k])}
        assert moved == ({"embed_tokens.extra"} if name == "text_encoder" else set()), name
    rows = trainer.model.text_encoders["text_encoder"].get_input_embeddings().extra.detach()
    assert torch.equal(load_file(out / "embedding.safetensors")["gemma"], rows)


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


def test_the_documented_flux_block_loads_the_file(flux_run, family_models):
    """docs/checkpoints.md's Flux block, run as written (OUT and TOKEN filled in): the pipeline encodes the prompt as
    the trained model."""
    import sys
    from pathlib import Path

    from diffusers import FluxPipeline

    sys.path.insert(0, str(Path(__file__).parent))
    from test_early_checks import doc_blocks

    trainer, _, out, _ = flux_run
    block = doc_blocks("checkpoints.md", "Loading an exported embedding")[4]
    assert 'vectors["t5"]' in block
    pipe = FluxPipeline.from_pretrained(family_models["flux"], local_files_only=True)
    exec(block.replace("OUT/", f"{out}/").replace('"TOKEN"', '"<tok>"'), {"pipe": pipe})
    model = trainer.model
    with torch.no_grad():
        hidden, pooled, _ = pipe.encode_prompt("a red circle, <tok>", max_sequence_length=model.family.max_tokens(
            "tokenizer_2", model.tokenizers["tokenizer_2"]))
    ours = conditioning(model, [trainer.method.caption("a red circle, <tok>")])
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


@pytest.mark.parametrize("family,method", [("sana", "embedding"), ("pixart_sigma", "lora")])
def test_an_upper_case_token_is_refused_where_the_family_lower_cases_prompts(tmp_path, family, method):
    """Sana lower-cases every caption, PixArt's pipelines the sample prompts: an upper-case token would never be
    found, so its vectors would not train (or never reach the samples)."""
    from ot_dist.errors import ConfigError

    extra = ({"embedding": {"token": "<Tok>"}} if method == "embedding"
             else {"additional_embeddings": [{"token": "<Tok>"}]})
    key = "embedding.token" if method == "embedding" else r"additional_embeddings\[0\].token"
    with pytest.raises(ConfigError, match=rf"{key}: '<Tok>' must be lower case \('<tok>'\) for {family}"):
        validate(base_config(tmp_path, tmp_path, tmp_path / "o", family=family, method=method, **extra))
    extra = {k: ({"token": "<tok>"} if isinstance(v, dict) else [{"token": "<tok>"}]) for k, v in extra.items()}
    validate(base_config(tmp_path, tmp_path, tmp_path / "o", family=family, method=method, **extra))


@pytest.mark.parametrize("family", ["chroma", "pixart_sigma"])
def test_t5_output_embeddings_start_as_onetrainers_and_replace_the_t5_output(family, family_models, tmp_path):
    """An output embedding of PixArt's / Chroma's T5 (OneTrainer's is_output_embedding; its savers' t5 / t5_out):
    - the vectors start as OneTrainer starts them: the T5's last hidden state, read with the tokenizer's mask, of
      init_text followed by one "*" per vector, at the positions after the first;
    - the conditioning is the base T5 reading zero rows at the tokens' ids, its output at their positions replaced by
      the file's t5_out, computed here by hand; a caption without them is untouched;
    - the file holds t5 (the zero input rows) and t5_out, and no t5xxl copy (ComfyUI would read the zeros)."""
    method, model = prepared(family_models[family], family, tmp_path, vectors=3, output_embedding=True)
    (group,) = method.prepare(model)
    tokenizer = model.tokenizers["tokenizer"]
    base = base_encoder(family_models[family], "text_encoder")
    encoded = tokenizer(["a cat***"], padding="max_length", max_length=model.family.max_tokens("tokenizer", tokenizer),
                        truncation=True, return_tensors="pt")
    with torch.no_grad():
        start = base(encoded.input_ids, attention_mask=encoded.attention_mask).last_hidden_state[0, 1:4]
    torch.testing.assert_close(group.params[0].detach(), start, rtol=0, atol=0)

    with torch.no_grad():
        group.params[0].add_(torch.randn_like(group.params[0]))
    (file,) = method.export(model, tmp_path)
    state = load_file(file)
    assert state.keys() == {"t5", "t5_out"} and not state["t5"].any()
    assert torch.equal(state["t5_out"], group.params[0].detach())
    first = len(tokenizer) - 3
    captions = [method.caption("a red circle, <tok> in the center"), "a red circle, in the center"]
    ids = model.family.tokenize(model.tokenizers, captions)["text_encoder"]
    got = conditioning(model, captions)
    plain = conditioning(model, captions, {"text_encoder": ByHand(base, first, torch.zeros(3, table_width(base)))})
    hit = (ids >= first).unsqueeze(-1)
    want = torch.where(hit, state["t5_out"][(ids - first).clamp(0, 2)], plain["hidden"])
    assert hit[0].sum() == 3 and not hit[1].any()
    torch.testing.assert_close(got["hidden"], want, rtol=0, atol=0)
    assert torch.equal(got["hidden"][1], plain["hidden"][1])


def table_width(encoder) -> int:
    return encoder.get_input_embeddings().embedding_dim


@pytest.mark.parametrize("family,pipeline_class,expanded", [
    ("pixart_sigma", "PixArtSigmaPipeline", True),  # no textual-inversion loader: the sampler writes the words
    ("flux", "FluxPipeline", False),  # maybe_convert_prompt expands the token itself (in both tokenizers)
])
def test_samples_read_every_vector_of_a_token(family, pipeline_class, expanded, family_models, shapes_data, tmp_path,
                                              monkeypatch):
    """A sample prompt's token of two vectors reaches the encoders as its two words: written out by the sampler for a
    pipeline without diffusers' textual-inversion loader (SD3, PixArt, Sana, Lumina 2, HiDream would read the first
    vector only), left to the pipeline where it has one (written out there, Flux would expand it twice)."""
    import diffusers

    prompt = {"prompt": "a <tok> dot", "seed": 1, "steps": 1, "width": 64, "height": 64}
    if expanded:  # (Flux samples without a negative pass)
        prompt["negative_prompt"] = "<tok> ring"
    raw = base_config(family_models[family], shapes_data, tmp_path / "o", family=family, method="embedding",
                      **{"embedding": {"token": "<tok>", "vectors": 2}, "sampling.prompts": [prompt]})
    trainer = Trainer(validate(raw), log=QUIET)
    seen = []
    cls = getattr(diffusers, pipeline_class)
    original = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a, **k: seen.append(k) or original(self, *a, **k))
    (path,) = trainer.sampler.sample(trainer, 0)
    words = "<tok> <tok>_1" if expanded else "<tok>"
    assert seen[0]["prompt"] == f"a {words} dot" and seen[0].get("negative_prompt") in (None, f"{words} ring")
    assert ("negative_prompt" in seen[0]) is expanded and path.is_file()
