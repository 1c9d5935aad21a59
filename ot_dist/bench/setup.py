"""A bench model set up for training exactly as the trainer sets one up: a validated TrainConfig, the method's
parameter groups, the trainer's placement (float32 trained weights, frozen ones in weight_dtype), the `single`
strategy (autocast, loss scaling, clipping) and the optimizer registry; the step is the trainer's micro step +
optimizer step over `diffusion_loss` with cached latents and text.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ot_dist.bench.architectures import BenchModel
from ot_dist.config.schema import TrainConfig
from ot_dist.errors import ConfigError
from ot_dist.models.loading import LoadedModel
from ot_dist.train.loss import diffusion_loss

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class BenchOptions:
    model: str
    method: str = "lora"
    lora_rank: int = 16
    resolution: int = 1024
    batch_size: int = 1
    steps: int = 10
    warmup: int = 3
    gradient_checkpointing: bool = False
    dtype: str = "bf16"
    optimizer: str = "ADAMW"
    device: str = "auto"
    peak_tflops: float | None = None
    count_flops: bool = True
    performance: tuple[tuple[str, str], ...] = ()  # (key, value) of the config's performance section
    profile_steps: int = 0  # steps run under torch.profiler after the timed ones (0: none)
    weight_dtype: str | None = None  # the frozen weights' storage (None: the compute dtype), e.g. int8, nf4, float8
    offload_fraction: float = 0.0  # the denoiser's <denoiser>.offload_fraction (memory/block_streaming.py)
    fused_back_pass: bool = False  # optimizer.fused_back_pass (clip_grad_norm off); a full finetune's streaming needs it
    trained_weight_dtype: str = "float32"  # the trained weights' storage (float32 masters, or bfloat16)
    activation_offloading: bool = False  # the checkpointed blocks' inputs in CPU memory (train/activation_offload.py)


def train_config(bench: BenchModel, options: BenchOptions, output_dir: str) -> TrainConfig:
    """The TrainConfig a real run of these options would validate to (the bench reads no data and no model)."""
    from ot_dist.models.families.registry import get_family

    train_dtype = DTYPE_NAMES[options.dtype]
    pixel_multiple = get_family(bench.family).pixel_multiple
    if options.resolution % pixel_multiple:
        raise ConfigError(f"--resolution: {options.resolution} is not a multiple of {pixel_multiple}, the pixel grid of "
                          f"{bench.family} latents")
    return TrainConfig.model_validate(dict(
        model={"family": bench.family, "path": f"<ot-dist bench {bench.name}: random weights>"},
        method=options.method, output_dir=output_dir, # One square size, no buckets: any side on the family's pixel grid.
        data={"shards": "<none: random cached latents and text>", "bucket_step": max(8, pixel_multiple)},
        resolution=options.resolution, batch_size=options.batch_size,
        train_dtype=train_dtype,
        # A LoRA's frozen base is stored in the compute dtype (half the memory, the usual large-model setting), unless
        # a storage is chosen.
        weight_dtype=options.weight_dtype or train_dtype,
        **({get_family(bench.family).denoiser: {"offload_fraction": options.offload_fraction}}
           if options.offload_fraction else {}),
        gradient_checkpointing=options.gradient_checkpointing,
        optimizer={"name": options.optimizer, **({"fused_back_pass": True} if options.fused_back_pass else {})},
        **({"clip_grad_norm": None} if options.fused_back_pass else {}),
        trained_weight_dtype=options.trained_weight_dtype, activation_offloading=options.activation_offloading,
        lora={"rank": options.lora_rank, "alpha": float(options.lora_rank)},
        performance=dict(options.performance),
        mlflow={"enabled": False},
    ))


class CachedLatentsVAE(torch.nn.Module):
    """What the loss needs of a VAE when latents are cached: the latent scale / shift (and where latents live)."""

    def __init__(self, scaling_factor: float, shift_factor: float | None):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.config = SimpleNamespace(scaling_factor=scaling_factor, shift_factor=shift_factor)


class BenchLoadedModel(LoadedModel):
    """A LoadedModel without text encoders (their outputs are cached)."""

    @property
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        return {}


def build_model(bench: BenchModel, config: TrainConfig, device: torch.device, seed: int = 0) -> BenchLoadedModel:
    """The denoiser with random weights made directly on `device` (meta: shapes only, for counting)."""
    import diffusers

    from ot_dist.models.families.registry import get_family

    family = get_family(bench.family).configure(config.model)
    cls = getattr(diffusers, bench.denoiser_class)
    denoiser_config = bench.denoiser_config()  # a tiny config's first read builds (and seeds) a whole tiny pipeline
    torch.manual_seed(seed)
    with torch.device(device):
        denoiser = cls.from_config(denoiser_config)
        vae = CachedLatentsVAE(*bench.vae_scaling)
    pipeline = SimpleNamespace(**{family.denoiser: denoiser}, vae=vae, scheduler=bench.scheduler())
    return BenchLoadedModel(family=family, pipeline=pipeline, objective=family.objective(pipeline, config.model))


def place(model: LoadedModel, config: TrainConfig) -> None:
    """The trainer's `_place_modules` for modules already on their device: trained parameters in
    trained_weight_dtype, frozen ones in weight_dtype (quantized where it says so), train mode where something trains,
    checkpointing, the denoiser's streamed blocks."""
    from ot_dist.memory.block_streaming import denoiser_streamed_blocks, streamed_entries, stream_blocks
    from ot_dist.memory.placement import store_component
    from ot_dist.train.checkpointing import enable_gradient_checkpointing

    for name, module in model.named_components():
        store_component(module, name, config, denoiser=module is model.denoiser)  # as the trainer
        if config.gradient_checkpointing and module is model.denoiser and not config.performance.selective_checkpointing:
            enable_gradient_checkpointing(module, config.activation_offloading)
    streamed = denoiser_streamed_blocks(model, config)
    if streamed:  # built on the device: the streamed blocks' weights go home to CPU memory first
        device = next(model.denoiser.parameters()).device
        trained = config.streams_trained_weights()
        for table, key in (e for block in streamed for e in streamed_entries(block, trained)):
            table[key].data = table[key].data.cpu()
        stream_blocks(model.denoiser, streamed, device, trained)


def apply_bench_performance(model: LoadedModel, config: TrainConfig, device: torch.device) -> None:
    """The trainer's `_apply_performance` (the FLOP count on the meta build counts the plain model)."""
    from ot_dist.train.fast_path import apply_performance, check_performance, selective_checkpointing

    check_performance(config.performance, device)
    if config.gradient_checkpointing and config.performance.selective_checkpointing:
        selective_checkpointing(model, config.performance, config.activation_offloading)
    apply_performance(model, config.performance, device, config.strategy, log=lambda *_: None)


def random_batch(bench: BenchModel, model: LoadedModel, batch_size: int, resolution: int,
                 device: torch.device) -> dict:
    """A batch as the reader gives it with data.cache_latents and data.cache_text: latent posteriors and text
    encoder outputs of the right shapes (random values), plus SDXL's size conditioning."""
    side = resolution // 8  # every bench family's VAE downsamples x8
    generator = torch.Generator().manual_seed(0)

    def normal(*shape):
        return torch.randn(batch_size, *shape, generator=generator).to(device)

    batch = {"sample_id": torch.arange(batch_size),
             "latent_mean": normal(bench.latent_channels, side, side),
             "latent_std": normal(bench.latent_channels, side, side).abs() * 0.01}
    for key, shape in bench.text_shapes(dict(model.denoiser.config)).items():
        batch[f"text_{key}"] = normal(*shape)
    if bench.size_conditioning:
        size = torch.tensor([[resolution, resolution]] * batch_size, device=device)
        batch |= {"original_size": size, "crop_top_left": torch.zeros_like(size), "target_size": size}
    return batch


@dataclass
class BenchRun:
    """Everything one training step touches."""

    model: LoadedModel
    config: TrainConfig
    strategy: object
    optimizer: torch.optim.Optimizer | None
    params: list[torch.nn.Parameter]
    batch: dict
    steps_taken: int = 0

    def loss(self) -> torch.Tensor:
        # The same cached latents each step but new noise and timesteps (drawn per sample and "epoch"), as training
        # draws them: a step that reused the last step's inputs (a stale CUDA-graph replay) shows in its gradients.
        with self.strategy.autocast():
            return diffusion_loss(self.model, self.batch, self.config.seed, self.steps_taken, self.config.loss,
                                  self.config.masked_training)

    def backward(self, loss: torch.Tensor) -> None:
        self.strategy.backward(loss, 1, True)

    def step(self) -> torch.Tensor:
        """The trainer's micro step + optimizer step (one micro batch per step, no scheduler / EMA), in the
        attention kernel the trainer allows (forward and backward)."""
        from ot_dist.train.fast_path import attention_kernel, begin_step

        begin_step(self.config.performance)
        with attention_kernel(self.config.performance, self.batch["latent_mean"].device,
                              self.model.family.attention_kernels_avoided):
            loss = self.loss()
            self.backward(loss)
        self.strategy.step(self.optimizer, self.params)
        self.steps_taken += 1
        return loss.detach()


def prepare(bench: BenchModel, options: BenchOptions, config: TrainConfig, device: torch.device,
            with_optimizer: bool = True) -> BenchRun:
    from ot_dist.memory.block_streaming import connect_trained_streaming
    from ot_dist.methods.registry import build_method
    from ot_dist.optim.factory import build_optimizer
    from ot_dist.parallel import build_strategy
    from ot_dist.parallel.base import named_groups, trained_modules
    from ot_dist.parallel.runtime import Runtime

    model = build_model(bench, config, device)
    groups = build_method(config).prepare(model)
    if device.type != "meta":
        place(model, config)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the float32 copies of frozen weights cast down by `place`
        apply_bench_performance(model, config, device)
    strategy = build_strategy(config, Runtime(device=device if device.type != "meta" else torch.device("cpu")))
    named = named_groups(trained_modules(model), groups)
    del groups  # none of the parameters the wrap replaces held here
    groups = strategy.wrap(model, named)
    optimizer = None
    if with_optimizer:
        built = build_optimizer(config.optimizer, groups)
        connect_trained_streaming(model.denoiser, built)  # streamed trained weights step in backward
        optimizer = strategy.wrap_optimizer(built)
    params = [p for g in groups for p in g.params]
    batch = random_batch(bench, model, options.batch_size, options.resolution, device)
    return BenchRun(model, config, strategy, optimizer, params, batch)
