"""Which of a transformers model's weights are tied to another (T5's `encoder.embed_tokens.weight` is `shared.weight`).

transformers 5's `all_tied_weights_keys` holds the ties the loaded config makes: empty where the config unties them, as
Qwen2.5-VL's `lm_head`, which is then a weight of its own that must be read and written. `_tied_weights_keys` lists
the ties the class may make whatever the config says, so it is only a fallback for a model without the former."""

from __future__ import annotations

from typing import Mapping


def tied_weights(model) -> Mapping[str, str]:
    """{tied copy: the key it shares its storage with}; {} for a model (or a diffusers module) without ties."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:
        tied = getattr(model, "_tied_weights_keys", None) or {}
    return tied if isinstance(tied, Mapping) else {}
