"""Qwen-Image-Edit: Qwen-Image's transformer, VAE and Qwen2.5-VL, trained and sampled with a reference image that the
model sees twice (diffusers' QwenImageEditPipeline):

- beside the noisy latents: the reference's VAE latents (the posterior's mean, normalised as the image's) packed 2x2
  and appended to the image tokens, `img_shapes` listing both grids, the prediction read from the noisy latents'
  tokens alone;
- in the text: Qwen2.5-VL reads the reference through its vision tower. The caption goes into the edit chat template,
  whose `<|image_pad|>` the processor (Qwen2VLProcessor) expands to the reference's vision tokens; the first 64
  tokens (the system prompt and the user turn's header, 64 with the real tokenizer) are dropped from the last hidden
  states, the rest (the vision tokens, the caption, the assistant header) is the text stream with its mask.

The reference's size. QwenImageEditPipeline scales the reference to about 1024x1024 pixels (calculate_dimensions,
rounded to 32) before both uses, whatever the output size. Training follows SimpleTuner's edit-v1 flavour (the only
peer that trains this model; OneTrainer and diffusers' scripts do not): the reference as the data pair gives it, at
the training image's size, to both the VAE and the processor (SimpleTuner resizes to the condition area only for its
2509 flavours). Samples run the pipeline unchanged, so they see the reference at the pipeline's 1024^2 area.

Text needs the reference, so the text encoder runs each step on (caption, reference) pairs: `tokenize_batch` runs the
processor on the batch's reference pixels. data.cache_text is refused (a text cache keyed on captions alone would
hand every reference the first one's vision tokens); with data.cache_latents the reader gives the references' pixels
(the centre crop, augmented as the cached version) beside the cached latents (`text_reads_references`).

Not done: Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline: several references, each resized to 384^2 for the vision
tower and 1024^2 for the VAE, "Picture N:" prompt prefixes).

LoRA files, single files: Qwen-Image's (the same transformer; ComfyUI maps Qwen-Image-Edit LoRAs with Qwen-Image's
rule and loads the edit model with its Qwen-Image model class).
"""

from __future__ import annotations

import torch

from ot_dist.memory.float8 import compute_dtype
from ot_dist.models.families.flux import pack, unpack
from ot_dist.models.families.qwen_image import QWEN_SCHEDULER, QwenImage, tiny_qwen2_tokenizer
from ot_dist.train.references import reference_latents
from ot_dist.train.transfer import to_device

# QwenImageEditPipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42)
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_TEMPLATE_TOKENS_DROPPED = 64
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


class QwenImageEdit(QwenImage):
    name = "qwen_image_edit"
    description = ("Qwen-Image-Edit (edit model: Qwen-Image with a reference image's latents beside the noisy ones "
                   "and seen by Qwen2.5-VL's vision tower in the text)")
    pipeline_class = "QwenImageEditPipeline"
    reference_images = True
    sample_reference_required = True  # QwenImageEditPipeline reads the reference's size before anything else
    # QwenImageEditPipeline's true_cfg_scale default and its model card's example (OneTrainer has no edit model)
    sample_guidance_scale = 4.0
    memory_reference = "Qwen-Image-Edit"  # Qwen-Image's weights, twice its image tokens plus the vision tokens
    cache_refusals = {
        "cache_text": "Qwen-Image-Edit's text encoder reads each sample's reference image (its vision tokens are part "
                      "of the text stream): a cache of captions alone would be wrong",
    }
    text_reads_references = True  # the vision tower: the reader gives the pixels beside cached latents

    # SwarmUI's class id (T2IModelClassSorter: "qwen-image-edit", in the Qwen-Image compat class); kohya defines none
    modelspec_architecture = "qwen-image-edit"

    # -- loading ------------------------------------------------------------------------------------------
    def folder_components(self, path, given=frozenset()):
        """The processor read as its image processor and tokenizer (image_only_processor):
        Qwen2VLProcessor.from_pretrained would build its video processor, which needs torchvision."""
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = path / "processor"
        if not folder.is_dir():
            return {}  # from_pretrained names what is missing
        return {"processor": image_only_processor(AutoImageProcessor.from_pretrained(folder, local_files_only=True),
                                                  AutoTokenizer.from_pretrained(folder, local_files_only=True))}

    # -- text -------------------------------------------------------------------------------------------
    def tokenize(self, tokenizers, captions):
        raise ValueError("qwen_image_edit: captions are tokenized with their reference images (tokenize_batch)")

    def tokenize_batch(self, model, captions, batch):
        """The processor's ids, mask, pixel values and grid for (caption, reference) pairs: the batch's reference
        pixels as 8-bit RGB images (what the pipeline hands the processor), padded to the batch's longest."""
        if "reference_pixels" not in batch:
            raise ValueError("qwen_image_edit: a batch without reference_pixels (the trainer refuses such data; "
                             "with data.cache_latents the reader gives them: text_reads_references)")
        more = batch.get("more_reference_pixels")
        # per sample its references in order (Picture 1, 2, ...): the order the prompt's vision tokens take them
        per_sample = zip(*(reference_images(p) for p in [batch["reference_pixels"], *(more.unbind(1) if more is not
                                                                                        None else ())]))
        images = [image for sample in per_sample for image in sample]
        count = 1 + (more.shape[1] if more is not None else 0)
        return self.processor_inputs(model.pipeline.processor, captions, self.vision_images(model.pipeline, images),
                                     count)

    def vision_images(self, pipeline, images: list) -> list:
        """The reference images as the vision tower sees them in training: as the pair gives them."""
        return images

    def prompt_text(self, caption: str, references: int = 1) -> str:
        """The chat text of a caption with `references` reference images (one here: max_reference_images)."""
        return EDIT_PROMPT_TEMPLATE.format(caption)

    def processor_inputs(self, processor, captions, images, references: int = 1) -> dict:
        encoded = processor(text=[self.prompt_text(c, references) for c in captions], images=images, padding=True,
                            return_tensors="pt")
        return {"text_encoder": encoded["input_ids"], "text_encoder_mask": encoded["attention_mask"],
                "pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        device = encoder.device
        mask = to_device(tokens["text_encoder_mask"], device)
        # in the compute dtype (the vision tower casts the pixels to its own `.dtype`, which float8 storage reports
        # as the compute dtype: memory/float8.py report_compute_dtype)
        out = encoder(input_ids=to_device(tokens["text_encoder"], device), attention_mask=mask,
                      pixel_values=to_device(tokens["pixel_values"], device, compute_dtype(encoder)),
                      image_grid_thw=to_device(tokens["image_grid_thw"], device), output_hidden_states=True)
        hidden = out.hidden_states[-1]
        # Each row's unpadded tokens less the template's first 64, re-stacked from the left with zeros after
        # (QwenImageEditPipeline._get_qwen_prompt_embeds), whichever side the processor padded.
        rows = [h[m.bool()][EDIT_TEMPLATE_TOKENS_DROPPED:] for h, m in zip(hidden, mask)]
        longest = max(r.shape[0] for r in rows)
        stacked = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
        kept = torch.stack([torch.arange(longest, device=device) < r.shape[0] for r in rows]).long()
        return {"hidden": stacked, "mask": kept}

    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(1024, tokenizer.model_max_length)  # QwenImageEditPipeline's tokenizer_max_length

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        references = reference_latents(conditioning)
        if not references:  # the trainer refuses such data before loading (ot_dist/train/references.py)
            raise ValueError("qwen_image_edit: a denoiser call without reference latents (conditioning "
                             "'reference_latents')")
        b, _, h, w = noisy.shape
        hidden, mask = conditioning["hidden"], conditioning["mask"]
        lengths = edit_caption_lengths(batch, mask)
        longest = max(lengths)
        tokens = denoiser(
            # the noisy latents' tokens, then each reference's (QwenImageEditPlusPipeline's order and img_shapes)
            hidden_states=torch.cat([pack(noisy), *(pack(r.to(noisy)) for r in references)], dim=1),
            encoder_hidden_states=hidden[:, :longest],
            encoder_hidden_states_mask=None if min(lengths) == longest else mask[:, :longest],
            timestep=timesteps.float() / 1000,
            img_shapes=[[(1, h // 2, w // 2), *((1, r.shape[-2] // 2, r.shape[-1] // 2) for r in references)]] * b,
            return_dict=False,
        )[0]
        return unpack(tokens[:, :(h // 2) * (w // 2)], h, w)

    # -- sampling ---------------------------------------------------------------------------------------
    def sampling_arguments(self, pipeline, arguments):
        """The prompt's reference images (upright RGB) as the pipeline's `image`, which scales them itself (1024^2 for
        the VAE; QwenImageEditPlusPipeline 384^2 for the vision tower): one as itself, several (Qwen-Image-Edit-2509)
        as the list `image=[...]` in order ("Picture 1: ", ...); the rest as Qwen-Image's (true_cfg_scale, the blank
        negative prompt)."""
        from ot_dist.data.images import open_image

        arguments = dict(arguments)
        references = [open_image(path) for path in arguments.pop("reference_images", [])]
        out = super().sampling_arguments(pipeline, arguments)
        out.pop("max_sequence_length", None)  # the edit pipeline's text has no cap to pass
        if references:
            out["image"] = references if len(references) > 1 else references[0]
        return out

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from ot_dist.models.tiny import TEXT_HIDDEN

        torch.manual_seed(seed)
        processor = tiny_qwen2_vl_processor()
        tokenizer = processor.tokenizer
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
        # Qwen2.5-VL's layout with a vision tower that runs (patches of 14, 2x2 merge, 2 frames per patch), tiny
        config = Qwen2_5_VLConfig(
            text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=4096,
                             bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[1]),
            vocab_size=len(tokenizer), **ids)
        return self.pipeline_cls()(
            transformer=transformer, vae=vae, text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
            tokenizer=tokenizer, processor=processor, scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER))


def reference_images(pixels: torch.Tensor) -> list:
    """(B, 3, H, W) pixels in [-1, 1] -> 8-bit RGB PIL images (SimpleTuner's _tensor_to_pil rounding)."""
    from PIL import Image

    array = ((pixels.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in array]


def edit_caption_lengths(batch: dict, mask: torch.Tensor) -> list[int]:
    """Each row's text-stream length: from the host copy of the processor's mask (its unpadded tokens less the 64
    dropped) when the batch has it, so the step reads nothing back from the device (issue 21)."""
    if "token_ids" in batch:
        return [sum(row) - EDIT_TEMPLATE_TOKENS_DROPPED for row in batch["token_ids"]["text_encoder_mask"].tolist()]
    return [sum(row) for row in mask.tolist()]


def tiny_qwen2_vl_processor(min_pixels: int = 56 * 56, max_pixels: int = 112 * 112):
    """A Qwen2VLProcessor built offline: the tiny Qwen2 tokenizer trained on the edit template (its system prompt
    and user header tokenize to the 64 tokens the pipeline drops, as the real tokenizer's do) with Qwen2-VL's vision
    tokens, and Qwen2-VL's image processor with a small pixel budget (the real one allows 12.8 M pixels; a tiny
    reference becomes 4 to 16 vision tokens)."""
    from transformers import Qwen2VLImageProcessor

    tokenizer = tiny_qwen2_tokenizer(template=EDIT_PROMPT_TEMPLATE)
    tokenizer.model_max_length = 4096  # the text holds the vision tokens: no caption cap
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14,
                                            merge_size=2, temporal_patch_size=2)
    return image_only_processor(image_processor, tokenizer)


def image_only_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor of an image processor and a tokenizer, without the video processor its constructor
    insists on: transformers 5's video processors need torchvision, which ot_dist does not install, and the edit
    pipeline sends no video. The attributes are those Qwen2VLProcessor.__init__ sets."""
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    processor.image_processor, processor.tokenizer, processor.video_processor = image_processor, tokenizer, None
    processor.chat_template = None
    # save_pretrained writes the parts get_attributes names: these two (the instance's list shadows the class's)
    processor.get_attributes = lambda: ["image_processor", "tokenizer"]
    return processor

# QwenImageEditPlusPipeline's user turn: "Picture N: " and the vision tokens of each reference before the caption
PLUS_PROMPT_TEMPLATE = EDIT_PROMPT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
PLUS_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
# QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: the area each reference is scaled to for the vision tower
PLUS_CONDITION_AREA = 384 * 384


class QwenImageEditPlus(QwenImageEdit):
    """Qwen-Image-Edit-2509 (and 2511, whose transformer config sets zero_cond_t: the transformer itself gives the
    reference's tokens the zero timestep) through QwenImageEditPlusPipeline, with one reference per sample: the
    prompt names it "Picture 1: " before its vision tokens, and the vision tower sees it scaled to 384^2 pixels (the
    pipeline's CONDITION_IMAGE_SIZE, calculate_dimensions, the pipeline's own resize; SimpleTuner's edit-v2 does the
    same). The VAE takes the reference at the training image's size, as for Qwen-Image-Edit (SimpleTuner's edit-v2
    too); samples run the pipeline, which scales it to 1024^2 for the VAE. Several references per sample (up to 3, a
    reference folder's numbered partners `a_0`, `a_1`, ...): "Picture 1: ", "Picture 2: ", ... and each reference's
    latent tokens after the noisy ones, in that order."""

    name = "qwen_image_edit_plus"
    description = ("Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline) with up to 3 reference images per "
                   "sample (\"Picture 1: \", \"Picture 2: \", ..., the vision tower's copies at 384^2)")
    pipeline_class = "QwenImageEditPlusPipeline"
    # SwarmUI's class id (T2IModelClassSorter: "qwen-image-edit-plus")
    modelspec_architecture = "qwen-image-edit-plus"

    # QwenImageEditPlusPipeline sets no cap; Qwen's model card (and musubi-tuner's docs) give up to 3 images
    max_reference_images = 3

    def prompt_text(self, caption: str, references: int = 1) -> str:
        """"Picture 1: ", "Picture 2: ", ... each before its vision tokens, then the caption (the pipeline's
        _get_qwen_prompt_embeds)."""
        return PLUS_PROMPT_TEMPLATE.format("".join(PLUS_PICTURE.format(i + 1) for i in range(references)) + caption)

    def vision_images(self, pipeline, images):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        out = []
        for image in images:
            width, height = calculate_dimensions(PLUS_CONDITION_AREA, image.width / image.height)
            out.append(pipeline.image_processor.resize(image, height, width))
        return out


FAMILIES = {"qwen_image_edit": QwenImageEdit(), "qwen_image_edit_plus": QwenImageEditPlus()}
