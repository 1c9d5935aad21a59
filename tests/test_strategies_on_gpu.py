"""Every strategy on one CUDA device, its process group NCCL beside gloo as a GPU run makes it (`pytest -m gpu`, issue
21): the code paths the CPU suite cannot take (CUDA-only defaults such as channels_last, NCCL collectives, the
device's own placement) start, train and export. A UNet family with its GPU defaults stopped under fsdp and every
ZeRO stage at start-up once (its channels_last weights, docs/performance.md), and no CPU test could see it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import base_config

STRATEGIES = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3")


def train_on_the_gpu(model, data, out, strategy, **overrides) -> list[float]:
    import torch.distributed as dist

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    raw = base_config(model, data, out, strategy=strategy, train_dtype="bfloat16", batch_size=2, max_steps=3,
                      **overrides)
    trainer = Trainer(validate(raw), log=lambda *_: None)
    try:
        assert trainer.device.type == "cuda"
        return trainer.train().losses
    finally:
        trainer.close()
        if dist.is_initialized():  # a group the trainer did not end would be found by the next strategy's
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_runs(family_models, shapes_data, tmp_path_factory):
    """family -> the losses of strategy single on the GPU, run when first asked for."""
    runs = {}

    def losses(family: str, method: str) -> list[float]:
        if family not in runs:
            runs[family] = train_on_the_gpu(family_models[family], shapes_data, tmp_path_factory.mktemp("single"),
                                            "single", family=family, method=method)
        return runs[family]

    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family, method", [("sd1", "full"), ("flux", "lora")])
def test_every_strategy_trains_on_one_gpu(family, method, strategy, single_runs, family_models, shapes_data, tmp_path):
    if strategy.startswith("zero"):
        pytest.importorskip("deepspeed", reason="ZeRO needs DeepSpeed (launch/gpu_wheels.sh builds its wheel)")
    losses = train_on_the_gpu(family_models[family], shapes_data, tmp_path, strategy, family=family, method=method)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    # one rank, the same batch and start weights as strategy single: the first losses differ by bfloat16 rounding only
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(single_runs(family, method)[0]), rtol=2e-2, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp_with_cpu_offload_holds_one_unit_on_the_gpu_while_it_starts(small_sd1, shapes_data, tmp_path):
    """FSDP2 moves each unit to the device, shards it and (fsdp.cpu_offload) sends the shard to CPU memory before the
    next unit moves (Strategy.shards_while_placing): the GPU's peak while the trainer starts is about one unit (twice:
    the unit and its shard's copy), not the whole UNet the trainer once placed before sharding."""
    from ot_dist.config.load import validate
    from ot_dist.memory.sharding import sharding
    from ot_dist.train.trainer import Trainer

    raw = base_config(small_sd1, shapes_data, tmp_path / "run", strategy="fsdp", max_steps=1,
                      offload_frozen_components=True, **{"fsdp.cpu_offload": True})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    trainer = Trainer(validate(raw), log=lambda *_: None)
    try:
        peak = torch.cuda.max_memory_allocated() - before
        unet = trainer.model.denoiser
        split = sharding(unet, tuple(trainer.model.family.shard_units["unet"]))
        whole, largest = split.parameters * 4, split.largest * 4  # float32 masters (DTensors report global shapes)
        assert largest < 0.4 * whole
        assert peak <= 2.5 * largest, f"{peak} bytes at the peak; the largest unit is {largest}, the UNet {whole}"
    finally:
        trainer.close()  # a group it leaves is ended by conftest's no_process_group_left_behind
