"""`distributed.load_ranks_per_node` (ot_dist/parallel/load_turns.py): the ranks of a node load the model a few at a
time, as many as the node's memory holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import base_config
from forked_ranks import run_ranks
from safetensors.torch import save_file

from ot_dist.config.load import validate
from ot_dist.parallel import load_turns

REPO = Path(__file__).resolve().parents[1]


def test_the_size_of_a_model_as_read_comes_from_its_files_headers(tmp_path):
    (tmp_path / "transformer").mkdir()
    save_file({"w": torch.zeros(10, 10, dtype=torch.bfloat16), "ids": torch.zeros(3, dtype=torch.int64)},
              tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
    save_file({"v": torch.zeros(4, 4)}, tmp_path / "vae.safetensors")
    (tmp_path / "notes.safetensors").write_bytes(b"not a safetensors file")  # the loader names it, not this
    # a variant beside the plain weights is not read; one alone (a folder shipped in fp16 only) is
    save_file({"w": torch.zeros(10, 10, dtype=torch.float16)},
              tmp_path / "transformer" / "diffusion_pytorch_model.fp16.safetensors")
    (tmp_path / "text_encoder").mkdir()
    save_file({"e": torch.zeros(5, dtype=torch.float16)},
              tmp_path / "text_encoder" / "model.fp16-00001-of-00001.safetensors")
    # each component at the width it is read in: the bfloat16 transformer in 2 bytes, the float16-only encoder in 2
    assert load_turns.load_bytes_of(tmp_path) == 100 * 2 + 3 * 8 + 16 * 4 + 5 * 2
    assert load_turns.load_bytes_of(tmp_path / "vae.safetensors") == 16 * 4
    # a full finetune's float32 masters of the transformer
    assert load_turns.load_bytes_of(tmp_path, {"transformer": 4}) == 100 * 4 + 3 * 8 + 16 * 4 + 5 * 2
    save_file({"w": torch.zeros(10, 10, dtype=torch.bfloat16)}, tmp_path / "flux1.safetensors")
    assert load_turns.load_bytes_of(tmp_path / "flux1.safetensors") == 100 * 2
    assert load_turns.load_bytes_of(tmp_path / "flux1.safetensors", {"transformer": 4}) == 100 * 4


def test_a_full_finetunes_trained_parts_count_at_their_masters_width(shapes_data, tmp_path):
    def widths(**overrides):
        return load_turns.master_widths(validate(base_config(tmp_path, shapes_data, tmp_path / "o", family="sdxl",
                                                             **overrides)))

    assert widths(method="full") == {"unet": 4}
    assert widths(method="full", **{"text_encoder.train": True}) == {"unet": 4, "text_encoder": 4}
    assert widths(method="full", trained_weight_dtype="bfloat16", train_dtype="bfloat16") == {"unet": 2}
    assert widths(method="lora") == {}


def test_available_memory_is_the_lesser_of_the_machine_and_the_container(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemAvailable:   100000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert load_turns.available_memory(str(meminfo), str(cgroup)) == 100000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert load_turns.available_memory(str(meminfo), str(cgroup)) == 100000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{64 * 2**30}\n")
    assert load_turns.available_memory(str(meminfo), str(cgroup)) == 64 * 2**30 - 1000
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{32 * 2**30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{2 * 2**30}\n")
    assert load_turns.available_memory(str(tmp_path / "none"), str(v1)) == 30 * 2**30
    assert load_turns.available_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_as_many_ranks_load_at_once_as_the_memory_holds():
    flux = 68 * 2**30  # Flux.1 dev with its text encoders and VAE, in float32
    assert load_turns.ranks_at_once(flux, 128 * 2**30, 4) == 1  # a 4-GPU workstation
    assert load_turns.ranks_at_once(flux, 512 * 2**30, 8) == 6
    assert load_turns.ranks_at_once(flux, 2048 * 2**30, 8) == 8
    assert load_turns.ranks_at_once(flux, 10 * 2**30, 8) == 1  # never none
    assert load_turns.ranks_at_once(flux, None, 8) == 8 and load_turns.ranks_at_once(0, 2**30, 8) == 8


def test_the_setting_is_a_count_or_auto(tiny_models, shapes_data, tmp_path):
    from ot_dist.errors import ConfigError

    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path)
    assert validate(raw).distributed.load_ranks_per_node == "auto"
    assert validate({**raw, "distributed": {"load_ranks_per_node": 2}}).distributed.load_ranks_per_node == 2
    for wrong in (0, "some"):
        try:
            validate({**raw, "distributed": {"load_ranks_per_node": wrong}})
        except ConfigError as error:
            assert "load_ranks_per_node" in str(error)
        else:
            raise AssertionError(f"{wrong!r} was accepted")


def test_two_ranks_load_in_turns(tiny_models, shapes_data, tmp_path):
    """A rank's turn ends once its CPU copy of the model is gone: placed (ddp), or under fsdp sharded, which moves
    the trained modules to the device a unit at a time (Strategy.shards_while_placing)."""
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", method="lora", strategy="ddp", max_steps=1,
                      **{"distributed.load_ranks_per_node": 1})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    sharded = {**raw, "strategy": "fsdp", "method": "full", "output_dir": str(tmp_path / "fsdp")}
    (tmp_path / "fsdp.json").write_text(json.dumps(sharded))
    done = run_ranks(REPO / "tests" / "helpers" / "load_turn_ranks.py", tmp_path / "config.json",
                     tmp_path / "result.json", tmp_path / "fsdp.json", timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((tmp_path / "result.json").read_text())
    (a, b), (c, d) = results["one"]
    assert b <= c, results["one"]  # rank 1 started after rank 0 had finished
    (a, b), (c, d) = results["two"]
    assert c < b and a < d, results["two"]  # together
    (a, b), (c, d) = results["trainer"]["windows"]
    assert b <= c, results["trainer"]["windows"]  # load_model to the end of placing: rank 0's, then rank 1's
    assert "loading: 1 of the 2 ranks of a node at a time, 2 turns" in results["trainer"]["logged"]
    (a, b), (c, d) = results["fsdp"]
    assert b <= c, results["fsdp"]  # load_model to the end of sharding: rank 0's, then rank 1's
