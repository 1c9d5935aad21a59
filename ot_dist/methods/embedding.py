"""Textual inversion: new tokens whose embedding vectors are the only thing that trains.

The vectors live in a small parameter appended to each text encoder's frozen token embedding
(rather than training the whole vocabulary matrix and masking its gradient), so the optimizer state
and, later, the sharded state are the size of the embedding, not of the vocabulary.
The export is the file diffusers' `load_textual_inversion`, A1111 and ComfyUI read: {TOKEN: [n, dim]} for
SD 1.x/2.x (one tensor named after the token, so `pipe.load_textual_inversion(file)` registers the token by
itself) and {"clip_l": ..., "clip_g": ...} for SDXL / SD3 (A1111's SDXL layout; diffusers loads each key with
`token=`). The token is also in the file's metadata ("token").
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ot_dist.checkpoint.export import atomic_path
from ot_dist.errors import ConfigError
from ot_dist.methods.base import ParamGroup, TrainingMethod, freeze_all, plain_state_dict
from ot_dist.methods.embedding_file import read_embedding_file, vector_count
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import LoadedModel
from ot_dist.precision import DTYPES


class ExtendedTokenEmbedding(torch.nn.Module):
    """A frozen nn.Embedding plus trainable rows for the ids that follow its vocabulary."""

    def __init__(self, base: torch.nn.Embedding, extra: torch.Tensor):
        super().__init__()
        self.base = base
        self.extra = torch.nn.Parameter(extra.float())

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.base.weight, self.extra.to(self.base.weight.dtype)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def init_token_ids(tokenizer, text: str, count: int) -> list[int]:
    """The vocabulary rows that start the `count` vectors: the text's tokens, repeated up to the count (kohya's
    way) and cut at it. `ot-dist import onetrainer` appends a "*" per vector to OneTrainer's initial text, which
    gives OneTrainer's rows (the text's tokens, then the token of "*")."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise ConfigError(f"embedding.init_text: {text!r} has no tokens")
    return (ids * -(-count // len(ids)))[:count]


class EmbeddingMethod(TrainingMethod):
    formats = ("embedding",)

    def vector_count(self) -> int:
        """embedding.vectors, or with embedding.init_from the file's count (a configured count must equal it)."""
        embedding = self.config.embedding
        if not embedding.init_from:
            return embedding.vectors
        if getattr(self, "_file_count", None) is None:
            configured = embedding.vectors if "vectors" in embedding.model_fields_set else None
            self._file_count = vector_count(embedding.init_from, get_family(self.config.model.family).embedding_keys,
                                            configured)
            if self._file_count > 1 and embedding.token != embedding.token.lower():
                raise ConfigError(f"embedding.token: {embedding.token!r}: embedding.init_from holds "
                                  f"{self._file_count} vectors, so the token must be lower case (see embedding.token)")
        return self._file_count

    def token_strings(self) -> list[str]:
        token, n = self.config.embedding.token, self.vector_count()
        # The multi-vector naming diffusers' load_textual_inversion uses: tok, tok_1, tok_2, ...
        return [token] + [f"{token}_{i}" for i in range(1, n)]

    def caption(self, caption: str) -> str:
        expanded = " ".join(self.token_strings())
        # In any case: the tokenizer lower-cases the caption, so `<Sks>` would read as the token's first vector
        in_caption = re.compile(re.escape(self.config.embedding.token), re.IGNORECASE)
        if in_caption.search(caption):
            return in_caption.sub(lambda _: expanded, caption)
        return f"{expanded} {caption}".strip()

    def prepare(self, model: LoadedModel) -> list[ParamGroup]:
        freeze_all(model)
        tokens = self.token_strings()
        start = self._start_vectors(model)
        params = []
        for encoder_name, tokenizer_name in zip(model.family.text_encoders, model.family.tokenizers):
            if encoder_name not in model.family.embedding_keys:
                continue  # an encoder that takes no embedding (T5) reads the new words as ordinary text
            tokenizer, encoder = model.tokenizers[tokenizer_name], model.text_encoders[encoder_name]
            init_ids = init_token_ids(tokenizer, self.config.embedding.init_text, len(tokens))
            if tokenizer.convert_tokens_to_ids(tokens[0]) != tokenizer.unk_token_id:
                raise ConfigError(f"embedding.token: {tokens[0]!r} is already in the {tokenizer_name} vocabulary")
            base = encoder.get_input_embeddings()
            tokenizer.add_tokens(tokens)
            new_ids = tokenizer.convert_tokens_to_ids(tokens)
            if new_ids != list(range(base.num_embeddings, base.num_embeddings + len(tokens))):
                raise ConfigError(
                    f"embedding.token: {tokenizer_name} ({len(tokenizer)} tokens) and {encoder_name} "
                    f"({base.num_embeddings} embeddings) disagree on the vocabulary size"
                )
            extra = start[encoder_name] if start else base.weight.detach()[torch.tensor(init_ids)].clone()
            extended = ExtendedTokenEmbedding(base, extra)
            encoder.set_input_embeddings(extended)
            params.append(extended.extra)
        return [ParamGroup("embedding", params, self.config.part_learning_rate("embedding"))]

    def _start_vectors(self, model: LoadedModel) -> dict[str, torch.Tensor] | None:
        """embedding.init_from's vectors per encoder, checked against each encoder's embedding width."""
        path = self.config.embedding.init_from
        if not path:
            return None
        keys = model.family.embedding_keys
        widths = {name: model.text_encoders[name].get_input_embeddings().embedding_dim for name in keys}
        return read_embedding_file(path, keys, widths)

    def vectors(self, model: LoadedModel, state_dict_of=plain_state_dict) -> dict[str, torch.Tensor]:
        vectors = {}
        for name, key in model.family.embedding_keys.items():
            state = state_dict_of(model.text_encoders[name])
            (extra,) = [v for k, v in state.items() if k.endswith("token_embedding.extra")]
            vectors[key.format(token=self.config.embedding.token)] = extra
        return vectors

    def export(
        self, model: LoadedModel, output_dir: Path, state_dict_of=plain_state_dict, write=True, suffix="",
        created: float | None = None,
    ) -> list[Path]:
        dtype = DTYPES[self.config.output_dtype]
        vectors = self.vectors(model, state_dict_of)
        target = output_dir / f"embedding{suffix}.safetensors"
        if not write:
            return [target]
        tensors = {key: v.detach().to("cpu", dtype).contiguous() for key, v in vectors.items()}
        metadata = {"token": self.config.embedding.token, **self.modelspec(model, "embedding", created, suffix)}
        with atomic_path(target) as tmp:
            save_file(tensors, tmp, metadata=metadata)
        return [target]
