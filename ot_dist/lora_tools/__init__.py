"""LoRA files as the tools users pass them around: read in any layout ot_dist writes or other trainers write
(kohya's `lora_unet_*` / `lora_te*` with `.alpha` tensors; diffusers / peft `<component>.<path>.lora_A` / `lora_B`),
merged into a base model, resized by SVD, extracted from a full finetune, or used as a training start."""
