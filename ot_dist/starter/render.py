"""The starting config as commented YAML: every choice says which memory-table row it comes from."""

from __future__ import annotations

from ot_dist.starter.choose import Choice

LEARNING_RATES = {"lora": 1e-4, "full": 1e-5, "embedding": 5e-3}
WEIGHT_DTYPE_COMMENTS = {"float8": "                  # 1 byte per frozen parameter",
                         "nf4": "                     # frozen Linear weights in 4 bits (OneTrainer's NFLOAT_4; "
                                "needs bitsandbytes)"}
TWO_BYTES_COMMENT = "               # frozen weights in 2 bytes"


def render(family, method: str, choice: Choice, model_path: str, data_path: str, output_dir: str,
           gpu_memory: float, gpus: int) -> str:
    setup = choice.setup
    # Cached latents and text keep the VAE and text encoders off the GPUs while training: the offloaded setups and
    # the fsdp row of the table assume it.
    cached = setup.offload or setup.frozen in ("float8", "nf4") or choice.strategy == "fsdp"
    lines = [
        f"# ot-dist init: {method} on {family.name}, {gpus} GPU(s) of {gpu_memory:g} GiB.",
        f"# Memory table row ({choice.reference}): '{setup.label}' = {choice.table_gib:.2f} GiB per GPU of weights,",
        f"# gradients and optimizer state, + activations etc. at {family.native_resolution} px, batch 1: about "
        f"{choice.need_gib:.1f} GiB.",
        "# docs/low-memory.md explains each choice; configs/REFERENCE.md lists every key.",
        "model:",
        f"  family: {family.name}",
        f"  path: {model_path}                # a diffusers folder or a single-file .safetensors",
        f"method: {method}",
        f"output_dir: {output_dir}",
        "data:",
    ]
    if family.reference_images:  # an edit model: each image with its reference image (docs/data.md)
        lines += ["  concepts:",
                  f"    - path: {data_path}               # the edited images, same-name .txt captions: the edits",
                  f"      reference_path: {data_path}-reference   # the images before the edit, same file names"]
    else:
        lines.append(f"  path: {data_path}                 # images with same-name .txt captions")
    if cached:  # each cache the family takes; the ones it refuses with the reason (Qwen-Image-Edit's text cache)
        lines += ["  cache_latents: true          # the VAE encodes each image once, then stays off the GPU"
                  if "cache_latents" not in family.cache_refusals else
                  f"  # cache_latents: off: {family.cache_refusals['cache_latents']}",
                  "  cache_text: true             # the same for the frozen text encoders"
                  if "cache_text" not in family.cache_refusals else
                  f"  # cache_text: off: {family.cache_refusals['cache_text']}"]
    lines += [
        f"resolution: {family.native_resolution}",
        "batch_size: 1",
        "epochs: 10",
        f"learning_rate: {LEARNING_RATES[method]:.0e}",
        "train_dtype: bfloat16                 # bf16 compute; trained weights stay float32 unless set below",
        f"weight_dtype: {setup.frozen}" + WEIGHT_DTYPE_COMMENTS.get(setup.frozen, TWO_BYTES_COMMENT),
    ]
    if setup.offload:
        lines.append("offload_frozen_components: true      # text encoders + VAE in CPU memory between uses")
    if setup.trained_dtype == "bfloat16":
        lines.append("trained_weight_dtype: bfloat16       # trained weights and gradients in 2 bytes (stochastic rounding)")
    lines.append(f"gradient_checkpointing: {'true' if choice.gradient_checkpointing else 'false'}"
                 + ("" if choice.gradient_checkpointing else "        # room for the activations without it"))
    lines.append(f"strategy: {choice.strategy}" + {"single": "", "ddp": "                       # one replica per GPU",
                                                  "fsdp": "                      # weights, gradients and AdamW state "
                                                  "sharded over the GPUs"}[choice.strategy])
    denoiser = ["  train: true"] if method == "full" else []
    if setup.streamed:
        weights = "trained weights (stepped in backward)" if method == "full" else "frozen weights"
        denoiser.append(f"  offload_fraction: {setup.streamed:g}          # this share of the blocks' {weights} in "
                        "CPU memory, copied in ahead of use")
    if denoiser:
        lines += [f"{family.denoiser}:", *denoiser]
    if method == "lora":
        lines += ["lora:", "  rank: 16", "  alpha: 16"]
    lines += ["optimizer:", f"  name: {setup.optimizer}"]
    if setup.optimizer == "ADAFACTOR":  # with learning_rate above, as OneTrainer's defaults use it
        lines += ["  relative_step: false", "  scale_parameter: false"]
    if setup.fused_back_pass:
        lines.append("  fused_back_pass: true         # each gradient applied and freed as backward produces it")
        lines.append("clip_grad_norm: null                  # no global norm (or clip_grad_norm_scope: per_tensor)")
    if compiles(setup, choice):
        lines += ["performance:",
                  "  compile: true                 # each block compiled in place: Flux.1 LoRA 1.5x, SDXL 1.07x on an "
                  "H200, after a minute or two",
                  "                                # of compiling per block shape (docs/performance.md); false starts "
                  "at once"]
    lines += ["checkpoint:", "  every_n_minutes: 30"]
    return "\n".join(lines) + "\n"


def compiles(setup, choice: Choice) -> bool:
    """Regional compilation where it was measured on GPUs (docs/performance.md, issue 21): frozen weights in
    bfloat16 or float8, no block streaming and no fused back pass (neither has run compiled on a GPU yet)."""
    return (setup.frozen in ("bfloat16", "float8") and not setup.streamed and not setup.fused_back_pass
            and choice.strategy in ("single", "ddp", "fsdp"))
