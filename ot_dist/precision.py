"""Dtypes by config name, and the autocast / loss-scaling policy of a training step."""

from __future__ import annotations

import contextlib

import torch

from ot_dist.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Precision:
    """Forward/backward run under autocast in `train_dtype`; float16 adds dynamic loss scaling so small
    gradients do not flush to zero. Trainable weights stay float32 (master weights)."""

    def __init__(self, train_dtype: str, device: torch.device):
        self.dtype = DTYPES[train_dtype]
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if self.dtype == torch.float16 else None

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step when gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()


def set_tf32(enabled: bool) -> None:
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


HALF_DTYPES = ("float16", "bfloat16")


def check_storage_on_device(config, device: torch.device) -> None:
    """Refuse, naming the field, frozen weights stored in one half dtype while computing in the other on the CPU: CPU
    autocast runs normalization layers (LayerNorm, GroupNorm) in their input's dtype with the weights as stored, and
    the CPU kernels take no float16 weight beside bfloat16 activations (nor the reverse). CUDA autocast computes them
    in float32 and takes any storage. Checked before anything is loaded."""
    compute = config.train_dtype
    if device.type != "cpu" or compute not in HALF_DTYPES:
        return
    frozen = ["vae", *(name for name in config.part_names() if not config.part_trains(name))]
    for name in frozen:
        storage = config.component_storage(name)
        if storage in HALF_DTYPES and storage != compute:
            raise ConfigError(f"{config.storage_field(name)}: {storage} storage computing in train_dtype {compute} runs on CUDA only: on "
                              f"the CPU the normalization layers of the {name} would get {storage} weights beside "
                              f"{compute} activations; store it as {compute} or float32 here")
