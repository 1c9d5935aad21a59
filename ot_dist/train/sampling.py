"""Samples during training: images generated with the weights being trained, at the configured steps /
epochs and at the end, written to output_dir/samples/step-N/ and logged to MLflow.

How, under any strategy:
- Before the strategy wraps the trained modules, their structure is copied with the weights on the
  meta device (no memory): LoRA adapters and embedding rows are part of that structure, so samples
  show them active. Frozen parts (VAE, frozen text encoders) are never wrapped and are shared as is.
- At a sampling point every rank takes part in gathering the full weights once (`state_dict_of`: a collective
  under fsdp / zero3, called for the same modules in the same order everywhere; the EMA weights when the EMA
  is on); each rank that has a prompt to generate keeps them, in a fresh copy of that structure on its device,
  and builds the family's diffusers pipeline around it (a rank without one keeps nothing).
- With sampling.non_ema_samples the trained weights are sampled too, after the EMA's copy is freed:
  the same gathering (`trainer.trained_state_dict_of`, as exports use) into the same structure.
- Weights stored in float8 / nf4 / int8 (memory/stored.py: a LoRA's quantized base, under single and ddp, so held
  whole by every rank) are not gathered: the copy's stored layers hold the trained module's stored tensors themselves
  (`share_stored`), never dequantized (a Flux.1 base would be 48 GB of float32 at each sample point) nor quantized
  again.
- What a sample point holds: the copy's weights, gathered one tensor at a time. Where the gathering made them (a
  copy under fsdp / zero3, of the EMA or of float32 masters) and the samples compute in 16 bits (train_dtype
  bfloat16 / float16), the weights autocast would cast for its 16-bit ops anyway (of Linear and Conv layers, a
  LoRA's base layers) are cast to that dtype as each arrives, before the next is gathered: about half the bytes of
  the float32 copy (a Flux full finetune: 24 GB instead of 48 GB on each sampling GPU, beside training's own), the
  same samples bit for bit. Biases, norms, embeddings, adapters and the parameters `.dtype` reads stay as gathered;
  so does a single process's copy without the EMA, which is the training weights themselves (`low_precision_keys`).
- Prompt i is generated on rank i mod world size from a CPU generator seeded with the prompt's seed,
  so an image depends on the seed and the weights only, not on the rank or the world size.
- The PNGs travel to rank 0 in one reduce; rank 0 writes them and hands them to the tracker.
- The global random state (torch CPU / CUDA, Python) is restored afterwards and the trained modules
  are never touched, so a run with samples trains exactly as one without.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import itertools
import random
import re
import sys
import time
from pathlib import Path

import torch

from ot_dist.config.sampling import SAMPLERS, SamplePrompt
from ot_dist.config.schema import TrainConfig
from ot_dist.errors import ConfigError
from ot_dist.memory.block_streaming import STREAMED_ATTR
from ot_dist.memory.stored import (kept_entries, parameter_dtype_reads, share_stored, stored_state_keys,
                                   stored_tensor_ids)
from ot_dist.models.loading import LoadedModel
from ot_dist.parallel.base import Convert, trained_modules
from ot_dist.parallel.runtime import Runtime


NON_EMA_SUFFIX = "-no-ema"  # the file suffix of the trained weights' samples beside the EMA ones

# The layers whose weight autocast hands only to ops of its lower-precision list, on CPU and CUDA alike (linear,
# conv1d / 2d / 3d, conv_transpose1d / 2d / 3d): it computes them in its 16-bit dtype from a cast of the weight, so
# a weight cast to that dtype beforehand gives the same bits (tests/test_sampling_dtype.py). Exact classes: a
# subclass may compute something else (an OFT layer rotates its weight; stored float8 / nf4 / int8 layers,
# memory/stored.py, dequantize theirs: the copy holds their stored tensors, not gathered). Their biases are not cast
# (but where their block casts them, `low_precision_keys`): a few bytes per output, and a linear may add its bias
# outside autocast (ZeRO-3's replacement of torch.nn.functional.linear, parallel/deepspeed_process_state.py, adds a
# float32 bias to the 16-bit product in float32).
AUTOCAST_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                   torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
HALF_DTYPES = (torch.bfloat16, torch.float16)


class Sampler:
    def __init__(self, config: TrainConfig, model: LoadedModel):
        """Call before the strategy wraps the model: it copies the trained modules' structure."""
        self.settings = config.sampling
        self.model = model
        self.output_dir = Path(config.output_dir)
        self.default_size = max(config.resolutions())
        self.templates = {}
        self.low_precision: dict[str, frozenset[str]] = {}
        self.stored: dict[str, frozenset[str]] = {}
        if self.settings.prompts:
            refusal = model.family.samples_refusal(model.pipeline)
            if refusal:
                raise ConfigError(f"sampling.prompts: {refusal}")
            self.templates = {name: meta_structure(module) for name, module in trained_modules(model).items()}
            # per trained module: the entries cast to autocast's 16-bit dtype as they are gathered
            self.low_precision = {name: low_precision_keys(template) for name, template in self.templates.items()}
            # per trained module: the state entries of its stored (float8 / nf4 / int8) weights, shared, not gathered
            self.stored = {name: stored_state_keys(template) for name, template in self.templates.items()}
            self.check_guidance_rescale()
            self.check_reference_images()
        self.sampled_steps: set[int] = set()
        # token -> its words, of the run's embeddings (set by `sample`): for pipelines that do not expand them
        self.expansions: dict[str, str] = {}

    def check_guidance_rescale(self) -> None:
        """A guidance_rescale the sampling pipeline cannot take, refused before training: the config allows it for
        SD 1.x / 2.x, whose inpainting models (known once loaded) sample through a pipeline without it."""
        pipeline_cls = self.model.family.sampling_pipeline_cls(self.model.pipeline)
        for i, prompt in enumerate(self.settings.prompts):
            if prompt.guidance_rescale and not takes_guidance_rescale(pipeline_cls):
                raise ConfigError(f"sampling.prompts[{i}].guidance_rescale: this model samples through "
                                  f"{pipeline_cls.__name__}, which has no guidance_rescale; remove it")

    def check_reference_images(self) -> None:
        """Prompts' reference images: only for an edit model, and readable, before training starts."""
        from ot_dist.data.images import UnreadableImage, open_image

        family = self.model.family
        for i, prompt in enumerate(self.settings.prompts):
            given = prompt.reference_images()
            if not given:
                if family.sample_reference_required:
                    raise ConfigError(f"sampling.prompts[{i}]: model.family {family.name} samples only with "
                                      "a reference image (its pipeline has no text-only mode); set reference_image")
                continue
            if not family.takes_reference_images:
                from ot_dist.train.references import edit_families

                raise ConfigError(f"sampling.prompts[{i}].reference_image: model.family {family.name} takes "
                                  f"no reference image (an edit model does: {', '.join(edit_families())}); remove it")
            for path in given:
                try:
                    open_image(Path(path).expanduser())
                except (UnreadableImage, OSError) as err:
                    raise ConfigError(f"sampling.prompts[{i}].reference_image: {err}") from None

    def due(self, step: int, steps_per_epoch: int) -> bool:
        every_steps, every_epochs = self.settings.every_n_steps, self.settings.every_n_epochs
        if every_steps and step % every_steps == 0:
            return True
        return bool(every_epochs) and step % steps_per_epoch == 0 and (step // steps_per_epoch) % every_epochs == 0

    def after_step(self, trainer, step: int) -> None:
        """After optimizer step `step` (1-based): sample if a step or epoch interval ends here."""
        if self.settings.prompts and self.due(step, trainer.steps_per_epoch):
            self.sample(trainer, step)

    def at_end(self, trainer, step: int) -> None:
        if self.settings.samples_at_end() and step not in self.sampled_steps:
            self.sample(trainer, step)

    def sample(self, trainer, step: int) -> list[Path]:
        """Every rank calls this at the same step. Returns the files written (on rank 0)."""
        runtime: Runtime = trainer.runtime
        self.expansions = trainer.method.expansions()
        use_ema = self.settings.use_ema and trainer.ema is not None
        # The weight sets sampled, each under its file suffix: the EMA (or the trained weights), and with
        # non_ema_samples the trained weights beside the EMA (OneTrainer's non_ema_sampling).
        weight_sets = [("ema" if use_ema else "trained", "")]
        if use_ema and self.settings.non_ema_samples:
            weight_sets.append(("trained", NON_EMA_SUFFIX))
        prompts = self.settings.prompts
        mine = [i for i in range(len(prompts)) if i % runtime.world_size == runtime.rank]
        images: dict[int, bytes] = {}  # set s, prompt i -> key s x len(prompts) + i
        started = time.perf_counter()
        dtype = autocast_dtype(trainer.precision, runtime.device)
        for s, (weights, _) in enumerate(weight_sets):
            # One set at a time: its full weights are gathered once, sampled, and freed before the next is
            # gathered, so non-EMA samples hold no more memory than the EMA ones.
            with trainer.averaged_weights():  # copied out, so training goes on meanwhile untouched
                # Kept by the ranks that sample (a rank without a prompt takes part in the gathering only), on the
                # device, where they compute: a tensor at a time, as the strategy and the EMA gather them, each
                # gathered copy of a weight autocast computes in 16 bits cast to them as it arrives (`arrival_cast`).
                of = trainer.ema_state_dict_of if weights == "ema" else trainer.trained_state_dict_of
                modules = {}
                # The one gathering of these full weights; the same modules in the same order on every rank.
                for name, module in trainer.strategy.trained_modules.items():
                    convert = arrival_cast(self.low_precision[name], dtype) if mine else None
                    stored = self.stored[name]  # shared below, not gathered (the same keys on every rank)
                    state = of(here=bool(mine), host=False, convert=convert)(
                        module, (lambda key: key not in stored) if stored else None)
                    if mine:
                        modules[name] = inference_copy(self.templates[name], state, runtime.device, module)
                    del state  # only `modules` keeps the gathered weights
            if mine:
                pipelines = {}  # one per sampler the prompts name, around the same modules
                # Float8-stored components (frozen ones, trained ones' bases and their copies here) report their
                # compute dtype as `.dtype` (memory/float8.py): the pipelines make their latents in it.
                with isolated_randomness(runtime.device), trainer.precision.autocast():
                    for i in mine:
                        sampler = self.sampler_of(prompts[i])
                        if sampler not in pipelines:
                            pipelines[sampler] = self.pipeline(modules, sampler)
                        images[s * len(prompts) + i] = png_bytes(self.generate(pipelines[sampler], prompts[i]))
                del pipelines
            del modules  # the gathered weights are freed before training (or the next set) goes on
        images = gather_to_main(images, len(weight_sets) * len(prompts), runtime)
        self.sampled_steps.add(step)
        if not runtime.is_main:
            return []
        folder = self.output_dir / "samples" / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for key, data in sorted(images.items()):
            s, i = divmod(key, len(prompts))
            path = folder / f"{i}-{slug(prompts[i].prompt)}{weight_sets[s][1]}.png"
            path.write_bytes(data)
            trainer.tracker.log_artifact(path, f"samples/step-{step}")
            trainer.tracker.log_image(path, f"samples/{path.stem}", step)  # the UI's image view, per step
            written.append(path)
        names = " and ".join("EMA" if weights == "ema" else "trained" for weights, _ in weight_sets)
        trainer.log(f"samples at step {step} ({names} weights): {len(written)} images in "
                    f"{folder} ({time.perf_counter() - started:.1f}s)")
        return written

    def sampler_of(self, prompt: SamplePrompt) -> str:
        """The sampler name a prompt samples with: its own, else sampling.sampler; auto = the family's first."""
        return self.resolved(self.settings.sampler if prompt.sampler is None else prompt.sampler)

    def resolved(self, sampler: str) -> str:
        return self.model.family.samplers[0] if sampler == "auto" else sampler

    def pipeline(self, modules: dict[str, torch.nn.Module], sampler: str | None = None):
        """The family's sampling pipeline: the gathered copies of the trained modules, the shared frozen
        ones, a fresh scheduler of the `sampler` kind (None: sampling.sampler; the pipeline adjusts its
        scheduler's config)."""
        components = {**self.model.pipeline.components, **modules}
        family = self.model.family
        components["scheduler"] = self.scheduler(self.resolved(self.settings.sampler if sampler is None else sampler))
        pipeline = family.sampling_pipeline(components, self.model.pipeline)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def scheduler(self, sampler: str):
        """A scheduler of `sampler`'s kind on the model's own scheduler config (its betas, spacing, offsets,
        shift), with what training predicts and what the sampler's name promises (Karras sigmas, SDE)."""
        import diffusers

        class_name, options = SAMPLERS[sampler]
        config = {**self.model.pipeline.scheduler.config, **self.model.family.sampling_overrides(self.model.objective)}
        return getattr(diffusers, class_name).from_config(config, **options)

    def generate(self, pipeline, prompt: SamplePrompt):
        arguments = dict(
            prompt=self.with_token_words(pipeline, prompt.prompt),
            # Without one, the pipeline's own unconditional input (its default: None, or "" for PixArt's).
            **({"negative_prompt": self.with_token_words(pipeline, prompt.negative_prompt)}
               if prompt.negative_prompt else {}),
            width=prompt.width or self.default_size,
            height=prompt.height or self.default_size,
            num_inference_steps=prompt.steps,
            guidance_scale=prompt.guidance_scale,
            generator=torch.Generator().manual_seed(prompt.seed),  # CPU: the same noise on any device
            output_type="pil",
        )
        if prompt.guidance_rescale is not None and takes_guidance_rescale(pipeline):
            # Set (0 too: it overrides the zero-terminal-SNR default); above 0 it was refused where not taken.
            arguments["guidance_rescale"] = prompt.guidance_rescale
        if prompt.reference_images():  # the family turns them into its pipeline's input (sampling_arguments)
            arguments["reference_images"] = [Path(path).expanduser() for path in prompt.reference_images()]
        return self.model.family.sampled_image(pipeline(**self.model.family.sampling_arguments(pipeline, arguments)))


    def with_token_words(self, pipeline, text: str) -> str:
        """`text` with each embedding token written as its words (TOKEN TOKEN_1 ...), as training's captions, where the
        pipeline does not do it itself: diffusers' textual-inversion pipelines (SD, SDXL, Flux, Chroma) expand a token
        in `maybe_convert_prompt` (written out here, they would expand it again); the others (SD3, PixArt, Sana,
        Lumina 2, HiDream) would read a token of several vectors as its first."""
        if not self.expansions or hasattr(pipeline, "maybe_convert_prompt"):
            return text
        from ot_dist.methods.token_vectors import expand_in_caption

        return expand_in_caption(text, self.expansions)


def takes_guidance_rescale(pipeline) -> bool:
    """Whether a pipeline (or pipeline class) takes guidance_rescale: diffusers' SD / SDXL ones, but SD inpainting."""
    return "guidance_rescale" in inspect.signature(pipeline.__call__).parameters


def meta_structure(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose state (parameters, persistent buffers) is on the meta device: the
    structure without the memory. Non-persistent buffers (not in the state dict) are copied.
    Every parameter is state, and so are the stored (float8 / nf4 / int8) weights' statistics (non-persistent buffers):
    a copy shares the trained module's at each sample point (`inference_copy`). The state dict is asked for with a
    filter that keeps no entry (memory/stored.py kept_entries) so that the stored weights are read as held, not
    dequantized (the whole model in float32, for ids)."""
    with kept_entries(lambda key: False):
        in_state = {id(t) for t in module.state_dict(keep_vars=True).values()} | stored_tensor_ids(module)
    memo = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) in in_state or isinstance(tensor, torch.nn.Parameter):
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def autocast_dtype(precision, device: torch.device) -> torch.dtype | None:
    """The dtype the samples' autocast (`precision.autocast()`, which they run under) computes its lower-precision ops
    in on `device`; None where it is off (train_dtype float32)."""
    with precision.autocast():
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def arrival_cast(keys: frozenset[str], dtype: torch.dtype | None) -> Convert | None:
    """What a sampling rank makes of each tensor a gathering hands it (the strategies' `convert`): the entries among
    `keys` (`low_precision_keys`) cast to autocast's `dtype` at once, before the next is gathered, so the copy holds
    them in 16 bits instead of in float32 beside training's memory. None (nothing converted) where autocast is off or
    not in 16 bits: float32 samples hold the weights as gathered."""
    if dtype not in HALF_DTYPES or not keys:
        return None

    def convert(key: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if key in keys and tensor.is_floating_point() else tensor

    return convert


def low_precision_keys(template: torch.nn.Module) -> frozenset[str]:
    """The state-dict keys of `template` (a trained module's structure) whose tensors the samples use only in autocast's
    lower-precision ops, so that a copy of them may be held in its 16-bit dtype with the same results: the weight of
    each AUTOCAST_LAYERS layer computing with its class's forward, and the weight and bias of each layer computing
    with its block's copies (methods/weight_block_casts.py: while the block's weights are float32 it casts weights
    and biases to the compute dtype together; once cast here the layers compute the same op on the same casts
    themselves, so a block's layers are cast all or none). Not:
    - inside a peft tuner layer, but the base layer of a plain LoRA (no DoRA: its magnitude arithmetic reads the base
      weight outside any autocast op) or of a LoHa / LoKr layer, whose forward only calls it. The adapters stay (a few
      % of the bytes; their block casts, methods/lora_block_casts.py, compute on copies of float32 weights and may
      share one q / k / v projection);
    - the modules PARAMETER_DTYPE_READS names (the library casts inputs or draws latents in their parameters' dtype);
    - the parameters a model's `.dtype` and `next(parameters())` read: its first, its first floating-point one and its
      first floating-point one outside `_keep_in_fp32_modules` (diffusers' get_parameter_dtype; transformers takes the
      first floating-point one). Held as gathered, they keep `.dtype` what it was, so the pipelines make their latents
      and cast their prompt embeddings as before (memory/float8.py reports a compute dtype instead: there `.dtype`
      would read float8 storage; here the parameters it reads are a few small tensors);
    - the blocks a denoiser streams (memory/block_streaming.py): they keep their weights where they are."""
    dtype_reads = set()
    for prefix, module in template.named_modules(remove_duplicate=False):
        if isinstance(getattr(type(module), "dtype", None), property):
            dtype_reads.update(f"{prefix}.{name}" if prefix else name for name in dtype_parameters(module))
    excluded = parameter_dtype_reads(template) | tuner_insides(template)
    streamed = tuple(f"{name}." for name in getattr(template, STREAMED_ATTR, ()))

    def entries(prefix: str, module: torch.nn.Module) -> list[str]:
        return [f"{prefix}.{name}" if prefix else name for name in ("weight", "bias")
                if module._parameters.get(name) is not None]

    eligible = {}  # id -> the layer's keys
    for prefix, module in template.named_modules(remove_duplicate=False):
        if type(module) not in AUTOCAST_LAYERS or id(module) in excluded or module._parameters.get("weight") is None:
            continue
        if "forward" in vars(module) and "_block_casts" not in vars(module):  # a forward of its own, not the casts'
            continue
        if any(key in dtype_reads or key.startswith(streamed) for key in entries(prefix, module)):
            continue
        eligible[id(module)] = entries(prefix, module)
    keys = set()
    for prefix, module in template.named_modules(remove_duplicate=False):
        if id(module) not in eligible:
            continue
        casts = vars(module).get("_block_casts")
        if casts is None:
            keys.add(eligible[id(module)][0])  # the weight (the bias: see AUTOCAST_LAYERS)
        elif all(id(layer) in eligible for layer in casts.layers):
            keys.update(eligible[id(module)])
    return frozenset(keys)


def dtype_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the parameters a model's dtype is read from: `next(parameters())`, transformers' `.dtype` (the
    first floating-point one) and diffusers' (the first floating-point one outside `_keep_in_fp32_modules`)."""
    named = list(model.named_parameters())
    keep_in_fp32 = getattr(model, "_keep_in_fp32_modules", None) or ()
    floating = [name for name, p in named if p.is_floating_point()]
    outside = [name for name in floating if not any(m in name for m in keep_in_fp32)]  # diffusers' substring match
    return [name for name, _ in named[:1]] + floating[:1] + outside[:1]


def tuner_insides(template: torch.nn.Module) -> set[int]:
    """The ids of the modules inside peft tuner layers, but the base layer of a plain LoRA layer or of a LoHa / LoKr
    one (whose forward only calls it)."""
    if "peft.tuners.tuners_utils" not in sys.modules:  # peft never imported: no tuner layers
        return set()
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lycoris_utils import LycorisLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    insides = set()
    for layer in template.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        plain = isinstance(layer, LycorisLayer) or (isinstance(layer, LoraLayer)
                                                    and not getattr(layer, "lora_variant", {}))
        base = getattr(layer, "base_layer", None) if plain else None
        insides.update(id(m) for m in layer.modules() if m is not layer and m is not base)
    return insides


def inference_copy(template: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device,
                   stored_from: torch.nn.Module | None = None) -> torch.nn.Module:
    """A module of `template`'s structure holding `state` (assigned, not copied: a single process's
    state shares the training weights' storage; nothing here writes to it). The blocks a denoiser streams
    (memory/block_streaming.py) keep their weights where they are: the copy carries the same copy-on-forward.
    `stored_from`: the trained module whose stored (float8 / nf4 / int8) weights the copy holds as they are
    (memory/stored.py share_stored: the same tensors, wherever they are), `state` holding the rest; without it, `state`
    holds them dequantized and loading quantizes them again."""
    module = copy.deepcopy(template)  # meta tensors: cheap, and the template stays empty
    shared = share_stored(module, stored_from) if stored_from is not None else frozenset()
    streamed = tuple(f"{name}." for name in getattr(template, STREAMED_ATTR, ()))
    loaded = module.load_state_dict({k: v.detach() if k.startswith(streamed) else v.detach().to(device)
                                     for k, v in state.items() if k not in shared}, assign=True, strict=not shared)
    if shared and (set(loaded.missing_keys) - shared or loaded.unexpected_keys):
        raise RuntimeError(f"the state for a copy of {type(template).__name__} is not its structure's: missing "
                           f"{sorted(set(loaded.missing_keys) - shared)[:5]}, unexpected {loaded.unexpected_keys[:5]}")
    return module.eval().requires_grad_(False)


@contextlib.contextmanager
def isolated_randomness(device: torch.device):
    """The global random streams (torch CPU and CUDA, Python's) as they were before, afterwards."""
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def gather_to_main(images: dict[int, bytes], count: int, runtime: Runtime) -> dict[int, bytes]:
    """Every rank's images {prompt index: PNG} on the main rank: one reduce of their bytes (each prompt
    comes from exactly one rank, the others add zeros). A collective: every rank calls it."""
    if not runtime.distributed:
        return images
    import torch.distributed as dist

    sizes = torch.zeros(count, dtype=torch.int64, device=runtime.device)
    for i, data in images.items():
        sizes[i] = len(data)
    dist.all_reduce(sizes)
    ends = sizes.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    buffer = torch.zeros(ends[-1] if ends else 0, dtype=torch.uint8, device=runtime.device)
    for i, data in images.items():
        buffer[starts[i]:ends[i]] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(runtime.device)
    dist.reduce(buffer, dst=0)
    if not runtime.is_main:
        return {}
    host = buffer.cpu().numpy().tobytes()
    return {i: host[starts[i]:ends[i]] for i in range(count)}


def slug(text: str, length: int = 48) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:length].strip("-") or "prompt"
