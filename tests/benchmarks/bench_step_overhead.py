"""Step-overhead benchmark: ot_dist's training step versus a bare hand-written diffusers loop.

A standalone script (not a pytest test). On the tiny model of a family (resolution 64, batch size 4,
full finetune of the UNet, AdamW, float32, CPU) it times, side by side in one process:

  (a) ot_dist: `Trainer.micro_step` + `Trainer.optimizer_step`, the code `ot-dist train` runs;
  (b) bare:    the loop of diffusers' examples/text_to_image/train_text_to_image.py (sd1) or
               train_text_to_image_sdxl.py (sdxl): VAE encode -> latent_dist.sample() * scaling_factor,
               randn noise, randint timesteps, DDPMScheduler.add_noise, CLIP text encoder, UNet, MSE,
               backward, clip_grad_norm_(1.0), AdamW(foreach=True) step, constant lr_scheduler step,
               zero_grad.

Both consume the same batches, collated once up front from the Trainer's dataset (image decoding is
excluded from both) and tokenized up front, as the diffusers examples do
in their data transform (ot_dist: `Trainer.epoch_batches`). After a warm-up, steps are timed in alternating blocks (A B A B ...) to
cancel drift, with a fixed thread count; the result is the ratio of the median step times, with the
median of the per-pair ratios as a drift-robust cross-check. Both models start from the same weights
(checked), and their losses after the timed steps must be in the same range (checked).

    python tests/benchmarks/bench_step_overhead.py --family sd1
    python tests/benchmarks/bench_step_overhead.py --family sdxl --steps 200 --json /tmp/sdxl.json
    python tests/benchmarks/bench_step_overhead.py --profile 20   # then profile 20 steps of each side

Exit status: 0, or 1 when the sanity checks fail (different start weights, losses out of range), or
2 with --strict when the ratio is above the target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's ot_dist
sys.path.insert(1, str(REPO / "tests"))  # conftest.base_config

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TARGET = 1.05
RESOLUTION = 64
BATCH_SIZE = 4
DATASET_SIZE = 48  # 12 distinct batches; the steps cycle through them


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("sd1", "sdxl"), default="sd1")
    p.add_argument("--steps", type=int, default=100, help="timed steps per side (default 100)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per side (default 3)")
    p.add_argument("--block", type=int, default=1,
                   help="steps per A/B block (default 1: strict A B A B, the least sensitive to the drift of a "
                   "shared or virtual machine)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: the steadiest timing on a shared machine, and the "
                   "strictest test of per-step Python overhead)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the device ot_dist's runtime picks, cuda "
                   "when there is one): both sides train on it")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this file")
    p.add_argument("--workdir", type=Path, default=None, help="keep the tiny model and data here (default: temp)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="afterwards, profile N more steps of each side (torch.profiler + cProfile)")
    p.add_argument("--strict", action="store_true", help=f"exit 2 when the ratio is above {TARGET}")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Setup


def build_ot_dist(model_dir: Path, data_dir: Path, out_dir: Path, family: str, device: str | None = None):
    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    raw = base_config(model_dir, data_dir, out_dir, family=family, method="full",
                      resolution=RESOLUTION, batch_size=BATCH_SIZE)
    config = validate(raw, source="bench")
    assert config.train_dtype == "float32" and config.weight_dtype == "float32"
    assert config.optimizer.name == "ADAMW" and config.clip_grad_norm == 1.0
    assert config.gradient_accumulation_steps == 1 and not config.gradient_checkpointing
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "") if device != "cpu" else ""
    trainer = Trainer(config, log=lambda *a: None)  # the runtime picks the device (cuda when visible)
    return config, trainer


class BareDiffusers:
    """The diffusers text-to-image example's training step, minus accelerate (one CPU process)."""

    def __init__(self, model_dir: Path, family: str, config, device: str = "cpu"):
        from diffusers import DDPMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
        from diffusers.optimization import get_scheduler

        self.family = family
        self.resolution = config.resolution
        pipeline_cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
        pipe = pipeline_cls.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True, local_files_only=True)
        self.noise_scheduler = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
        self.vae, self.unet = pipe.vae, pipe.unet
        if family == "sdxl":
            self.tokenizers = [pipe.tokenizer, pipe.tokenizer_2]
            self.text_encoders = [pipe.text_encoder, pipe.text_encoder_2]
        else:
            self.tokenizers = [pipe.tokenizer]
            self.text_encoders = [pipe.text_encoder]
        self.device = torch.device(device)
        for module in (self.vae, self.unet, *self.text_encoders):
            module.to(self.device)
        self.vae.requires_grad_(False)
        for encoder in self.text_encoders:
            encoder.requires_grad_(False)
        self.unet.train()
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.unet.parameters(),
            lr=config.learning_rate,
            betas=(opt.beta1, opt.beta2),
            weight_decay=opt.weight_decay,
            eps=opt.eps,
            foreach=True,
        )
        self.lr_scheduler = get_scheduler("constant", optimizer=self.optimizer)
        self.max_grad_norm = config.clip_grad_norm

    def prepare(self, batch: dict) -> dict:
        """The examples' data transform: tokenized captions (and SDXL's size/crop tuples)."""
        prepared = {"pixel_values": batch["pixels"].to(self.device)}
        for i, tokenizer in enumerate(self.tokenizers):
            prepared[f"input_ids_{i}"] = tokenizer(
                batch["caption"], max_length=tokenizer.model_max_length, padding="max_length",
                truncation=True, return_tensors="pt",
            ).input_ids.to(self.device)
        if self.family == "sdxl":
            prepared["original_sizes"] = [tuple(int(v) for v in s) for s in batch["original_size"].tolist()]
            prepared["crop_top_lefts"] = [tuple(int(v) for v in c) for c in batch["crop_top_left"].tolist()]
        return prepared

    def step(self, batch: dict) -> torch.Tensor:
        vae, unet, noise_scheduler = self.vae, self.unet, self.noise_scheduler
        # Convert images to latent space
        latents = vae.encode(batch["pixel_values"].to(torch.float32)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor
        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device)
        timesteps = timesteps.long()
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        if self.family == "sdxl":
            # train_text_to_image_sdxl.py: encode_prompt (penultimate hidden states of both encoders,
            # pooled output of the last) and compute_time_ids per sample.
            prompt_embeds_list = []
            with torch.no_grad():
                for i, text_encoder in enumerate(self.text_encoders):
                    prompt_embeds = text_encoder(
                        batch[f"input_ids_{i}"].to(text_encoder.device), output_hidden_states=True, return_dict=False
                    )
                    pooled_prompt_embeds = prompt_embeds[0]
                    prompt_embeds = prompt_embeds[-1][-2]
                    bs_embed, seq_len, _ = prompt_embeds.shape
                    prompt_embeds_list.append(prompt_embeds.view(bs_embed, seq_len, -1))
            prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
            pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)

            def compute_time_ids(original_size, crops_coords_top_left):
                target_size = (self.resolution, self.resolution)
                add_time_ids = list(original_size + crops_coords_top_left + target_size)
                add_time_ids = torch.tensor([add_time_ids])
                return add_time_ids.to(latents.device, dtype=torch.float32)

            add_time_ids = torch.cat(
                [compute_time_ids(s, c) for s, c in zip(batch["original_sizes"], batch["crop_top_lefts"])]
            )
            unet_added_conditions = {"time_ids": add_time_ids, "text_embeds": pooled_prompt_embeds}
            unet_kwargs = {"added_cond_kwargs": unet_added_conditions}
            encoder_hidden_states = prompt_embeds
        else:
            # Get the text embedding for conditioning
            encoder_hidden_states = self.text_encoders[0](batch["input_ids_0"], return_dict=False)[0]
            unet_kwargs = {}

        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, **unet_kwargs, return_dict=False)[0]
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        return loss.detach()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------------------------
# Timing


class Side:
    def __init__(self, name: str, step_fn):
        self.name = name
        self.step_fn = step_fn  # step_fn(i) -> detached loss
        self.next = 0  # the next step index; both sides see batch (i mod n) at step i
        self.times: list[float] = []  # wall seconds per timed step
        self.cpu_times: list[float] = []  # process CPU seconds per timed step (all threads)
        self.losses: list[float] = []

    def run(self, count: int, timed: bool) -> None:
        for _ in range(count):
            cpu_start, start = time.process_time(), time.perf_counter()
            loss = self.step_fn(self.next)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            self.next += 1
            self.losses.append(float(loss))
            if timed:
                self.times.append(elapsed)
                self.cpu_times.append(cpu)


def alternate(sides: list[Side], steps: int, block: int) -> None:
    done = 0
    while done < steps:
        count = min(block, steps - done)
        for side in sides:
            side.run(count, timed=True)
        done += count


# Python functions where ot_dist's step and the bare loop differ; the cProfile report lists them apart.
FUNCTIONS_OF_INTEREST = (
    "get_parameter_device|get_parameter_dtype|tokenize|draw_sample_noise|encode_latents|encode_text|"
    "unet_conditioning|clip_grad_norm_|micro_step|optimizer_step|diffusion_loss|bare_step|prepare"
)


def profile_sides(sides: list[Side], steps: int) -> dict:
    """torch.profiler operator totals and a cProfile of Python time, per side, both taken A B A B (two
    rounds of half the steps) after a discarded warm-up session, so neither side pays the profiler's
    start-up or sits in a quieter moment of the machine."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    half = max(1, steps // 2)
    with profile(activities=[ProfilerActivity.CPU]):  # warm-up session, discarded
        for side in sides:
            side.run(1, timed=False)
    ops = {side.name: {} for side in sides}  # op -> [calls, self CPU us]
    for _ in range(2):
        for side in sides:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                side.run(half, timed=False)
            for e in prof.key_averages():
                entry = ops[side.name].setdefault(e.key, [0, 0.0])
                entry[0] += e.count
                entry[1] += e.self_cpu_time_total
    profilers = {side.name: cProfile.Profile() for side in sides}
    for _ in range(2):
        for side in sides:
            profilers[side.name].enable()
            side.run(half, timed=False)
            profilers[side.name].disable()

    n = 2 * half
    report = {}
    for side in sides:
        table = ops[side.name]
        total = sum(v[1] for v in table.values())
        print(f"\n=== torch.profiler, {side.name}: {n} steps, self CPU {total / 1e3 / n:.1f} ms/step ===")
        print(f"{'op':<60} {'calls/step':>10} {'self ms/step':>12}")
        for key, (calls, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:20]:
            print(f"{key[:60]:<60} {calls / n:10.1f} {us / 1e3 / n:12.3f}")
        out = io.StringIO()
        stats = pstats.Stats(profilers[side.name], stream=out)
        stats.sort_stats("cumulative").print_stats(25)
        stats.sort_stats("cumulative").print_stats(FUNCTIONS_OF_INTEREST)
        print(f"\n=== cProfile, {side.name}: {n} steps (cumulative; then the functions of interest) ===")
        print(out.getvalue())
        report[side.name] = {
            "steps": n,
            "self_cpu_ms_per_step": total / 1e3 / n,
            "ops": {k: {"calls_per_step": c / n, "self_ms_per_step": us / 1e3 / n} for k, (c, us) in table.items()},
            "python_cumulative_ms_per_step": {
                f"{Path(f).name}:{line}({fn})": v[3] * 1e3 / n
                for (f, line, fn), v in stats.stats.items()
                if v[3] * 1e3 / n >= 0.01
            },
        }
    a, b = (ops[s.name] for s in sides)
    keys = set(a) | set(b)
    diff = {k: (a.get(k, [0, 0.0])[1] - b.get(k, [0, 0.0])[1]) / 1e3 / n for k in keys}
    print(f"=== torch.profiler differences per step ({sides[0].name} - {sides[1].name}) ===")
    print(f"{'op':<60} {'calls a':>8} {'calls b':>8} {'ms a':>8} {'ms b':>8} {'diff':>8}")
    for k in sorted(keys, key=lambda k: -abs(diff[k]))[:20]:
        ca, ua = a.get(k, [0, 0.0])
        cb, ub = b.get(k, [0, 0.0])
        print(f"{k[:60]:<60} {ca / n:8.1f} {cb / n:8.1f} {ua / 1e3 / n:8.3f} {ub / 1e3 / n:8.3f} {diff[k]:+8.3f}")
    ta, tb = report[sides[0].name]["self_cpu_ms_per_step"], report[sides[1].name]["self_cpu_ms_per_step"]
    print(f"self CPU per step: {sides[0].name} {ta:.1f} ms, {sides[1].name} {tb:.1f} ms, ratio {ta / tb:.3f}")
    return report


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    torch.set_num_threads(args.threads)

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from ot_dist.demo import make_demo_dataset
    from ot_dist.models.tiny import make_tiny_model

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_step_overhead_")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
    model_dir = workdir / f"tiny-{args.family}"
    data_dir = workdir / "shapes"
    if not (model_dir / "model_index.json").is_file():
        make_tiny_model(model_dir, args.family)
    if not any(data_dir.glob("*.png")):
        make_demo_dataset(data_dir, count=DATASET_SIZE, size=RESOLUTION)

    config, trainer = build_ot_dist(model_dir, data_dir, workdir / "out", args.family, args.device)
    args.device = str(trainer.device)
    bare = BareDiffusers(model_dir, args.family, config, args.device)

    # Same start: every component of both models holds the same weights.
    pairs = [("unet", trainer.model.denoiser, bare.unet), ("vae", trainer.model.vae, bare.vae)]
    pairs += [(name, enc, bare.text_encoders[i]) for i, (name, enc) in enumerate(trainer.model.text_encoders.items())]
    mismatched = [name for name, a, b in pairs if not same_weights(a, b)]
    n_trainable = sum(p.numel() for p in trainer.params)
    assert n_trainable == sum(p.numel() for p in bare.unet.parameters() if p.requires_grad)

    # The same pre-collated batches for both (decoding excluded); the bare loop's data transform
    # (tokenization) happens here too, as in the diffusers examples' dataloader.
    batches = list(trainer.epoch_batches(0))
    bare_batches = [bare.prepare(b) for b in batches]
    n = len(batches)

    def ot_step(i: int) -> torch.Tensor:
        loss = trainer.micro_step(batches[i % n], i // n, 1)
        trainer.optimizer_step(i)
        return loss

    def bare_step(i: int) -> torch.Tensor:
        return bare.step(bare_batches[i % n])

    a, b = Side("ot_dist", ot_step), Side("bare diffusers", bare_step)
    torch.manual_seed(config.seed)  # the bare loop's noise comes from the global generator
    print(
        f"family {args.family}: resolution {config.resolution}, batch {config.batch_size}, full UNet finetune "
        f"({n_trainable / 1e6:.2f} M params), AdamW foreach, float32, {args.device}, {args.threads} threads; "
        f"{args.warmup} warm-up + {args.steps} timed steps per side in blocks of {args.block} (A B A B ...)"
    )
    load_start = os.getloadavg()[0]
    if load_start > args.threads + 0.5:  # this process itself accounts for about `threads`
        print(f"note: load average {load_start:.2f} before timing; other processes may disturb the numbers")
    for side in (a, b):
        side.run(args.warmup, timed=False)
    timing_start = time.perf_counter()
    alternate([a, b], args.steps, args.block)
    timing_seconds = time.perf_counter() - timing_start

    med_a, med_b = statistics.median(a.times), statistics.median(b.times)
    ratio = med_a / med_b
    # Drift-robust cross-check: the median over A/B block pairs of (median A block / median B block);
    # with --block 1 the median of the per-step ratios of neighbouring A and B steps.
    pair_ratios = [
        statistics.median(a.times[i : i + args.block]) / statistics.median(b.times[i : i + args.block])
        for i in range(0, args.steps, args.block)
    ]
    pair_ratio = statistics.median(pair_ratios)
    load_end = os.getloadavg()[0]
    # Process CPU time is far less disturbed by other processes than wall time (with one thread it is
    # the step's own work); shown as a cross-check of the wall-time ratio.
    cpu_a, cpu_b = statistics.median(a.cpu_times), statistics.median(b.cpu_times)
    cpu_ratio = cpu_a / cpu_b
    # Sanity: both trained the same model on the same data with the same optimizer, so their losses
    # over the last steps must be in the same range (the noise draws differ, so not equal).
    tail = min(20, args.steps)
    loss_a = statistics.fmean(a.losses[-tail:])
    loss_b = statistics.fmean(b.losses[-tail:])
    head_a, head_b = statistics.fmean(a.losses[:tail]), statistics.fmean(b.losses[:tail])
    finite = all(map(lambda v: v == v and abs(v) != float("inf"), a.losses + b.losses))
    loss_ok = finite and 0.5 <= loss_a / loss_b <= 2.0
    weights_ok = not mismatched
    print(f"start weights identical (unet, vae, text encoders): {'yes' if weights_ok else 'NO: ' + ', '.join(mismatched)}")
    print(
        f"loss check: mean of the last {tail} steps ot_dist {loss_a:.4f}, bare diffusers {loss_b:.4f} "
        f"(first {tail}: {head_a:.4f} / {head_b:.4f}): {'same range' if loss_ok else 'OUT OF RANGE'}"
    )
    print(
        "timed: ot_dist micro_step + optimizer_step (noise draws and all included); bare: its step; "
        "both with captions tokenized beforehand (untimed), as the diffusers examples' data transform does"
    )
    for side in (a, b):
        t = sorted(side.times)
        print(
            f"  {side.name:<15} median {statistics.median(t):.4f} s  mean {statistics.fmean(t):.4f} s  "
            f"min {t[0]:.4f} s  p90 {t[int(0.9 * (len(t) - 1))]:.4f} s  CPU median {statistics.median(side.cpu_times):.4f} s"
        )

    print(
        f"  CPU-time ratio {cpu_ratio:.3f}; per block pair wall ratio: median {pair_ratio:.3f} (min {min(pair_ratios):.3f}, max {max(pair_ratios):.3f}); "
        f"1-min load average {load_start:.2f} -> {load_end:.2f}"
    )

    profile_report = profile_sides([a, b], args.profile) if args.profile else None

    total_seconds = time.perf_counter() - wall_start
    if args.json:
        import diffusers
        import transformers

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "family": args.family,
            "resolution": config.resolution,
            "batch_size": config.batch_size,
            "threads": args.threads,
            "warmup": args.warmup,
            "steps": args.steps,
            "block": args.block,
            "trainable_params": n_trainable,
            "ot_dist_median_s": med_a,
            "bare_median_s": med_b,
            "ot_dist_mean_s": statistics.fmean(a.times),
            "bare_mean_s": statistics.fmean(b.times),
            "ratio": ratio,
            "target": TARGET,
            "within_target": ratio <= TARGET,
            "ot_dist_cpu_median_s": cpu_a,
            "bare_cpu_median_s": cpu_b,
            "cpu_ratio": cpu_ratio,
            "ot_dist_cpu_times_s": a.cpu_times,
            "bare_cpu_times_s": b.cpu_times,
            "block_pair_ratios": pair_ratios,
            "block_pair_ratio_median": pair_ratio,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "start_weights_identical": weights_ok,
            "loss_ot_dist_tail_mean": loss_a,
            "loss_bare_tail_mean": loss_b,
            "loss_ot_dist_head_mean": head_a,
            "loss_bare_head_mean": head_b,
            "losses_same_range": loss_ok,
            "ot_dist_times_s": a.times,
            "bare_times_s": b.times,
            "ot_dist_losses": a.losses,
            "bare_losses": b.losses,
            "timing_seconds": timing_seconds,
            "total_seconds": total_seconds,
            "profile": profile_report,
            "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                         "transformers": transformers.__version__},
        }, indent=2))
        print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()
    print(f"total {total_seconds:.1f} s (timed section {timing_seconds:.1f} s)")
    print(
        f"step overhead ({args.family}): ot_dist {med_a:.3f} s/step, bare diffusers {med_b:.3f} s/step, "
        f"ratio {ratio:.2f} (target <= {TARGET}); paired ratio {pair_ratio:.2f}"
    )
    if (ratio <= TARGET) != (pair_ratio <= TARGET):
        print("note: the median and paired ratios disagree about the target; the machine is noisy, rerun with more --steps")
    if not (weights_ok and loss_ok):
        return 1
    if args.strict and ratio > TARGET:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
