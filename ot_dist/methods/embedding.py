"""Textual inversion: new tokens whose embedding vectors are the only thing that trains (besides any
additional_embeddings). The vectors, the tokens' expansion in captions and the file are token_vectors.py's, shared
with the additional embeddings of the other methods.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.errors import ConfigError
from ot_dist.methods.base import ParamGroup, TrainingMethod, freeze_all, plain_state_dict
from ot_dist.methods.embedding_file import vector_count
from ot_dist.methods.output_vectors import file_vectors
from ot_dist.methods.token_vectors import (add_vectors, auto_vector_count, rows_in_state, start_vectors, token_rows,
                                          token_strings, write_embedding_file)
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import LoadedModel
from ot_dist.precision import DTYPES


class EmbeddingMethod(TrainingMethod):
    formats = ("embedding",)

    def vector_count(self) -> int:
        """embedding.vectors; with embedding.init_from the file's count (a configured number must equal it); with
        `auto` the count prepare() took from the tokenizers."""
        embedding = self.config.embedding
        if getattr(self, "_counted", None) is not None:
            return self._counted
        if not embedding.init_from and embedding.vectors == "auto":
            raise RuntimeError("embedding.vectors: auto is counted by the model's tokenizers in prepare()")
        if not embedding.init_from:
            return embedding.vectors
        set_here = embedding.vectors != "auto" and "vectors" in embedding.model_fields_set
        self._counted = vector_count(embedding.init_from, get_family(self.config.model.family),
                                     embedding.vectors if set_here else None)
        if self._counted > 1 and embedding.token != embedding.token.lower():
            raise ConfigError(f"embedding.token: {embedding.token!r}: embedding.init_from holds "
                              f"{self._counted} vectors, so the token must be lower case (see embedding.token)")
        return self._counted

    def token_strings(self) -> list[str]:
        return token_strings(self.config.embedding.token, self.vector_count())

    def caption(self, caption: str) -> str:
        """The token expanded where the caption has it (in any case), else prepended; then the additional ones."""
        token = self.config.embedding.token
        if token.lower() not in caption.lower():
            caption = f"{token} {caption}".strip()
        return super().caption(caption)

    def expansions(self) -> dict[str, str]:
        return {self.config.embedding.token: " ".join(self.token_strings()), **super().expansions()}

    def prepare(self, model: LoadedModel) -> list[ParamGroup]:
        freeze_all(model)
        embedding = self.config.embedding
        if embedding.vectors == "auto" and not embedding.init_from:
            self._counted = auto_vector_count(model, embedding.init_text, "embedding")
        output = embedding.output_embedding
        added = add_vectors(model, self.token_strings(), start_vectors(model, embedding.init_from, output),
                            embedding.init_text, "embedding", main=True, output=output)
        group = ParamGroup("embedding", list(added.values()), self.config.part_learning_rate("embedding"))
        return [group] + self.additional.prepare(model)

    def vectors(self, model: LoadedModel, state_dict_of=plain_state_dict) -> dict[str, torch.Tensor]:
        """The file's tensors. `state_dict_of` is a collective under sharding: every rank calls this; a rank that
        writes no export keeps nothing of what it gathers (empty state dicts) and gets an empty dict."""
        # the rows, not the whole encoder
        states = {name: state_dict_of(model.text_encoders[name], keep=token_rows) for name in model.family.embedding_keys}
        if not all(states.values()):
            return {}
        if self.config.embedding.output_embedding:
            return file_vectors(model.family, states, "extra")
        return {key.format(token=self.config.embedding.token): rows_in_state(states[name], "extra")
                for name, key in model.family.embedding_keys.items()}

    def export(
        self, model: LoadedModel, output_dir: Path, state_dict_of=plain_state_dict, write=True, suffix="",
        created: float | None = None,
    ) -> list[Path]:
        vectors = self.vectors(model, state_dict_of)
        target = output_dir / f"embedding{suffix}.safetensors"
        if write:
            write_embedding_file(target, vectors, self.config.embedding.token, DTYPES[self.config.output_dtype],
                                 self.modelspec(model, "embedding", created, suffix),
                                 {} if self.config.embedding.output_embedding else model.family.embedding_key_copies)
        return [target] + self.additional.export(model, output_dir, state_dict_of, write, suffix, created)
