"""`vectors: auto` (OneTrainer's token_count null): an embedding gets one vector per token of its init_text, counted
by the model's tokenizers when it loads (without special tokens, as OneTrainer's _create_new_embedding counts), and
its vectors start from exactly those tokens' rows. No process launch: the model is loaded and the method prepared
here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.methods.embedding import EmbeddingMethod
from ot_dist.methods.lora import LoraMethod
from ot_dist.models.loading import load_model

TEXT = "a red cat"


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_auto_gives_a_vector_per_token_of_the_text_starting_from_their_rows(tiny_models, tmp_path, family):
    config = validate(base_config(tiny_models[family], tmp_path, tmp_path / "out", family=family, method="embedding",
                                  embedding={"token": "<tok>", "vectors": "auto", "init_text": TEXT}))
    method, model = EmbeddingMethod(config), load_model(config.model)
    ids = model.tokenizers["tokenizer"](TEXT, add_special_tokens=False).input_ids  # before the tokens are added
    tables = {name: encoder.get_input_embeddings().weight.detach().clone()
              for name, encoder in model.text_encoders.items()}
    (group,) = method.prepare(model)
    assert len(ids) > 1 and method.vector_count() == len(ids)
    assert method.token_strings() == ["<tok>"] + [f"<tok>_{i}" for i in range(1, len(ids))]
    assert len(group.params) == len(model.text_encoders)
    for name, encoder in model.text_encoders.items():
        rows = encoder.get_input_embeddings().rows()[0]
        torch.testing.assert_close(rows.detach(), tables[name][ids].float())


def test_an_additional_embedding_counts_its_own_text(tiny_models, tmp_path):
    config = validate(base_config(tiny_models["sd1"], tmp_path, tmp_path / "out", method="lora", additional_embeddings=[
        {"token": "<a>", "vectors": "auto", "init_text": TEXT}, {"token": "<b>", "vectors": "auto", "init_text": "dog"}]))
    method, model = LoraMethod(config), load_model(config.model)
    tokenizer = model.tokenizers["tokenizer"]
    want = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in (TEXT, "dog")]
    method.prepare(model)
    assert [method.additional.vector_count(i) for i in range(2)] == want
    assert method.expansions()["<a>"].split() == ["<a>"] + [f"<a>_{i}" for i in range(1, want[0])]


def test_tokenizers_that_count_the_text_differently_are_named():
    """OneTrainer sizes each encoder's vectors by its own tokenizer; ot_dist's token stands for one list of words in
    every encoder, so a text that SD3's CLIP and T5 split differently is refused with both counts."""
    from ot_dist.methods.token_vectors import auto_vector_count

    def counting(n):
        return lambda text, add_special_tokens=True: SimpleNamespace(input_ids=list(range(n)))

    family = SimpleNamespace(text_encoders=("text_encoder", "text_encoder_3"), tokenizers=("tokenizer", "tokenizer_3"),
                             embedding_keys={"text_encoder": "clip_l", "text_encoder_3": "t5"})
    model = SimpleNamespace(family=family, tokenizers={"tokenizer": counting(3), "tokenizer_3": counting(4)})
    with pytest.raises(ConfigError, match="3 tokens for tokenizer, 4 tokens for tokenizer_3"):
        auto_vector_count(model, TEXT, "embedding")
    model.tokenizers["tokenizer_3"] = counting(3)
    assert auto_vector_count(model, TEXT, "embedding") == 3


def test_auto_needs_a_lower_case_token(tiny_models, tmp_path):
    with pytest.raises(ConfigError, match="with auto vectors must be lower case"):
        validate(base_config(tiny_models["sd1"], tmp_path, tmp_path / "out", method="embedding",
                             embedding={"token": "<Tok>", "vectors": "auto"}))
    with pytest.raises(ConfigError, match="embedding.vectors"):
        validate(base_config(tiny_models["sd1"], tmp_path, tmp_path / "out", method="embedding",
                             embedding={"token": "<tok>", "vectors": "many"}))
