"""Activation checkpointing of a component, whichever library built it (the trainer and `ot-dist bench` use it)."""

from __future__ import annotations

import torch


def enable_gradient_checkpointing(module: torch.nn.Module, offload_activations: bool = False) -> None:
    """`offload_activations` (a diffusers model: the denoiser): the checkpointed blocks' inputs wait in CPU memory
    (train/activation_offload.py)."""
    if hasattr(module, "enable_gradient_checkpointing"):  # diffusers models
        if offload_activations:
            from ot_dist.train.activation_offload import diffusers_checkpointing_function

            module.enable_gradient_checkpointing(gradient_checkpointing_func=diffusers_checkpointing_function)
        else:
            module.enable_gradient_checkpointing()
    elif hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(module, "gradient_checkpointing_enable"):  # older transformers
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
