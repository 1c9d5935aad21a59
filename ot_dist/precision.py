"""Dtypes by config name, and the autocast / loss-scaling policy of a training step."""

from __future__ import annotations

import contextlib

import torch

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
