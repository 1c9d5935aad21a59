"""What a training method is: which parameters train, how captions change, how results are saved."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ot_dist.config.schema import TrainConfig
from ot_dist.memory.stored import kept_entries
from ot_dist.models.loading import LoadedModel


@dataclass
class ParamGroup:
    name: str  # logged as lr/<name>; the part ("unet", "transformer", "text_encoder", ...), "embedding" or
    # "embedding/<token>" (an additional embedding)
    params: list[torch.nn.Parameter]
    learning_rate: float
    part: str | None = None  # the config part whose stop_training_after applies, if any


class TrainingMethod:
    """Base: freezes everything. Subclasses make their parameters trainable in `prepare`."""

    formats: tuple[str, ...] = ()  # what `export` writes (`ot-dist export --format` picks among them)

    def __init__(self, config: TrainConfig):
        from ot_dist.methods.additional_embeddings import AdditionalEmbeddings

        self.config = config
        self.additional = AdditionalEmbeddings(config)  # trained beside any method (pivotal tuning)

    def prepare(self, model: LoadedModel) -> list[ParamGroup]:
        raise NotImplementedError

    def caption(self, caption: str) -> str:
        """A training caption as the tokenizers read it: each embedding's token expanded to its words."""
        from ot_dist.methods.token_vectors import expand_in_caption

        return expand_in_caption(caption, self.expansions())

    def expansions(self) -> dict[str, str]:
        """token -> the words it stands for ("tok tok_1 ..."), of every embedding this run trains or uses."""
        return self.additional.expansions()

    def export(
        self, model: LoadedModel, output_dir: Path, state_dict_of=None, write: bool = True, suffix: str = "",
        created: float | None = None,
    ) -> list[Path]:
        """Save what was trained. `state_dict_of(module, keep=None)` returns a module's full state dict, or the
        entries whose key `keep` accepts (a collective under sharding strategies, so every rank calls export); only
        `write` ranks write.
        `suffix` goes after the file / folder stem ("_ema": model_ema/, lora_ema.safetensors). `created`: the run's
        start, the date of the files' ModelSpec header (ot_dist/checkpoint/modelspec.py; None = now)."""
        raise NotImplementedError

    def modelspec(self, model: LoadedModel, kind: str, created: float | None, suffix: str,
                  lora_layout: str | None = None) -> dict[str, str]:
        """The `modelspec.*` header of one exported file of this run."""
        from ot_dist.checkpoint.modelspec import header_for, run_facts

        return header_for(model, kind, run_facts(self.config, created, suffix), lora_layout)


KeyFilter = Callable[[str], bool]  # which entries of a state dict an export needs


def kept(state: dict[str, torch.Tensor], keep: KeyFilter | None) -> dict[str, torch.Tensor]:
    return state if keep is None else {k: v for k, v in state.items() if keep(k)}


def kept_state_dict(module: torch.nn.Module, keep: KeyFilter | None, **options) -> dict[str, torch.Tensor]:
    """`module.state_dict(**options)`, of the entries `keep` accepts: the stored (float8 / nf4 / int8) weights it
    drops are never dequantized (memory/stored.py kept_entries), so a LoRA export of a quantized base holds its
    adapters, not the base in float32."""
    if keep is None:
        return module.state_dict(**options)
    with kept_entries(keep):
        return kept(module.state_dict(**options), keep)


def plain_state_dict(module: torch.nn.Module, keep: KeyFilter | None = None) -> dict[str, torch.Tensor]:
    return kept_state_dict(module, keep)


def freeze_all(model: LoadedModel) -> None:
    for module in model.modules():
        module.requires_grad_(False)


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]

