"""SDXL: a UNet with two CLIP text encoders (penultimate hidden states concatenated), the second one's
pooled projection, and micro-conditioning on original size, crop offset and target size."""

from __future__ import annotations

import torch

from ot_dist.models.families.sd import STABILITY_GENERATIVE_MODELS, UNetFamily, skipped_layer
from ot_dist.train.transfer import to_device


class SDXL(UNetFamily):
    name = "sdxl"
    memory_reference = "SDXL"
    description = "Stable Diffusion XL (two CLIP text encoders, size / crop conditioning)"
    pipeline_class = "StableDiffusionXLPipeline"
    inpaint_pipeline_class = "StableDiffusionXLInpaintPipeline"
    text_encoders = ("text_encoder", "text_encoder_2")
    tokenizers = ("tokenizer", "tokenizer_2")
    embedding_keys = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}
    lora_file_prefixes = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
    lora_base_model_version = "sdxl_base_v1-0"  # kohya's sdxl_model_util.MODEL_VERSION_SDXL_BASE_V1_0
    modelspec_architecture = "stable-diffusion-xl-v1-base"  # kohya's and ComfyUI's
    # its kohya-layout LoRA names the original SGM UNet's paths (kohya writes IMPL_STABILITY_AI for SDXL LoRAs)
    modelspec_kohya_lora_implementation = STABILITY_GENERATIVE_MODELS
    # Files written with the UNet's diffusers paths (ot_dist before, diffusers' conversion scripts) still read.
    lora_foreign_prefixes = {"unet": ("lora_unet",)}

    def lora_file_module_renames(self, component, module):
        """kohya sd-scripts' SDXL UNet is the original SGM one (library/sdxl_original_unet.py): its LoRA names are
        `lora_unet_` + the original module path (`input_blocks.4.1.transformer_blocks.0.attn1.to_q`), and its scripts
        (`--network_weights`, sdxl_merge_lora.py) load a file by those names only. ComfyUI, A1111 / Forge and
        diffusers read them too; A1111 misplaces the diffusers-named `up_blocks.0.upsamplers.0.conv`, and diffusers
        drops `add_embedding.linear_1` by its diffusers name. The paths are the single-file export's key map."""
        if component != self.denoiser:
            return super().lora_file_module_renames(component, module)
        weight = ".weight"
        return {rule.diffusers[0][: -len(weight)]: rule.original[: -len(weight)]
                for rule in self.denoiser_original_rules(module.config)}

    layer_skip_encoders = ("text_encoder", "text_encoder_2")
    output_embedding_keys = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}  # OneTrainer's SDXL saver

    def text_states(self, encoder, output):
        # the penultimate layer, `<encoder>_layer_skip` earlier (OneTrainer: default_layer -2, no layer norm)
        return skipped_layer(output.hidden_states, -2, self.layer_skip.get(encoder, 0), encoder)

    def encode_text(self, text_encoders, tokens):
        hidden, pooled = [], None
        for name in self.text_encoders:
            encoder = text_encoders[name]
            out = encoder(to_device(tokens[name], encoder.device), output_hidden_states=True)
            hidden.append(self.text_states(name, out))
            pooled = out[0]  # the last encoder's projected pooled output (text_embeds)
        return {"hidden": torch.cat(hidden, dim=-1), "pooled": pooled}

    def pipeline_call_options(self, pipeline):
        # diffusers' SDXL clip_skip moves both encoders back by the same count
        skips = {self.layer_skip.get(name, 0) for name in self.text_encoders}
        return {"clip_skip": skips.pop()} if len(skips) == 1 and 0 not in skips else {}

    def unet_inputs(self, conditioning, batch):
        hidden = conditioning["hidden"]
        # [original_h, original_w, crop_top, crop_left, target_h, target_w] per sample.
        time_ids = torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1)
        # float32 whatever the conditioning's dtype (zero's bf16 / fp16 engine): the UNet embeds them in float32 and
        # casts the embedding to its own dtype; bfloat16 would round an original size of 6000 px to 6016.
        time_ids = to_device(time_ids, hidden.device, torch.float32)
        return {"encoder_hidden_states": hidden,
                "added_cond_kwargs": {"text_embeds": conditioning["pooled"], "time_ids": time_ids}}

    def build_tiny(self, seed: int = 0, prediction_type: str | None = None, in_channels: int = 4, **_):
        from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer, tiny_ddim, tiny_vae

        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer()
        time_embed_dim = 8
        unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=in_channels,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64, 64),
            layers_per_block=1,
            transformer_layers_per_block=(1, 1, 2),
            norm_num_groups=8,
            attention_head_dim=(2, 4, 4),
            use_linear_projection=True,
            cross_attention_dim=2 * TEXT_HIDDEN,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_embed_dim,
            projection_class_embeddings_input_dim=TEXT_HIDDEN + 6 * time_embed_dim,
        )
        return StableDiffusionXLPipeline(
            vae=tiny_vae(0.13025),
            text_encoder=CLIPTextModel(clip_text_config(len(tokenizer), "quick_gelu")),
            text_encoder_2=CLIPTextModelWithProjection(clip_text_config(len(tokenizer), "gelu")),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=unet,
            scheduler=tiny_ddim(prediction_type or "epsilon"),
        )


FAMILIES = {"sdxl": SDXL()}
