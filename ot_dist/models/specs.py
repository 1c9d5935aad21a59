"""Model family specs. A spec says what a family is made of and how its conditioning is computed;
the trainer, the methods and (later) the parallel strategies only ever talk to a spec, so adding a
family never adds an `if family == ...` anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_dist.models.registry import FAMILY_TEXT_ENCODERS

UNET_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")
CLIP_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


@dataclass
class TextConditioning:
    hidden_states: torch.Tensor  # [B, tokens, dim] fed to cross-attention
    pooled: torch.Tensor | None = None  # [B, dim] (SDXL only)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    pipeline_class: str
    inpaint_pipeline_class: str  # the pipeline of the family's 9-channel inpainting UNets
    text_encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    # Keys of the embedding file, one per text encoder, in the layout A1111 / OneTrainer / diffusers read.
    embedding_keys: tuple[str, ...]
    unet_lora_targets: tuple[str, ...] = UNET_ATTENTION_TARGETS
    text_lora_targets: tuple[str, ...] = CLIP_TARGETS
    # Sub-modules of the UNet a sharding strategy wraps one by one.
    unet_wrap_units: tuple[str, ...] = ("down_blocks", "mid_block", "up_blocks")
    text_wrap_units: tuple[str, ...] = ("text_model.encoder.layers",)

    def pipeline_cls(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def tokenize(self, tokenizers: dict, captions: list[str]) -> dict[str, torch.Tensor]:
        ids = {}
        for encoder_name, tokenizer_name in zip(self.text_encoders, self.tokenizers):
            tokenizer = tokenizers[tokenizer_name]
            ids[encoder_name] = tokenizer(
                captions,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
        return ids

    def encode_text(self, text_encoders: dict, token_ids: dict[str, torch.Tensor]) -> TextConditioning:
        encoder = text_encoders[self.text_encoders[0]]
        ids = token_ids[self.text_encoders[0]].to(encoder.device)
        return TextConditioning(hidden_states=encoder(ids)[0])

    def unet_conditioning(self, text: TextConditioning, batch: dict) -> dict:
        """Keyword arguments of the UNet call besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": text.hidden_states}


@dataclass(frozen=True)
class SDXLSpec(ModelSpec):
    """SDXL: two text encoders (penultimate hidden states, concatenated), pooled text embedding of the
    second, and micro-conditioning on original size, crop offset and target size."""

    def encode_text(self, text_encoders: dict, token_ids: dict[str, torch.Tensor]) -> TextConditioning:
        hidden, pooled = [], None
        for name in self.text_encoders:
            encoder = text_encoders[name]
            out = encoder(token_ids[name].to(encoder.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out[0]  # the last encoder's projected pooled output (text_embeds)
        return TextConditioning(hidden_states=torch.cat(hidden, dim=-1), pooled=pooled)

    def unet_conditioning(self, text: TextConditioning, batch: dict) -> dict:
        # [original_h, original_w, crop_top, crop_left, target_h, target_w] per sample.
        time_ids = torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1)
        time_ids = time_ids.to(device=text.hidden_states.device, dtype=text.hidden_states.dtype)
        return {
            "encoder_hidden_states": text.hidden_states,
            "added_cond_kwargs": {"text_embeds": text.pooled, "time_ids": time_ids},
        }


SPECS: dict[str, ModelSpec] = {
    "sd1": ModelSpec(
        family="sd1",
        pipeline_class="StableDiffusionPipeline",
        inpaint_pipeline_class="StableDiffusionInpaintPipeline",
        text_encoders=FAMILY_TEXT_ENCODERS["sd1"],
        tokenizers=("tokenizer",),
        embedding_keys=("emb_params",),
    ),
    "sd2": ModelSpec(
        family="sd2",
        pipeline_class="StableDiffusionPipeline",
        inpaint_pipeline_class="StableDiffusionInpaintPipeline",
        text_encoders=FAMILY_TEXT_ENCODERS["sd2"],
        tokenizers=("tokenizer",),
        embedding_keys=("emb_params",),
    ),
    "sdxl": SDXLSpec(
        family="sdxl",
        pipeline_class="StableDiffusionXLPipeline",
        inpaint_pipeline_class="StableDiffusionXLInpaintPipeline",
        text_encoders=FAMILY_TEXT_ENCODERS["sdxl"],
        tokenizers=("tokenizer", "tokenizer_2"),
        embedding_keys=("clip_l", "clip_g"),
    ),
}


def get_spec(family: str) -> ModelSpec:
    return SPECS[family]
