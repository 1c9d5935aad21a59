"""One benchmark: count the step's FLOPs on a meta build, build the model on the device, time the steps, report."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from ot_dist.bench.architectures import BENCH_MODELS
from ot_dist.bench.flops import check_step_flops, count_step_flops, peak_flops
from ot_dist.bench.setup import DTYPE_NAMES, BenchOptions, prepare, train_config
from ot_dist.bench.timing import time_steps
from ot_dist.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """The bench's device, with its index on CUDA (`torch.cuda.set_device` refuses a bare "cuda")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device: {name} requested but torch sees no CUDA device")
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"--device: {name} is not supported (cuda, cuda:N or cpu)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def run_bench(options: BenchOptions, output_dir: str = "bench_out", log=print) -> dict:
    if options.model not in BENCH_MODELS:
        raise ConfigError(f"--model: unknown model {options.model!r}; known: {', '.join(BENCH_MODELS)}")
    if options.method not in ("full", "lora"):
        raise ConfigError(f"--method: {options.method!r} is not full or lora")
    bench = BENCH_MODELS[options.model]
    device = resolve_device(options.device)
    try:
        config = train_config(bench, options, output_dir)
    except ValueError as err:  # pydantic's ValidationError: the option that does not fit this model
        raise ConfigError(f"bench: {err}") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        from ot_dist.precision import set_tf32

        set_tf32(config.tf32)
        from ot_dist.train.cuda_allocator import configure_cuda_allocator

        configure_cuda_allocator(config.performance, device)

    flops = None
    if options.count_flops:
        counted = prepare(bench, options, config, torch.device("meta"), with_optimizer=False)
        flops = count_step_flops(counted.loss, counted.backward)
        check_step_flops(flops, options.method)
        del counted
        log(f"bench: {options.model} {options.method} at {options.resolution} px: "
            f"{flops.forward / options.batch_size / 1e12:.4g} TFLOP forward, "
            f"{flops.train / options.batch_size / 1e12:.4g} TFLOP train per image")

    run = prepare(bench, options, config, device)
    params_total = sum(p.numel() for p in run.model.denoiser.parameters())
    params_trained = sum(p.numel() for p in run.params)
    times = time_steps(run.step, device, options.warmup, options.steps)
    peak = peak_flops(device, DTYPE_NAMES[options.dtype], options.peak_tflops)
    step_flops = flops.train if flops else None
    mfu = step_flops / times.median / peak if (step_flops and peak) else None
    result = {
        "model": options.model, "family": bench.family, "method": options.method,
        "lora_rank": options.lora_rank if options.method == "lora" else None,
        "resolution": options.resolution, "batch_size": options.batch_size, "dtype": options.dtype,
        "gradient_checkpointing": options.gradient_checkpointing, "optimizer": options.optimizer,
        "performance": config.performance.model_dump(mode="json"),
        "weight_dtype": config.weight_dtype, "offload_fraction": options.offload_fraction,
        "fused_back_pass": options.fused_back_pass, "trained_weight_dtype": config.trained_weight_dtype,
        "activation_offloading": options.activation_offloading,
        "warmup": options.warmup, "steps": options.steps,
        "device": str(device), "device_name": device_name(device), "torch": torch.__version__,
        "params_total": params_total, "params_trained": params_trained,
        "step_time_median_s": times.median, "step_time_mean_s": times.mean, "step_times_s": times.seconds,
        "images_per_s": options.batch_size / times.median,
        "peak_memory_bytes": times.peak_memory_bytes, "peak_memory_gib": times.peak_memory_bytes / 2**30,
        "peak_memory_kind": times.memory_kind,
        "flops_forward_per_step": flops.forward if flops else None, "flops_train_per_step": step_flops,
        "tflops_train_per_image": step_flops / options.batch_size / 1e12 if step_flops else None,
        "peak_flops": peak, "achieved_tflops": step_flops / times.median / 1e12 if step_flops else None,
        "mfu": mfu, "final_loss": times.final_loss,
    }
    if options.profile_steps:
        result["profile"] = write_profile(run.step, device, options.profile_steps, result, Path(output_dir), log)
    return result


def write_profile(step, device: torch.device, steps: int, result: dict, out: Path, log) -> dict:
    """Profile `steps` more steps; write <run>_profile.md (where the time went) and <run>_trace.json.gz
    (for chrome://tracing or Perfetto) next to the run's JSON."""
    from ot_dist.bench.profile import profile_steps
    from ot_dist.bench.report import run_name

    out.mkdir(parents=True, exist_ok=True)
    name = run_name(result)
    trace = out / f"{name}_trace.json.gz"
    profile = profile_steps(step, device, steps, trace)
    text = out / f"{name}_profile.md"
    text.write_text(profile.text(f"{name} on {result['device_name']}"))
    log(f"bench: profile of {steps} more steps in {text} (trace {trace.name})")
    return {**profile.summary(), "files": [str(text), str(trace)]}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"
