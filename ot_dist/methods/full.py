"""Full finetune: the UNet and/or text encoders train in full (fp32 master weights)."""

from __future__ import annotations

from pathlib import Path

from ot_dist.checkpoint.export import export_diffusers_folder
from ot_dist.methods.base import ParamGroup, TrainingMethod, freeze_all, trainable
from ot_dist.models.loading import LoadedModel
from ot_dist.models.single_file import export_single_file
from ot_dist.precision import DTYPES


class FullFinetune(TrainingMethod):
    def prepare(self, model: LoadedModel) -> list[ParamGroup]:
        freeze_all(model)
        groups = []
        for part in self.config.part_names():
            if self.config.part_trains(part):
                module = model.part(part)
                module.requires_grad_(True)
                groups.append(
                    ParamGroup(part, trainable(module), self.config.part_learning_rate(part), part=part)
                )
        return groups

    def export(self, model: LoadedModel, output_dir: Path) -> list[Path]:
        dtype = DTYPES[self.config.output_dtype]
        folder = export_diffusers_folder(model.pipeline, output_dir / "model", dtype)
        components = {"unet": model.unet, "vae": model.vae, **model.text_encoders}
        single = export_single_file(components, model.spec.family, output_dir / "model.safetensors", dtype=dtype)
        return [folder, single]
