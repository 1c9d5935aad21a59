"""`additional_embeddings`: new tokens trained beside a method's own weights (pivotal tuning; OneTrainer's additional
embeddings), each in its own parameter group. Every method holds one of these (`TrainingMethod.additional`); with an
empty list it does nothing.

The vectors are token_vectors.py's rows (`additional.<i>` of each embedding-taking encoder's ExtendedTokenEmbedding,
so the strategies shard and gather them with the encoder, as method embedding's), the captions expand their tokens
where they are written (never prepended), and the samples see them through the shared tokenizers and encoders.
Exports: output_dir/embeddings<suffix>/<token>.safetensors each (method embedding's layout), and for method lora with
bundle_additional_embeddings the same vectors inside the LoRA file as `bundle_emb.<token>.<key>` (`bundled`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ot_dist.config.embeddings import AdditionalEmbeddingConfig, file_stem
from ot_dist.errors import ConfigError
from ot_dist.methods.embedding_file import vector_count
from ot_dist.methods.output_vectors import file_vectors
from ot_dist.methods.token_vectors import (add_vectors, auto_vector_count, rows_in_state, start_vectors, token_rows,
                                          token_strings, with_key_copies, write_embedding_file)
from ot_dist.models.families.base import EMBEDDING_TOKEN_KEY
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import LoadedModel
from ot_dist.precision import DTYPES

# A1111's own textual-inversion key (its {'string_to_param': {'*': tensor}} flattened, as safetensors holds it): the
# bundled key of a one-encoder family. A1111 / Forge (extensions-builtin/Lora/networks.py load_network, read at Forge
# 9f1eb409^, before its 2024 rework) take `bundle_emb.<name>.string_to_param.*` by name, and ComfyUI's load_embed
# (comfy/sd1_clip.py bundled_embed) tries that suffix first whatever the model.
ONE_ENCODER_BUNDLE_KEY = "string_to_param.*"


class AdditionalEmbeddings:
    def __init__(self, config):
        self.config = config
        self.entries: list[AdditionalEmbeddingConfig] = list(config.additional_embeddings)
        self._counts: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def vector_count(self, i: int) -> int:
        """Entry i's vectors, or with init_from the file's count (a configured count must equal it)."""
        entry = self.entries[i]
        if i in self._counts:
            return self._counts[i]
        if not entry.init_from and entry.vectors == "auto":
            raise RuntimeError("additional_embeddings[].vectors: auto is counted by the tokenizers in prepare()")
        if not entry.init_from:
            return entry.vectors
        configured = entry.vectors if entry.vectors != "auto" and "vectors" in entry.model_fields_set else None
        self._counts[i] = vector_count(entry.init_from, get_family(self.config.model.family), configured)
        return self._counts[i]

    def expansions(self) -> dict[str, str]:
        return {e.token: " ".join(token_strings(e.token, self.vector_count(i))) for i, e in enumerate(self.entries)}

    def prepare(self, model: LoadedModel) -> list:
        """Add each embedding's tokens and rows (after the method froze the model and chose its own parameters);
        one parameter group per trained embedding."""
        from ot_dist.methods.base import ParamGroup

        groups = []
        for i, entry in enumerate(self.entries):
            key = f"additional_embeddings[{i}]"
            if entry.vectors == "auto" and not entry.init_from:  # before the tokens exist: the text reads as words
                self._counts[i] = auto_vector_count(model, entry.init_text, key)
            added = add_vectors(model, token_strings(entry.token, self.vector_count(i)),
                                start_vectors(model, entry.init_from, entry.output_embedding, f"{key}.init_from"),
                                entry.init_text, key, output=entry.output_embedding)
            for parameter in added.values():
                parameter.requires_grad_(entry.train)
            if entry.train:
                groups.append(ParamGroup(entry.group_name(), list(added.values()),
                                         self.config.additional_learning_rate(entry)))
        return groups

    def vectors(self, model: LoadedModel, state_dict_of) -> list[dict[str, torch.Tensor]]:
        """Per entry: {the family's file key (the token for SD 1.x / 2.x): full [n, dim] rows}. `state_dict_of` is a
        collective under sharding: every rank calls this; a rank that writes no export keeps nothing of what it
        gathers (empty state dicts) and gets an empty dict per entry."""
        if not self.entries:
            return []
        family = model.family
        states = {name: state_dict_of(model.text_encoders[name], keep=token_rows)  # the rows, not the encoder
                  for name in {**family.embedding_keys, **family.output_embedding_keys}}
        if not all(states.values()):
            return [{} for _ in self.entries]
        return [file_vectors(family, states, f"additional.{i}") if entry.output_embedding else
                {key.format(token=entry.token): rows_in_state(states[name], f"additional.{i}")
                 for name, key in family.embedding_keys.items()}
                for i, entry in enumerate(self.entries)]

    def bundled(self, model: LoadedModel, vectors: list[dict[str, torch.Tensor]], dtype) -> dict[str, torch.Tensor]:
        """The LoRA file's `bundle_emb.<token>.<key>` tensors (A1111's rule: the name is what lies between the first
        two dots, <key> as in an embedding file: `string_to_param.*` for one encoder, clip_l + clip_g for SDXL, t5
        and its copy t5xxl for a T5, as OneTrainer's and ComfyUI's bundle readers name it)."""
        tensors = {}
        for entry, rows in zip(self.entries, vectors, strict=True):
            keyed = {}
            for (name, family_key), value in zip(model.family.embedding_keys.items(), rows.values(), strict=True):
                keyed[ONE_ENCODER_BUNDLE_KEY if family_key == EMBEDDING_TOKEN_KEY else family_key] = value
            for key, value in with_key_copies(keyed, model.family.embedding_key_copies).items():
                tensors[f"bundle_emb.{entry.token}.{key}"] = value.detach().to("cpu", dtype).contiguous()
        return tensors

    def export(self, model: LoadedModel, output_dir: Path, state_dict_of, write: bool, suffix: str,
               created: float | None, vectors: list[dict[str, torch.Tensor]] | None = None) -> list[Path]:
        """Each embedding as output_dir/embeddings<suffix>/<token>.safetensors. `vectors`: already gathered."""
        if not self.entries:
            return []
        vectors = self.vectors(model, state_dict_of) if vectors is None else vectors
        folder = output_dir / f"embeddings{suffix}"
        targets = [folder / f"{file_stem(entry.token)}.safetensors" for entry in self.entries]
        if write:
            from ot_dist.checkpoint.modelspec import header_for, run_facts

            dtype = DTYPES[self.config.output_dtype]
            for entry, rows, target in zip(self.entries, vectors, targets, strict=True):
                header = header_for(model, "embedding", run_facts(self.config, created, suffix), None)
                copies = {} if entry.output_embedding else model.family.embedding_key_copies  # no zero rows for ComfyUI
                write_embedding_file(target, rows, entry.token, dtype, header, copies)
        return targets


def check_tokens_in_captions(entries: list[AdditionalEmbeddingConfig], captions: Iterable[str]) -> None:
    """Refuse a trained embedding whose token no training caption holds: nothing would read its vectors, so they
    would leave the run as they started, written as if trained (OneTrainer trains such a token silently). Matched as
    the captions expand it (any case; the config refuses tokens inside one another); `captions` is read only until
    every token was found, which is the first caption when a concept's caption_prefix holds them."""
    missing = {entry.token.lower(): i for i, entry in enumerate(entries) if entry.train}
    if not missing:
        return
    for caption in captions:
        lower = caption.lower()
        for token in [token for token in missing if token in lower]:
            del missing[token]
        if not missing:
            return
    i, *others = missing.values()
    raise ConfigError(
        f"additional_embeddings[{i}].token: {entries[i].token!r} is in no caption of the training concepts"
        + (f" (nor are {', '.join(repr(entries[j].token) for j in others)})" if others else "")
        + ", so its vectors would not train: write it into the captions (a concept's caption_prefix does), or set "
        "train: false for a token the sample prompts use only")
