"""The CUDA caching allocator's settings for a training process (`performance.expandable_segments`).

With fixed-size segments, a run whose batch shapes change (aspect buckets, multi-resolution) strands memory that is
reserved but too fragmented to use, until an allocation fails with plenty of memory "free". Expandable segments map
physical pages into one growing virtual range instead. The setting is read each time the allocator creates a
segment, so setting it at start-up, before the model is placed, covers what training allocates.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from ot_dist.config.performance import PerformanceConfig

# torch reads the first; the second is its older name, still honoured.
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def allocator_settings(options: PerformanceConfig, device: torch.device,
                       environ: Mapping[str, str] = os.environ) -> str | None:
    """What to set, or None: not on CUDA, not asked for, or the user configured the allocator already."""
    if device.type != "cuda" or not options.expandable_segments:
        return None
    if any(environ.get(name) for name in ALLOCATOR_ENV):
        return None
    return EXPANDABLE


def configure_cuda_allocator(options: PerformanceConfig, device: torch.device) -> str | None:
    settings = allocator_settings(options, device)
    if settings:
        set_allocator_settings(settings)
    return settings


def set_allocator_settings(settings: str) -> None:
    """The accelerator-wide setter where torch has it (2.11+; the CUDA one warns there that it is deprecated, on every
    GPU run), else the CUDA one."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)
