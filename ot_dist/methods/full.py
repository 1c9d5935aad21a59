"""Full finetune: the denoiser and/or text encoders train in full (fp32 master weights)."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path

from ot_dist.checkpoint.export import export_diffusers_folder
from ot_dist.checkpoint.frozen_source import export_source
from ot_dist.errors import ConfigError
from ot_dist.methods.base import ParamGroup, TrainingMethod, freeze_all, plain_state_dict, trainable
from ot_dist.methods.token_vectors import without_token_rows
from ot_dist.models.loading import LoadedModel
from ot_dist.precision import DTYPES


class FullFinetune(TrainingMethod):
    def prepare(self, model: LoadedModel) -> list[ParamGroup]:
        from ot_dist.methods.weight_block_casts import cast_weights_per_block
        from ot_dist.parallel.fsdp import family_units

        freeze_all(model)
        groups = []
        for part in self.config.part_names():
            if self.config.part_trains(part):
                module = model.part(part)
                module.requires_grad_(True)
                if not self.config.performance.float8_matmuls:  # Float8Linear replaces the Linear layers
                    cast_weights_per_block(module, family_units(model.family, part, module))
                groups.append(
                    ParamGroup(part, trainable(module), self.config.part_learning_rate(part), part=part)
                )
        if self.additional:  # the tokenizers as loaded, for the exported model (the new tokens go to their own files)
            self.plain_tokenizers = {name: copy.deepcopy(t) for name, t in model.tokenizers.items()}
        return groups + self.additional.prepare(model)

    formats = ("diffusers", "single-file")

    def export(
        self, model: LoadedModel, output_dir: Path, state_dict_of=plain_state_dict, write=True, suffix="",
        created: float | None = None, formats: tuple[str, ...] = formats,
    ) -> list[Path]:
        """`formats`: "diffusers" (a folder from_pretrained loads) and / or "single-file" (one .safetensors)."""
        if "single-file" in formats and not model.family.single_file:
            if tuple(formats) != self.formats:  # asked for by name (ot-dist export --format single-file)
                raise ConfigError(f"--format single-file: {model.family.name} models have no single-file layout in "
                                  "ot_dist; export the diffusers folder")
            formats = tuple(f for f in formats if f != "single-file")
        dtype = DTYPES[self.config.output_dtype]
        embeddings = self.additional.export(model, output_dir, state_dict_of, write, suffix, created)
        if self.additional:  # the model as loaded, with its own vocabulary: the new rows are in the embedding files
            encoders = {id(m) for m in model.text_encoders.values()}
            gather = state_dict_of
            state_dict_of = lambda m: without_token_rows(gather(m)) if id(m) in encoders else gather(m)  # noqa: E731
        with self._plain_tokenizers(model):
            paths = self._export_model(model, output_dir, state_dict_of, write, suffix, created, formats, dtype)
        return paths + embeddings

    @contextmanager
    def _plain_tokenizers(self, model: LoadedModel):
        """The pipeline's tokenizers as loaded while the model is exported (the trained ones know the additional
        embeddings' tokens, which the exported text encoders have no rows for)."""
        plain = getattr(self, "plain_tokenizers", {})
        trained = {name: getattr(model.pipeline, name) for name in plain}
        for name, tokenizer in plain.items():
            setattr(model.pipeline, name, tokenizer)
        try:
            yield
        finally:
            for name, tokenizer in trained.items():
                setattr(model.pipeline, name, tokenizer)

    def _export_model(self, model, output_dir, state_dict_of, write, suffix, created, formats, dtype) -> list[Path]:
        trained = {part for part in model.parts() if self.config.part_trains(part)}
        if ("single-file" in formats and "diffusers" not in formats and trained & set(model.text_encoders)
                and not model.family.single_file_text_encoders):  # the trained text encoder would be in no file
            raise ConfigError(f"--format single-file: a {model.family.name} single file holds the denoiser alone and "
                              "this run trained a text encoder; export the diffusers folder too")
        # Gathered once, used by both exports (under sharding, gathering is the expensive part). What did not train
        # is written as the user loaded it, never as the rounded copy low-memory storage held (frozen_source.py).
        source = export_source(model, self.config.model, trained, state_dict_of, write)
        folder, single = output_dir / f"model{suffix}", output_dir / f"model{suffix}.safetensors"
        if write and "diffusers" in formats:
            export_diffusers_folder(source.pipeline, folder, dtype, source.states, family=model.family)
        if write and "single-file" in formats:
            # Trained text encoders belong in the file (for the transformer families a full checkpoint then).
            model.family.export_single_file(source.components, source.states, single, dtype,
                                            with_text_encoders=bool(trained & set(model.text_encoders)),
                                            metadata=self.modelspec(model, "checkpoint", created, suffix))
        return [path for path, name in ((folder, "diffusers"), (single, "single-file")) if name in formats]
