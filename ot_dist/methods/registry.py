"""Which class implements each `method` of the config (kept apart from base.py, which the methods import)."""

from __future__ import annotations

from ot_dist.config.schema import TrainConfig
from ot_dist.methods.base import TrainingMethod
from ot_dist.methods.embedding import EmbeddingMethod
from ot_dist.methods.full import FullFinetune
from ot_dist.methods.lora import LoraMethod

METHODS: dict[str, type[TrainingMethod]] = {"full": FullFinetune, "lora": LoraMethod, "embedding": EmbeddingMethod}


def build_method(config: TrainConfig) -> TrainingMethod:
    return METHODS[config.method](config)
