"""A LoRA export gathers the adapters only: under fsdp and zero3 `state_dict_of` is a collective that makes each
weight whole on every rank, and the frozen model (12 B parameters for Flux) has no place in a LoRA file. The file is
the one the unfiltered state dict gives."""

from __future__ import annotations

import json

import pytest
import torch

from ot_dist.methods.lora import adapter_keys


@pytest.mark.parametrize("variant", ["lora", "loha"])
def test_a_lora_export_asks_for_its_adapters_only_and_writes_the_same_file(small_sd1, shapes_data, tmp_path, variant):
    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.methods.lora import LoraMethod
    from ot_dist.models.loading import load_model

    config = validate(base_config(small_sd1, shapes_data, tmp_path / "run", method="lora", **{
        "lora.variant": variant, "text_encoder.train": True}))
    model = load_model(config.model)
    method = LoraMethod(config)
    method.prepare(model)
    with torch.no_grad():  # trained-looking adapters (lora_B starts at zero)
        for module in (model.denoiser, *model.text_encoders.values()):
            for param in module.parameters():
                if param.requires_grad:
                    param.normal_(std=0.05)
    asked = []

    def gathering(module, keep=None):  # what a sharding strategy would make whole on every rank
        state = {k: v for k, v in module.state_dict().items() if keep is None or keep(k)}
        asked.extend(state)
        return state

    created = 1.8e9  # the files' ModelSpec date: the same for both exports
    filtered = method.export(model, tmp_path / "filtered", state_dict_of=gathering, created=created)
    adapters = [n for module in (model.denoiser, *model.text_encoders.values())
                for n, p in module.named_parameters() if p.requires_grad]
    assert adapters and sorted(asked) == sorted(adapters)  # every adapter tensor, no base weight, no buffer
    whole = method.export(model, tmp_path / "whole", state_dict_of=lambda module, keep=None: module.state_dict(),
                          created=created)
    assert [p.name for p in filtered] == [p.name for p in whole]
    for mine, reference in zip(filtered, whole):
        assert mine.read_bytes() == reference.read_bytes(), mine.name


def test_adapter_keys_pick_peft_adapter_entries():
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], use_dora=True), model, adapter_name="default")
    keep = adapter_keys(model)
    assert sorted(k for k in model.state_dict() if keep(k)) == [
        "0.lora_A.default.weight", "0.lora_B.default.weight", "0.lora_magnitude_vector.default.weight"]


def test_fsdp_gathers_only_the_kept_entries(one_rank_group, monkeypatch):
    """FSDPStrategy.state_dict_of on a 1-rank gloo group: one full_tensor per kept entry."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ot_dist.parallel.fsdp import FSDPStrategy

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    gathered = []
    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self: gathered.append(1) or full_tensor(self))
    state = FSDPStrategy.state_dict_of(None, module, keep=lambda key: key.startswith("1."))
    assert sorted(state) == ["1.bias", "1.weight"] and len(gathered) == 2
    assert state["1.weight"].shape == (3, 4) and not isinstance(state["1.weight"], DTensor)
    assert len(FSDPStrategy.state_dict_of(None, module)) == 4


def test_zero3_gathers_only_the_adapters_for_a_lora_export(one_level_sd1, shapes_data, tmp_path, one_rank_group,
                                                           monkeypatch):
    """DeepSpeedStrategy.state_dict_of under ZeRO-3, a 1-rank engine in this process (each parameter an empty
    partition outside a gather): the trainer's LoRA export gathers the adapters' parameters and nothing else, and
    writes the file the unfiltered state dict (every parameter gathered) gives."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    # ZeRO-3 keeps every parameter at or below stage3_param_persistence_threshold gathered (1e5 elements by default:
    # all of the tiny model's), where a gather does nothing; at 0 each one is partitioned after the step
    partitioned = tmp_path / "partitioned.json"
    partitioned.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "run", method="lora", strategy="zero3", batch_size=2,
                      max_steps=1, learning_rate=0.05,
                      **{"text_encoder.train": True, "deepspeed.config_file": str(partitioned)})
    trainer = Trainer(validate(raw), log=lambda *_: None)
    try:
        trainer.train()  # lora_B moves off zero
        assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE  # partitioned: empty until gathered
                   for module in trainer.model.parts().values() for p in module.parameters())
        gathered = []

        class Recorded(deepspeed.zero.GatheredParameters):
            def __init__(self, params, *args, **kwargs):
                params = list(params)
                gathered.extend(params)
                super().__init__(params, *args, **kwargs)

        monkeypatch.setattr(deepspeed.zero, "GatheredParameters", Recorded)
        filtered = trainer.export(tmp_path / "filtered")
        names = {id(p): f"{part}.{n}" for part, module in trainer.model.parts().items()
                 for n, p in module.named_parameters()}
        adapters = sorted(f"{part}.{n}" for part, module in trainer.model.parts().items()
                          for n, p in module.named_parameters() if p.requires_grad)
        assert adapters and sorted(names[id(p)] for p in gathered) == adapters  # each adapter once, no base weight
        gathered.clear()
        whole = trainer.method.export(trainer.model, tmp_path / "whole", created=trainer.run.started_at,
                                      state_dict_of=lambda module, keep=None: trainer.strategy.state_dict_of(module))
        assert len(gathered) == len(names) > len(adapters)  # the spy sees every gather
    finally:
        trainer.close()
    assert [p.name for p in filtered] == [p.name for p in whole]
    for mine, reference in zip(filtered, whole):
        assert mine.read_bytes() == reference.read_bytes(), mine.name


def test_exports_hold_one_gathered_tensor_at_a_time_and_only_the_writer_keeps_them(one_level_sd1, shapes_data,
                                                                                   tmp_path):
    """Under fsdp and zero3 on 2 gloo ranks, a full finetune (UNet and text encoder, an EMA, an additional embedding)
    exports as torch's full state dict with cpu_offload does: each gathered tensor (FSDP2's full_tensor, a ZeRO-3
    group of at most the launch's bound, an EMA parameter) is copied to CPU memory before the next gather, and only
    the writing rank keeps the copies; the other rank takes part in every gather and the export code hands it empty
    state dicts. The files are byte for byte those of every rank gathering everything at once (the rule before;
    tests/helpers/export_gather_ranks.py). A Flux 12B finetune on 8 GPUs used to gather the whole model (and the
    whole EMA) onto every device at its export."""
    import os
    from pathlib import Path

    from conftest import base_config
    from forked_ranks import run_ranks

    repo = Path(__file__).resolve().parents[1]
    token = "<tok>"
    zero3 = tmp_path / "zero3.json"  # every parameter partitioned (the tiny model's are all under the default threshold)
    zero3.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    cases = {}
    for strategy, extra in (("fsdp", {}), ("zero3", {"deepspeed.config_file": str(zero3)})):
        raw = base_config(one_level_sd1, shapes_data, tmp_path / strategy, strategy=strategy, batch_size=2, max_steps=1,
                          learning_rate=0.05, **{"optimizer.name": "SGD", "text_encoder.train": True,
                                                 "ema.enabled": True, "ema.decay": 0.5, "ema.update_step_interval": 1},
                          **extra)
        raw["additional_embeddings"] = [{"token": token, "vectors": 2}]
        raw["data"] = {"concepts": [{"path": raw["data"]["path"], "caption_prefix": token}],
                       "shards": raw["data"]["shards"]}
        cases[strategy] = raw
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    done = run_ranks(str(repo / "tests" / "helpers" / "export_gather_ranks.py"), str(tmp_path / "cases.json"),
                     str(tmp_path / "report"), env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = [json.loads((tmp_path / f"report.{rank}.json").read_text()) for rank in (0, 1)]
    for strategy in cases:
        for report in (r[strategy] for r in reports):
            where = f"{strategy}, rank {report['rank']}"
            gathers = report["gathers"]
            if strategy == "zero3":  # bounded groups: a larger parameter alone
                assert all(g["bytes"] <= report["group_limit"] or g["params"] == 1 for g in report["zero3_groups"]), \
                    (where, report["zero3_groups"])
            # the trained export gathers the weights, the EMA's gathers the EMA's parameters instead of them
            assert gathers["ema"] > 10 and (gathers["full_tensor"] if strategy == "fsdp" else gathers["zero3"]) > 10, \
                (where, gathers)
            # No gathered tensor was still alive when the next one was gathered, nor after the export.
            assert max(report["alive_at_gather"]) == 0, (where, report["alive_at_gather"])
            assert report["gathered_alive_after"] == 0 and report["hosted_alive_after"] == 0, where
            writes = report["rank"] == 0
            assert report["states"] and all(s["write"] == writes for s in report["states"]), where
            if writes:  # the writer: every state dict whole, in CPU memory, made of to_host's copies
                assert all(s["entries"] and s["on_cpu"] for s in report["states"]), (where, report["states"])
                assert report["hosted"] >= gathers["ema"] + gathers["full_tensor"], where
            else:  # the other rank: empty state dicts, nothing copied
                assert not any(s["entries"] for s in report["states"]), (where, report["states"])
                assert report["hosted"] == 0, where
        spied, reference = tmp_path / strategy / "spied", tmp_path / strategy / "reference"
        files = sorted(p.relative_to(spied) for p in spied.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
        assert any(f.name == "model_ema.safetensors" for f in files) and any("embeddings_ema" in str(f) for f in files)
        for file in files:
            assert (spied / file).read_bytes() == (reference / file).read_bytes(), f"{strategy}: {file}"
