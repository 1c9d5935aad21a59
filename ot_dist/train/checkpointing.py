"""Activation checkpointing of a component, whichever library built it (the trainer and `ot-dist bench` use it)."""

from __future__ import annotations

import torch


def enable_gradient_checkpointing(module: torch.nn.Module) -> None:
    if hasattr(module, "enable_gradient_checkpointing"):  # diffusers models
        module.enable_gradient_checkpointing()
    elif hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(module, "gradient_checkpointing_enable"):  # older transformers
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
