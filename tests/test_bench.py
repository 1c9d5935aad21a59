"""`ot-dist bench`: the tiny models end to end on CPU through the CLI, the FLOP count against the published
per-image figures on meta-device builds of the real configs, and the checks that refuse a wrong count."""

from __future__ import annotations

import json

import pytest
import torch

from ot_dist.bench.architectures import BENCH_MODELS
from ot_dist.bench.flops import FlopCountError, check_step_flops, count_step_flops
from ot_dist.bench.setup import BenchOptions, prepare, train_config
from ot_dist.cli import main


def meta_flops(model: str, method: str, resolution: int):
    bench = BENCH_MODELS[model]
    options = BenchOptions(model=model, method=method, resolution=resolution)
    run = prepare(bench, options, train_config(bench, options, "unused"), torch.device("meta"), with_optimizer=False)
    return run, count_step_flops(run.loss, run.backward)


def test_tiny_bench_runs_through_the_cli_and_reports(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--model", "tiny-sd15", "--method", "full", "--resolution", "32", "--batch-size", "2",
                 "--steps", "3", "--warmup", "0", "--dtype", "fp32", "--device", "cpu", "--peak-tflops", "0.5",
                 "--out", str(out)])
    assert code == 0
    [json_file] = out.glob("*.json")
    result = json.loads(json_file.read_text())
    assert result["model"] == "tiny-sd15" and result["method"] == "full" and result["device"] == "cpu"
    times = result["step_times_s"]
    assert len(times) == 3 and all(t > 0 for t in times)
    assert result["step_time_median_s"] == sorted(times)[1]  # the first (cold) step is not the median
    assert result["step_time_mean_s"] == pytest.approx(sum(times) / 3)
    assert result["images_per_s"] == pytest.approx(2 / result["step_time_median_s"], rel=1e-9)
    assert result["params_trained"] == result["params_total"] > 0  # full finetune: the whole UNet trains
    assert result["peak_memory_kind"] == "cpu_peak_rss" and result["peak_memory_bytes"] > 10 * 2**20
    assert 2.6 < result["flops_train_per_step"] / result["flops_forward_per_step"] < 3.4
    assert result["peak_flops"] == 0.5e12
    expected_mfu = result["flops_train_per_step"] / result["step_time_median_s"] / 0.5e12
    assert result["mfu"] == pytest.approx(expected_mfu) and 0 < result["mfu"] < 1
    assert result["final_loss"] > 0
    printed = capsys.readouterr().out
    table = (out / "bench.md").read_text().splitlines()
    assert table[0].startswith("| model | method") and table[2].startswith("| tiny-sd15 | full | 32 | 2 | fp32")
    assert table[2] in printed


def test_tiny_lora_bench_trains_only_the_adapters_and_has_no_mfu_on_cpu(tmp_path):
    from ot_dist.bench.run import run_bench

    result = run_bench(BenchOptions(model="tiny-flux-dev", method="lora", lora_rank=4, resolution=32, batch_size=1,
                                    steps=1, warmup=0, dtype="fp32", device="cpu"), str(tmp_path), log=lambda *_: None)
    assert 0 < result["params_trained"] < result["params_total"] / 2
    assert result["mfu"] is None and result["peak_flops"] is None  # no peak known for a CPU


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: must be at least 1"),
    (["--resolution", "40"], "--resolution: 40 is not a multiple of 16, the pixel grid of flux latents"),
    (["--optimizer", "nonsense"], "optimizer.name"),
])
def test_bad_options_are_named(tmp_path, capsys, argv, message):
    code = main(["bench", "--model", "tiny-flux-dev", "--device", "cpu", "--out", str(tmp_path), *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_sdxl_flops_match_the_published_figures():
    _, full = meta_flops("sdxl", "full", 1024)
    assert full.forward / 1e12 == pytest.approx(6.76, rel=0.03)
    assert full.train / 1e12 == pytest.approx(20.2, rel=0.03)
    _, lora = meta_flops("sdxl", "lora", 1024)
    assert lora.train / 1e12 == pytest.approx(14.2, rel=0.03)
    assert lora.train < full.train
    check_step_flops(full, "full")
    check_step_flops(lora, "lora")


def test_flux_dev_flops_match_the_published_figures():
    _, full = meta_flops("flux-dev", "full", 1024)
    assert full.forward / 1e12 == pytest.approx(74.4, rel=0.03)
    assert full.train / 1e12 == pytest.approx(223, rel=0.03)


def test_a_count_without_backward_is_refused():
    run, counted = meta_flops("tiny-sd15", "full", 32)
    check_step_flops(counted, "full")
    forward_only = count_step_flops(run.loss, lambda loss: None)  # backward never runs
    assert forward_only.train == forward_only.forward
    with pytest.raises(FlopCountError, match="is the backward pass counted"):
        check_step_flops(forward_only, "full")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method, dtype", [("lora", "bf16"), ("full", "bf16"), ("full", "fp16")])
def test_tiny_bench_on_cuda_gives_a_finite_mfu(tmp_path, method, dtype):
    import math

    from ot_dist.bench.run import run_bench

    result = run_bench(BenchOptions(model="tiny-sdxl", method=method, resolution=64, batch_size=2, steps=3,
                                    warmup=1, dtype=dtype, device="cuda", peak_tflops=100.0), str(tmp_path),
                       log=lambda *_: None)
    assert result["peak_memory_kind"] == "cuda_max_allocated" and result["peak_memory_bytes"] > 0
    assert math.isfinite(result["mfu"]) and 0 < result["mfu"] < 1
    assert math.isfinite(result["final_loss"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_autocast_step_on_cuda_keeps_float32_masters():
    bench = BENCH_MODELS["tiny-flux-dev"]
    options = BenchOptions(model="tiny-flux-dev", method="full", resolution=64, batch_size=2, dtype="bf16")
    run = prepare(bench, options, train_config(bench, options, "unused"), torch.device("cuda"))
    before = [p.detach().clone() for p in run.params]
    with run.strategy.autocast():
        prediction_dtype = run.model.denoiser(**_flux_probe(run)).sample.dtype
    assert prediction_dtype == torch.bfloat16
    loss = run.step()
    assert torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in run.params)
    assert any(not torch.equal(b, p) for b, p in zip(before, run.params))


def _flux_probe(run) -> dict:
    from ot_dist.models.families.flux import image_ids, pack

    latents = run.batch["latent_mean"]
    hidden = run.batch["text_hidden"]
    h, w = latents.shape[-2:]
    return dict(hidden_states=pack(latents), timestep=torch.full((latents.shape[0],), 0.5, device=latents.device),
                encoder_hidden_states=hidden, pooled_projections=run.batch["text_pooled"],
                txt_ids=torch.zeros(hidden.shape[1], 3, device=latents.device), img_ids=image_ids(h, w, latents.device,
                                                                                                   latents.dtype),
                guidance=torch.ones(latents.shape[0], device=latents.device))


def test_bench_applies_performance_options_and_reports_them(tmp_path, capsys):
    """`--performance KEY=VALUE` sets the config's performance section for the bench's model, as in training."""
    out = tmp_path / "bench"
    code = main(["bench", "--model", "tiny-sd15", "--method", "lora", "--resolution", "32", "--steps", "1",
                 "--warmup", "0", "--dtype", "fp32", "--device", "cpu", "--no-flops", "--gradient-checkpointing",
                 "--performance", "channels_last=on", "--performance", "checkpoint_every_n_blocks=2",
                 "--performance", "attention_backend=math", "--out", str(out)])
    assert code == 0
    [json_file] = out.glob("*.json")
    result = json.loads(json_file.read_text())
    assert result["performance"]["channels_last"] == "on" and result["performance"]["checkpoint_every_n_blocks"] == 2
    assert "channels_last=on" in (out / "bench.md").read_text().splitlines()[2]
    code = main(["bench", "--model", "tiny-sd15", "--device", "cpu", "--out", str(out), "--performance", "compile=true",
                 "--performance", "compile_mode=reduce-overhead"])
    assert code == 2 and "performance.compile_mode: reduce-overhead records CUDA graphs" in capsys.readouterr().err
    code = main(["bench", "--model", "tiny-sd15", "--device", "cpu", "--out", str(out), "--performance", "compile"])
    assert code == 2 and "--performance: 'compile' is not KEY=VALUE" in capsys.readouterr().err


def test_bench_model_gets_the_performance_options_applied():
    bench = BENCH_MODELS["tiny-sd15"]
    options = BenchOptions(model="tiny-sd15", method="full", resolution=32, dtype="fp32", device="cpu",
                           performance=(("channels_last", "on"),))
    run = prepare(bench, options, train_config(bench, options, "unused"), torch.device("cpu"))
    spatial = [m.weight for m in run.model.denoiser.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]
    assert spatial and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in spatial)


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_a_bare_cuda_device_gets_the_current_index(name, monkeypatch):
    # torch.cuda.set_device(torch.device("cuda")) raises: the bench must hand it an indexed device.
    from ot_dist.bench.run import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(name) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def gpu_levers_script():
    """tests/benchmarks/bench_gpu_levers.py as a module (it imports its sibling fast_path_levers)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).parent / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("bench_gpu_levers")


def test_every_gpu_lever_entry_is_a_valid_run(tmp_path):
    """A GPU lease is 15 minutes: an entry whose options do not validate, or whose undo is unknown, would waste it."""
    script = gpu_levers_script()
    from fast_path_levers import CHANGES

    labels = [label for label, *_ in script.PLAN]
    assert len(set(labels)) == len(labels)
    for label, settings, estimate, change in script.PLAN:
        options = BenchOptions(resolution=1024, dtype="bf16", **settings)
        bench = BENCH_MODELS[options.model]
        train_config(bench, options, str(tmp_path))  # raises on an option the config refuses
        assert change is None or change in CHANGES, label
        assert estimate > 0


def test_gpu_levers_script_runs_an_undone_entry_on_the_cpu(tmp_path, monkeypatch):
    import sys

    script = gpu_levers_script()
    monkeypatch.setattr(sys, "argv", ["bench_gpu_levers.py", "--out", str(tmp_path), "--tiny", "--steps", "1",
                                      "--warmup", "0", "--only", "sdxl lora per-layer-casts"])
    import ot_dist.methods.lora_block_casts as lora_block_casts

    real = lora_block_casts.cast_adapters_per_block
    assert script.main() == 0
    assert lora_block_casts.cast_adapters_per_block is real  # the undo is undone
    (entry,) = [json.loads(line) for line in (tmp_path / "levers.jsonl").read_text().splitlines()]
    assert "error" not in entry, entry.get("error")
    assert entry["entry"] == "sdxl lora per-layer-casts" and entry["undone"] == "lora_block_casts"
    assert "| sdxl lora per-layer-casts |" in (tmp_path / "bench.md").read_text()


def test_bench_stores_the_frozen_weights_and_streams_blocks_as_told(tmp_path):
    """`--weight-dtype int8 --offload-fraction 0.5`: the bench's LoRA base is stored as a run would store it (int8
    weights computing in int8 matmuls), the denoiser's last blocks stream from CPU memory, and the row says so."""
    from ot_dist.memory.block_streaming import STREAMED_ATTR

    bench = BENCH_MODELS["tiny-flux-dev"]
    options = BenchOptions(model="tiny-flux-dev", method="lora", resolution=32, dtype="fp32", device="cpu",
                           gradient_checkpointing=True, weight_dtype="int8", offload_fraction=0.5)
    run = prepare(bench, options, train_config(bench, options, str(tmp_path)), torch.device("cpu"))
    frozen = [m for m in run.model.denoiser.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    assert frozen and all(m._parameters["weight"].dtype == torch.int8 for m in frozen)
    assert getattr(run.model.denoiser, STREAMED_ATTR)
    out = tmp_path / "bench"
    code = main(["bench", "--model", "tiny-flux-dev", "--method", "lora", "--resolution", "32", "--steps", "1",
                 "--warmup", "0", "--dtype", "fp32", "--device", "cpu", "--no-flops", "--gradient-checkpointing",
                 "--weight-dtype", "int8", "--offload-fraction", "0.5", "--out", str(out)])
    assert code == 0
    [json_file] = out.glob("*.json")
    result = json.loads(json_file.read_text())
    assert (result["weight_dtype"], result["offload_fraction"]) == ("int8", 0.5)
    assert "weight_dtype=int8 offload_fraction=0.5" in (out / "bench.md").read_text().splitlines()[2]


def test_bench_streams_a_full_finetunes_trained_blocks_with_the_fused_back_pass(tmp_path):
    """`--method full --offload-fraction 0.5 --fused-back-pass --trained-weight-dtype bfloat16` (OneTrainer's FINE_TUNE
    layer offloading): the streamed blocks' trained weights live in CPU memory and are stepped in backward (the bench's
    step changes them), and the row says so."""
    from ot_dist.memory.block_streaming import PREFETCHER_ATTR, streamed_in

    bench = BENCH_MODELS["tiny-flux-dev"]
    options = BenchOptions(model="tiny-flux-dev", method="full", resolution=32, dtype="bf16", device="cpu",
                           gradient_checkpointing=True, optimizer="ADAFACTOR", fused_back_pass=True,
                           trained_weight_dtype="bfloat16", offload_fraction=0.5)
    run = prepare(bench, options, train_config(bench, options, str(tmp_path)), torch.device("cpu"))
    streamed = streamed_in(run.model.denoiser)
    weights = [p for b in streamed for p in b.parameters()]
    assert weights and all(p.requires_grad and p.dtype == torch.bfloat16 for p in weights)
    before = [p.detach().clone() for p in weights]
    run.step()
    assert getattr(run.model.denoiser, PREFETCHER_ATTR).trained.updates == len(weights)
    assert sum(not torch.equal(p, b) for p, b in zip(weights, before)) > len(weights) // 2
    out = tmp_path / "bench"
    code = main(["bench", "--model", "tiny-flux-dev", "--method", "full", "--resolution", "32", "--steps", "1",
                 "--warmup", "0", "--device", "cpu", "--no-flops", "--gradient-checkpointing", "--optimizer",
                 "ADAFACTOR", "--fused-back-pass", "--trained-weight-dtype", "bfloat16", "--offload-fraction", "0.5",
                 "--activation-offloading", "--out", str(out)])
    assert code == 0
    row = (out / "bench.md").read_text().splitlines()[2]
    assert "offload_fraction=0.5 fused_back_pass=True trained_weight_dtype=bfloat16 activation_offloading=True" in row
