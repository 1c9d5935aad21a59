"""`ot-dist init` (issue 22): a starting config chosen from the memory table. Every preset over a grid of families,
methods, GPU sizes and counts validates as a config, fits the memory it was chosen for, and is the least lossy
setup of the table that fits (a less lossy one would not)."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from ot_dist.cli import main
from ot_dist.config.load import load_config
from ot_dist.errors import ConfigError
from ot_dist.models.families.registry import FAMILY_NAMES, get_family
from ot_dist.starter.choose import candidates, choose

MEMORY = (8, 12, 16, 24, 48, 80)


def init(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["init", *map(str, args)])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("method", ["lora", "full", "embedding"])
def test_every_preset_validates_and_fits(family, method, tmp_path):
    if get_family(family).memory_reference is None:  # no memory-table row yet (PixArt): refused by name
        code, _, err = init("--family", family, "--method", method, "--gpu-memory", 24, "--data", tmp_path,
                            "--out", tmp_path / "x.yaml")
        assert code != 0 and "--family" in err and "no memory reference" in err, err
        return
    checked = 0
    for gpus in (1, 8):
        for gib in MEMORY:
            target = tmp_path / f"{gpus}x{gib}.yaml"
            code, _, err = init("--family", family, "--method", method, "--gpu-memory", gib, "--gpus", gpus,
                                "--data", tmp_path, "--out", target)
            if code != 0:
                # refused: too little memory for any setup (named), or the method does not apply to the family
                assert "--gpu-memory" in err or "embedding" in err, err
                continue
            config = load_config(str(target), [])  # validates
            choice = choose(get_family(family), method, gib, gpus)
            assert choice.need_gib <= gib
            assert config.weight_dtype == choice.setup.frozen
            assert config.optimizer.name == choice.setup.optimizer
            assert config.offload_frozen_components == choice.setup.offload
            assert config.strategy == choice.strategy
            # streamed blocks: the share of the denoiser's blocks the row counts in CPU memory, checkpointing on
            assert getattr(config, get_family(family).denoiser).offload_fraction == choice.setup.streamed
            assert config.gradient_checkpointing or not choice.setup.streamed
            assert config.resolution == get_family(family).native_resolution
            # caches the family refuses (Qwen-Image-Edit's) stay off, whatever the setup
            assert not any(getattr(config.data, option) for option in get_family(family).cache_refusals)
            # regional compilation where it was measured on GPUs: bfloat16 / float8 frozen weights, nothing streamed
            assert config.performance.compile == (choice.setup.frozen in ("bfloat16", "float8")
                                                  and not choice.setup.streamed and not choice.setup.fused_back_pass)
            raw = yaml.safe_load(target.read_text())
            assert raw["method"] == method
            checked += 1
    assert checked or method == "embedding"


def test_the_least_lossy_setup_that_fits_is_chosen():
    sdxl = get_family("sdxl")
    order = [s.label for s in candidates("lora")]
    previous = len(order)
    for gib in (8, 10, 12, 16, 24, 48):  # more memory never chooses a lossier setup
        index = order.index(choose(sdxl, "lora", gib, 1).setup.label)
        assert index <= previous
        previous = index
    big = choose(sdxl, "lora", 24, 1)
    assert big.setup.frozen == "bfloat16" and not big.setup.offload
    small = choose(sdxl, "lora", 8, 1)
    assert small.setup.frozen == "float8"  # bf16 frozen SDXL (7.1 GiB in the table) + activations is over 8
    # a full Flux finetune on 8 x 80 GiB keeps exact AdamW by sharding it, rather than a lossy optimizer on one GPU
    flux = choose(get_family("flux"), "full", 80, 8)
    assert (flux.strategy, flux.setup.optimizer) == ("fsdp", "ADAMW")
    # on one 12 GiB GPU its blocks' trained weights stream, stepped in backward (OneTrainer's FINE_TUNE presets)
    streamed = choose(get_family("flux"), "full", 12, 1)
    assert streamed.setup.streamed and streamed.setup.fused_back_pass and streamed.setup.optimizer == "ADAFACTOR"
    # and on 8 of them the same, under ddp (each gradient averaged inside backward: parallel/fused_reduce.py)
    eight = choose(get_family("flux"), "full", 12, 8)
    assert (eight.strategy, eight.setup) == ("ddp", streamed.setup)
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(get_family("flux"), "full", 4, 1)


def test_the_issue_example_prints_the_row_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "sdxl.yaml"
    code, _, err = init("--family", "sdxl", "--method", "lora", "--gpu-memory", 24, "--data", tmp_path, "--out", target)
    assert code == 0
    assert "'LoRA r16, frozen bfloat16'" in err and "7.10 GiB in the memory table (SDXL)" in err
    assert "# Memory table row (SDXL): 'LoRA r16, frozen bfloat16' = 7.10 GiB" in target.read_text()
    code, _, err = init("--family", "sdxl", "--method", "lora", "--gpu-memory", 24, "--data", tmp_path, "--out", target)
    assert code != 0 and "--force" in err


def test_streamed_rows_count_the_blocks_training_streams():
    """The memory table's streamed setups take away the bytes of the blocks that training streams (the family's
    units, chosen by memory/block_streaming.streamed_blocks from their frozen bytes) and add back the largest three
    times, the most tests/test_block_streaming.py finds on the device at once; a GPU too small for the whole float8
    transformer gets them."""
    from ot_dist.memory.block_streaming import streamed_blocks
    from ot_dist.memory.table import DENOISERS, SETUPS, build_components, model_sizes, setup_bytes
    from ot_dist.parallel.fsdp import family_units

    flux = get_family("flux")
    components = build_components(flux.memory_reference)
    sizes = model_sizes(components, *DENOISERS[flux.memory_reference][1:])
    transformer = components["transformer"].requires_grad_(False)  # a LoRA's base: every block parameter frozen
    units = family_units(flux, "transformer", transformer)
    streamed = next(s for s in SETUPS if s.streamed and s.frozen == "float8")
    whole = next(s for s in SETUPS if s.offload and s.frozen == "float8" and not s.streamed)
    chosen = streamed_blocks(units, streamed.streamed)
    assert 0 < len(chosen) < len(units) and chosen == units[-len(chosen):]
    counts = [sum(p.numel() for p in block.parameters()) for block in chosen]  # float8: one byte each
    assert setup_bytes(streamed, sizes) == setup_bytes(whole, sizes) - sum(counts) + 3 * max(counts)
    choice = choose(flux, "lora", 16, 1)
    assert choice.setup == streamed and choice.gradient_checkpointing
