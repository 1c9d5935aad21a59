"""The `performance` section: compute options of the training step on GPUs (issue 21). What each does and which CPU
proxy guards it: docs/performance.md. Device-dependent choices (float8 needs CUDA sm89+) are checked when the
run starts (ot_dist/train/fast_path.py), the rest here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ot_dist.config.section import Section


# torch.compile modes that record CUDA graphs (inductor's triton.cudagraphs)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


# Strategies that keep each weight as the tensor it is: FSDP2 shards a weight only when it is contiguous ("FSDP does not
# support non-contiguous parameters"), and DeepSpeed's ZeRO stages broadcast each weight as bytes at start-up (a view
# a channels_last weight cannot give) and then flatten them, so a channels_last weight fails all four at start-up.
CHANNELS_LAST_STRATEGIES = ("single", "ddp")


class PerformanceConfig(Section):
    """Off by default where a choice can change results or fail on some setups."""

    compile: bool = Field(
        default=False,
        description="torch.compile each repeated block of the denoiser (its family's shard units: UNet resnets and "
        "attention blocks, transformer blocks) in place: regional compilation, so weight names, FSDP2 units and "
        "checkpointing are unchanged and compile time is one block's per distinct shape. A streamed block "
        "(<denoiser>.offload_fraction) compiles its forward only, the copying of its weights around it stays eager. "
        "On a GPU it pays for the transformer families (Flux.1 dev LoRA 1.5x faster, docs/performance.md).",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        default="inductor",
        description="torch.compile's backend (inductor generates kernels; aot_eager only traces, for debugging).",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"] = Field(
        default="default",
        description="torch.compile's mode for the compiled blocks (with compile: true, inductor). reduce-overhead and "
        "max-autotune replay each block's kernels as CUDA graphs: one launch per block instead of hundreds, for steps "
        "paced by the host (SDXL LoRA, docs/performance.md); CUDA only, strategies single and ddp, "
        "gradient_accumulation_steps 1, no optimizer.fused_back_pass, no streamed blocks (the graphs need weights and "
        "gradients at fixed addresses); validation runs the blocks uncompiled. Not yet measured on a GPU.",
    )
    channels_last: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Store the denoiser's convolution weights channels_last (NHWC: tensor cores without transposes). "
        "auto = on for UNet families on CUDA under strategy single or ddp; on = also on other devices (single and ddp "
        "only: fsdp and ZeRO shard or flatten contiguous weights).",
    )
    attention_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = Field(
        default="auto",
        description="The only kernel scaled_dot_product_attention may use during training steps "
        "(torch.nn.attention.sdpa_kernel); auto = torch's choice, less the kernels the family avoids on CUDA "
        "(Flux and Chroma: cudnn, see docs/performance.md). A backend the device or inputs cannot run fails the "
        "step with torch's reason.",
    )
    checkpoint_every_n_blocks: int = Field(
        default=1, ge=1,
        description="Selective activation checkpointing (with gradient_checkpointing): recompute only every N-th "
        "block of the denoiser; the others keep their activations (faster, more memory).",
    )
    checkpoint_only_attention: bool = Field(
        default=False,
        description="Selective activation checkpointing (with gradient_checkpointing): recompute only the "
        "denoiser's attention modules (whose activations grow with the square of the tokens).",
    )
    float8_matmuls: bool = Field(
        default=False,
        description="Train the denoiser's linear layers with float8 matmuls (dynamic tensorwise scaling; float32 "
        "master weights stay): trained layers as torchao Float8Linear, frozen ones (a LoRA's base layers) as "
        "ot_dist's FrozenFloat8Linear, which skips the weight gradient torchao would compute and throw away. CUDA "
        "with compute capability 8.9+ (Ada, Hopper) for speed; the CPU runs it too, slower than bfloat16 (tests). "
        "Needs the `float8` extra (torchao).",
    )

    expandable_segments: bool = Field(
        default=True,
        description="On CUDA, the caching allocator maps memory into segments that grow in place "
        "(expandable_segments:True) instead of keeping fixed blocks: far less memory reserved but unusable when batch "
        "shapes change (aspect buckets). Left alone when PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF is set: "
        "the environment's settings win.",
    )

    @property
    def records_cuda_graphs(self) -> bool:
        return self.compile and self.compile_mode in CUDA_GRAPH_MODES

    @property
    def selective_checkpointing(self) -> bool:
        return self.checkpoint_every_n_blocks > 1 or self.checkpoint_only_attention

    @model_validator(mode="after")
    def _consistent(self) -> "PerformanceConfig":
        if self.checkpoint_every_n_blocks > 1 and self.checkpoint_only_attention:
            raise ValueError("performance: checkpoint_every_n_blocks and checkpoint_only_attention choose different "
                             "modules to recompute; set one")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"performance.compile_mode: {self.compile_mode} is a mode of the compiled blocks; set "
                             f"performance.compile: true")
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(f"performance.compile_mode: {self.compile_mode} is a mode of the inductor backend; "
                             f"performance.compile_backend is {self.compile_backend}")
        return self
