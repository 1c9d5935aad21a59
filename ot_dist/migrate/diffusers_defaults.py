"""The diffusers example scripts' training arguments and their defaults, as each script's own argparse sets them: built
by running every script's `parse_args` (diffusers commit 58eb52c0, August 2026) up to its `parser.parse_args` call and
reading the parser's actions (dest, default, store_true / type / nargs); the scripts' imports were stubbed, nothing
else. A key a command line leaves out trains with the script's default, which is what this table gives.

Scripts: examples/text_to_image/train_text_to_image{,_lora,_sdxl,_lora_sdxl}.py, examples/dreambooth/
train_dreambooth{,_lora,_lora_sdxl,_sd3,_lora_sd3,_flux,_lora_flux,_lora_sana,_lora_qwen_image,_lora_lumina2}.py (and
_lora_flux2{,_klein}.py and _lora_hidream.py, at the end),
examples/textual_inversion/textual_inversion.py."""

from __future__ import annotations

SHARED = {'adam_beta1': 0.9, 'adam_beta2': 0.999, 'adam_epsilon': 1e-08, 'adam_weight_decay_text_encoder': 0.001,
          'allow_tf32': False, 'aspect_ratio_buckets': None, 'bnb_quantization_config_path': None, 'cache_dir': None,
          'cache_latents': False, 'caption_dropout': 0.0, 'center_crop': False, 'checkpointing_steps': 500,
          'checkpoints_total_limit': None, 'class_data_dir': None, 'class_labels_conditioning': None, 'class_prompt':
          None, 'complex_human_instruction': None, 'dataloader_num_workers': 0, 'dataset_config_name': None,
          'dataset_name': None, 'debug_loss': False, 'do_edm_style_training': False, 'dream_detail_preservation': 1.0,
          'dream_training': False, 'enable_npu_flash_attention': False, 'enable_vae_tiling': False,
          'enable_xformers_memory_efficient_attention': False, 'final_validation_prompt': None, 'foreach_ema': False,
          'gradient_accumulation_steps': 1, 'gradient_checkpointing': False, 'guidance_scale': 3.5, 'hub_model_id':
          None, 'hub_token': None, 'image_column': 'image', 'image_interpolation_mode': 'lanczos', 'initializer_token':
          None, 'input_perturbation': 0, 'instance_data_dir': None, 'instance_prompt': None, 'learnable_property':
          'object', 'local_rank': -1, 'logging_dir': 'logs', 'logit_mean': 0.0, 'logit_std': 1.0, 'lora_alpha': 4,
          'lora_blocks': None, 'lora_dropout': 0.0, 'lora_layers': None, 'lr_num_cycles': 1, 'lr_power': 1.0,
          'lr_scheduler': 'constant', 'lr_warmup_steps': 500, 'max_grad_norm': 1.0, 'max_train_samples': None,
          'mode_scale': 1.29, 'no_safe_serialization': False, 'noise_offset': 0, 'non_ema_revision': None,
          'num_class_images': 100, 'num_validation_images': 4, 'num_vectors': 1, 'offload': False, 'offload_ema': False,
          'offset_noise': False, 'optimizer': 'AdamW', 'output_kohya_format': False, 'placeholder_token': None,
          'pre_compute_text_embeddings': False, 'precondition_outputs': 1, 'prediction_type': None,
          'pretrained_model_name_or_path': None, 'pretrained_text_encoder_4_name_or_path':
          'meta-llama/Meta-Llama-3.1-8B-Instruct', 'pretrained_tokenizer_4_name_or_path':
          'meta-llama/Meta-Llama-3.1-8B-Instruct', 'pretrained_vae_model_name_or_path': None,
          'prior_generation_precision': None, 'prior_loss_weight': 1.0, 'prodigy_beta3': None, 'prodigy_decouple': True,
          'prodigy_safeguard_warmup': True, 'prodigy_use_bias_correction': True, 'proportion_empty_prompts': 0,
          'push_to_hub': False, 'random_flip': False, 'rank': 4, 'report_to': 'tensorboard', 'resume_from_checkpoint':
          None, 'revision': None, 'sample_batch_size': 4, 'save_as_full_pipeline': False, 'save_steps': 500, 'scale_lr':
          False, 'seed': None, 'set_grads_to_none': False, 'skip_final_inference': False, 'skip_save_text_encoder':
          False, 'snr_gamma': None, 'text_encoder_lr': 5e-06, 'text_encoder_use_attention_mask': False,
          'timestep_bias_begin': 0, 'timestep_bias_end': 1000, 'timestep_bias_multiplier': 1.0, 'timestep_bias_portion':
          0.25, 'timestep_bias_strategy': 'none', 'tokenizer_max_length': None, 'tokenizer_name': None,
          'tracker_project_name': 'text2image-fine-tune', 'train_data_dir': None, 'train_text_encoder': False,
          'upcast_before_saving': False, 'use_8bit_adam': False, 'use_aspect_ratio_buckets': False, 'use_dora': False,
          'use_ema': False, 'validation_images': None, 'validation_prompt': None, 'validation_prompts': None,
          'validation_scheduler': 'DPMSolverMultistepScheduler', 'validation_steps': 100, 'variant': None,
          'with_prior_preservation': False}

# the defaults that differ between the scripts: key -> script -> default
BY_SCRIPT = {'adam_weight_decay': {'train_text_to_image.py': 0.01, 'train_text_to_image_lora.py': 0.01,
             'train_text_to_image_sdxl.py': 0.01, 'train_text_to_image_lora_sdxl.py': 0.01, 'train_dreambooth.py': 0.01,
             'train_dreambooth_lora.py': 0.01, 'train_dreambooth_lora_sdxl.py': 0.0001, 'train_dreambooth_sd3.py':
             0.0001, 'train_dreambooth_lora_sd3.py': 0.0001, 'train_dreambooth_flux.py': 0.0001,
             'train_dreambooth_lora_flux.py': 0.0001, 'textual_inversion.py': 0.01, 'train_dreambooth_lora_sana.py':
             0.0001, 'train_dreambooth_lora_qwen_image.py': 0.0001}, 'caption_column': {'train_text_to_image.py':
             'text', 'train_text_to_image_lora.py': 'text', 'train_text_to_image_sdxl.py': 'text',
             'train_text_to_image_lora_sdxl.py': 'text', 'train_dreambooth_lora_sdxl.py': None,
             'train_dreambooth_sd3.py': None, 'train_dreambooth_lora_sd3.py': None, 'train_dreambooth_flux.py': None,
             'train_dreambooth_lora_flux.py': None, 'train_dreambooth_lora_sana.py': None,
             'train_dreambooth_lora_qwen_image.py': None}, 'learning_rate': {'train_text_to_image.py': 0.0001,
             'train_text_to_image_lora.py': 0.0001, 'train_text_to_image_sdxl.py': 0.0001,
             'train_text_to_image_lora_sdxl.py': 0.0001, 'train_dreambooth.py': 5e-06, 'train_dreambooth_lora.py':
             0.0005, 'train_dreambooth_lora_sdxl.py': 0.0001, 'train_dreambooth_sd3.py': 0.0001,
             'train_dreambooth_lora_sd3.py': 0.0001, 'train_dreambooth_flux.py': 0.0001,
             'train_dreambooth_lora_flux.py': 0.0001, 'textual_inversion.py': 0.0001, 'train_dreambooth_lora_sana.py':
             0.0001, 'train_dreambooth_lora_qwen_image.py': 0.0001}, 'max_sequence_length': {'train_dreambooth_sd3.py':
             77, 'train_dreambooth_lora_sd3.py': 77, 'train_dreambooth_flux.py': 77, 'train_dreambooth_lora_flux.py':
             512, 'train_dreambooth_lora_sana.py': 300, 'train_dreambooth_lora_qwen_image.py': 512}, 'max_train_steps':
             {'train_text_to_image.py': None, 'train_text_to_image_lora.py': None, 'train_text_to_image_sdxl.py': None,
             'train_text_to_image_lora_sdxl.py': None, 'train_dreambooth.py': None, 'train_dreambooth_lora.py': None,
             'train_dreambooth_lora_sdxl.py': None, 'train_dreambooth_sd3.py': None, 'train_dreambooth_lora_sd3.py':
             None, 'train_dreambooth_flux.py': None, 'train_dreambooth_lora_flux.py': None, 'textual_inversion.py':
             5000, 'train_dreambooth_lora_sana.py': None, 'train_dreambooth_lora_qwen_image.py': None},
             'mixed_precision': {'train_text_to_image.py': None, 'train_text_to_image_lora.py': None,
             'train_text_to_image_sdxl.py': None, 'train_text_to_image_lora_sdxl.py': None, 'train_dreambooth.py': None,
             'train_dreambooth_lora.py': None, 'train_dreambooth_lora_sdxl.py': None, 'train_dreambooth_sd3.py': None,
             'train_dreambooth_lora_sd3.py': None, 'train_dreambooth_flux.py': None, 'train_dreambooth_lora_flux.py':
             None, 'textual_inversion.py': 'no', 'train_dreambooth_lora_sana.py': None,
             'train_dreambooth_lora_qwen_image.py': None}, 'num_train_epochs': {'train_text_to_image.py': 100,
             'train_text_to_image_lora.py': 100, 'train_text_to_image_sdxl.py': 100, 'train_text_to_image_lora_sdxl.py':
             100, 'train_dreambooth.py': 1, 'train_dreambooth_lora.py': 1, 'train_dreambooth_lora_sdxl.py': 1,
             'train_dreambooth_sd3.py': 1, 'train_dreambooth_lora_sd3.py': 1, 'train_dreambooth_flux.py': 1,
             'train_dreambooth_lora_flux.py': 1, 'textual_inversion.py': 100, 'train_dreambooth_lora_sana.py': 1,
             'train_dreambooth_lora_qwen_image.py': 1}, 'output_dir': {'train_text_to_image.py': 'sd-model-finetuned',
             'train_text_to_image_lora.py': 'sd-model-finetuned-lora', 'train_text_to_image_sdxl.py':
             'sdxl-model-finetuned', 'train_text_to_image_lora_sdxl.py': 'sd-model-finetuned-lora',
             'train_dreambooth.py': 'dreambooth-model', 'train_dreambooth_lora.py': 'lora-dreambooth-model',
             'train_dreambooth_lora_sdxl.py': 'lora-dreambooth-model', 'train_dreambooth_sd3.py': 'sd3-dreambooth',
             'train_dreambooth_lora_sd3.py': 'sd3-dreambooth', 'train_dreambooth_flux.py': 'flux-dreambooth',
             'train_dreambooth_lora_flux.py': 'flux-dreambooth-lora', 'textual_inversion.py': 'text-inversion-model',
             'train_dreambooth_lora_sana.py': 'sana-dreambooth-lora', 'train_dreambooth_lora_qwen_image.py':
             'hidream-dreambooth-lora'}, 'repeats': {'train_dreambooth_lora_sdxl.py': 1, 'train_dreambooth_sd3.py': 1,
             'train_dreambooth_lora_sd3.py': 1, 'train_dreambooth_flux.py': 1, 'train_dreambooth_lora_flux.py': 1,
             'textual_inversion.py': 100, 'train_dreambooth_lora_sana.py': 1, 'train_dreambooth_lora_qwen_image.py': 1},
             'resolution': {'train_text_to_image.py': 512, 'train_text_to_image_lora.py': 512,
             'train_text_to_image_sdxl.py': 1024, 'train_text_to_image_lora_sdxl.py': 1024, 'train_dreambooth.py': 512,
             'train_dreambooth_lora.py': 512, 'train_dreambooth_lora_sdxl.py': 1024, 'train_dreambooth_sd3.py': 512,
             'train_dreambooth_lora_sd3.py': 512, 'train_dreambooth_flux.py': 512, 'train_dreambooth_lora_flux.py': 512,
             'textual_inversion.py': 512, 'train_dreambooth_lora_sana.py': 512, 'train_dreambooth_lora_qwen_image.py':
             512}, 'train_batch_size': {'train_text_to_image.py': 16, 'train_text_to_image_lora.py': 16,
             'train_text_to_image_sdxl.py': 16, 'train_text_to_image_lora_sdxl.py': 16, 'train_dreambooth.py': 4,
             'train_dreambooth_lora.py': 4, 'train_dreambooth_lora_sdxl.py': 4, 'train_dreambooth_sd3.py': 4,
             'train_dreambooth_lora_sd3.py': 4, 'train_dreambooth_flux.py': 4, 'train_dreambooth_lora_flux.py': 4,
             'textual_inversion.py': 16, 'train_dreambooth_lora_sana.py': 4, 'train_dreambooth_lora_qwen_image.py': 4},
             'validation_epochs': {'train_text_to_image.py': 5, 'train_text_to_image_lora.py': 1,
             'train_text_to_image_sdxl.py': 1, 'train_text_to_image_lora_sdxl.py': 1, 'train_dreambooth_lora.py': 50,
             'train_dreambooth_lora_sdxl.py': 50, 'train_dreambooth_sd3.py': 50, 'train_dreambooth_lora_sd3.py': 50,
             'train_dreambooth_flux.py': 50, 'train_dreambooth_lora_flux.py': 50, 'textual_inversion.py': None,
             'train_dreambooth_lora_sana.py': 50, 'train_dreambooth_lora_qwen_image.py': 50}, 'weighting_scheme':
             {'train_dreambooth_sd3.py': 'logit_normal', 'train_dreambooth_lora_sd3.py': 'logit_normal',
             'train_dreambooth_flux.py': 'none', 'train_dreambooth_lora_flux.py': 'none',
             'train_dreambooth_lora_sana.py': 'none', 'train_dreambooth_lora_qwen_image.py': 'none'}}

# each script's arguments (argparse dests)
SCRIPT_ARGS = {
    'train_text_to_image.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 cache_dir caption_column center_crop
        checkpointing_steps checkpoints_total_limit dataloader_num_workers dataset_config_name
        dataset_name dream_detail_preservation dream_training
        enable_xformers_memory_efficient_attention foreach_ema gradient_accumulation_steps
        gradient_checkpointing hub_model_id hub_token image_column image_interpolation_mode
        input_perturbation learning_rate local_rank logging_dir lr_scheduler lr_warmup_steps
        max_grad_norm max_train_samples max_train_steps mixed_precision noise_offset
        non_ema_revision num_train_epochs offload_ema output_dir prediction_type
        pretrained_model_name_or_path push_to_hub random_flip report_to resolution
        resume_from_checkpoint revision scale_lr seed snr_gamma tracker_project_name
        train_batch_size train_data_dir use_8bit_adam use_ema validation_epochs validation_prompts
        variant""".split()),
    'train_text_to_image_lora.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 cache_dir caption_column center_crop
        checkpointing_steps checkpoints_total_limit dataloader_num_workers dataset_config_name
        dataset_name enable_xformers_memory_efficient_attention gradient_accumulation_steps
        gradient_checkpointing hub_model_id hub_token image_column image_interpolation_mode
        learning_rate local_rank logging_dir lr_scheduler lr_warmup_steps max_grad_norm
        max_train_samples max_train_steps mixed_precision noise_offset num_train_epochs
        num_validation_images output_dir prediction_type pretrained_model_name_or_path push_to_hub
        random_flip rank report_to resolution resume_from_checkpoint revision scale_lr seed
        snr_gamma train_batch_size train_data_dir use_8bit_adam validation_epochs validation_prompt
        variant""".split()),
    'train_text_to_image_sdxl.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 cache_dir caption_column center_crop
        checkpointing_steps checkpoints_total_limit dataloader_num_workers dataset_config_name
        dataset_name enable_npu_flash_attention enable_xformers_memory_efficient_attention
        gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token image_column
        image_interpolation_mode learning_rate local_rank logging_dir lr_scheduler lr_warmup_steps
        max_grad_norm max_train_samples max_train_steps mixed_precision noise_offset
        num_train_epochs num_validation_images output_dir prediction_type
        pretrained_model_name_or_path pretrained_vae_model_name_or_path proportion_empty_prompts
        push_to_hub random_flip report_to resolution resume_from_checkpoint revision scale_lr seed
        snr_gamma timestep_bias_begin timestep_bias_end timestep_bias_multiplier
        timestep_bias_portion timestep_bias_strategy train_batch_size train_data_dir use_8bit_adam
        use_ema validation_epochs validation_prompt variant""".split()),
    'train_text_to_image_lora_sdxl.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 cache_dir caption_column center_crop
        checkpointing_steps checkpoints_total_limit dataloader_num_workers dataset_config_name
        dataset_name debug_loss enable_npu_flash_attention
        enable_xformers_memory_efficient_attention gradient_accumulation_steps
        gradient_checkpointing hub_model_id hub_token image_column image_interpolation_mode
        learning_rate local_rank logging_dir lr_scheduler lr_warmup_steps max_grad_norm
        max_train_samples max_train_steps mixed_precision noise_offset num_train_epochs
        num_validation_images output_dir prediction_type pretrained_model_name_or_path
        pretrained_vae_model_name_or_path push_to_hub random_flip rank report_to resolution
        resume_from_checkpoint revision scale_lr seed snr_gamma train_batch_size train_data_dir
        train_text_encoder use_8bit_adam validation_epochs validation_prompt variant""".split()),
    'train_dreambooth.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 center_crop checkpointing_steps
        checkpoints_total_limit class_data_dir class_labels_conditioning class_prompt
        dataloader_num_workers enable_xformers_memory_efficient_attention
        gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token instance_data_dir
        instance_prompt learning_rate local_rank logging_dir lr_num_cycles lr_power lr_scheduler
        lr_warmup_steps max_grad_norm max_train_steps mixed_precision num_class_images
        num_train_epochs num_validation_images offset_noise output_dir pre_compute_text_embeddings
        pretrained_model_name_or_path prior_generation_precision prior_loss_weight push_to_hub
        report_to resolution resume_from_checkpoint revision sample_batch_size scale_lr seed
        set_grads_to_none skip_save_text_encoder snr_gamma text_encoder_use_attention_mask
        tokenizer_max_length tokenizer_name train_batch_size train_text_encoder use_8bit_adam
        validation_images validation_prompt validation_scheduler validation_steps variant
        with_prior_preservation""".split()),
    'train_dreambooth_lora.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 center_crop checkpointing_steps
        checkpoints_total_limit class_data_dir class_labels_conditioning class_prompt
        dataloader_num_workers enable_xformers_memory_efficient_attention
        gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token
        image_interpolation_mode instance_data_dir instance_prompt learning_rate local_rank
        logging_dir lora_dropout lr_num_cycles lr_power lr_scheduler lr_warmup_steps max_grad_norm
        max_train_steps mixed_precision num_class_images num_train_epochs num_validation_images
        output_dir pre_compute_text_embeddings pretrained_model_name_or_path
        prior_generation_precision prior_loss_weight push_to_hub rank report_to resolution
        resume_from_checkpoint revision sample_batch_size scale_lr seed
        text_encoder_use_attention_mask tokenizer_max_length tokenizer_name train_batch_size
        train_text_encoder use_8bit_adam validation_epochs validation_images validation_prompt
        variant with_prior_preservation""".split()),
    'train_dreambooth_lora_sdxl.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay adam_weight_decay_text_encoder allow_tf32
        cache_dir caption_column center_crop checkpointing_steps checkpoints_total_limit
        class_data_dir class_prompt dataloader_num_workers dataset_config_name dataset_name
        do_edm_style_training enable_xformers_memory_efficient_attention gradient_accumulation_steps
        gradient_checkpointing hub_model_id hub_token image_column image_interpolation_mode
        instance_data_dir instance_prompt learning_rate local_rank logging_dir lora_dropout
        lr_num_cycles lr_power lr_scheduler lr_warmup_steps max_grad_norm max_train_steps
        mixed_precision num_class_images num_train_epochs num_validation_images optimizer output_dir
        output_kohya_format pretrained_model_name_or_path pretrained_vae_model_name_or_path
        prior_generation_precision prior_loss_weight prodigy_beta3 prodigy_decouple
        prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub random_flip rank repeats
        report_to resolution resume_from_checkpoint revision sample_batch_size scale_lr seed
        snr_gamma text_encoder_lr train_batch_size train_text_encoder use_8bit_adam use_dora
        validation_epochs validation_prompt variant with_prior_preservation""".split()),
    'train_dreambooth_sd3.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay adam_weight_decay_text_encoder allow_tf32
        cache_dir caption_column center_crop checkpointing_steps checkpoints_total_limit
        class_data_dir class_prompt dataloader_num_workers dataset_config_name dataset_name
        gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token image_column
        instance_data_dir instance_prompt learning_rate local_rank logging_dir logit_mean logit_std
        lr_num_cycles lr_power lr_scheduler lr_warmup_steps max_grad_norm max_sequence_length
        max_train_steps mixed_precision mode_scale num_class_images num_train_epochs
        num_validation_images optimizer output_dir precondition_outputs
        pretrained_model_name_or_path prior_generation_precision prior_loss_weight prodigy_beta3
        prodigy_decouple prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub
        random_flip repeats report_to resolution resume_from_checkpoint revision sample_batch_size
        scale_lr seed text_encoder_lr train_batch_size train_text_encoder use_8bit_adam
        validation_epochs validation_prompt variant weighting_scheme with_prior_preservation""".split()),
    'train_dreambooth_lora_sd3.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay adam_weight_decay_text_encoder allow_tf32
        cache_dir cache_latents caption_column center_crop checkpointing_steps
        checkpoints_total_limit class_data_dir class_prompt dataloader_num_workers
        dataset_config_name dataset_name gradient_accumulation_steps gradient_checkpointing
        hub_model_id hub_token image_column instance_data_dir instance_prompt learning_rate
        local_rank logging_dir logit_mean logit_std lora_blocks lora_dropout lora_layers
        lr_num_cycles lr_power lr_scheduler lr_warmup_steps max_grad_norm max_sequence_length
        max_train_steps mixed_precision mode_scale num_class_images num_train_epochs
        num_validation_images optimizer output_dir precondition_outputs
        pretrained_model_name_or_path prior_generation_precision prior_loss_weight prodigy_beta3
        prodigy_decouple prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub
        random_flip rank repeats report_to resolution resume_from_checkpoint revision
        sample_batch_size scale_lr seed text_encoder_lr train_batch_size train_text_encoder
        upcast_before_saving use_8bit_adam validation_epochs validation_prompt variant
        weighting_scheme with_prior_preservation""".split()),
    'train_dreambooth_flux.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay adam_weight_decay_text_encoder allow_tf32
        cache_dir caption_column center_crop checkpointing_steps checkpoints_total_limit
        class_data_dir class_prompt dataloader_num_workers dataset_config_name dataset_name
        enable_npu_flash_attention gradient_accumulation_steps gradient_checkpointing guidance_scale
        hub_model_id hub_token image_column image_interpolation_mode instance_data_dir
        instance_prompt learning_rate local_rank logging_dir logit_mean logit_std lr_num_cycles
        lr_power lr_scheduler lr_warmup_steps max_grad_norm max_sequence_length max_train_steps
        mixed_precision mode_scale num_class_images num_train_epochs num_validation_images optimizer
        output_dir pretrained_model_name_or_path prior_generation_precision prior_loss_weight
        prodigy_beta3 prodigy_decouple prodigy_safeguard_warmup prodigy_use_bias_correction
        push_to_hub random_flip repeats report_to resolution resume_from_checkpoint revision
        sample_batch_size scale_lr seed text_encoder_lr train_batch_size train_text_encoder
        use_8bit_adam validation_epochs validation_prompt variant weighting_scheme
        with_prior_preservation""".split()),
    'train_dreambooth_lora_flux.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay adam_weight_decay_text_encoder allow_tf32
        cache_dir cache_latents caption_column center_crop checkpointing_steps
        checkpoints_total_limit class_data_dir class_prompt dataloader_num_workers
        dataset_config_name dataset_name enable_npu_flash_attention gradient_accumulation_steps
        gradient_checkpointing guidance_scale hub_model_id hub_token image_column instance_data_dir
        instance_prompt learning_rate local_rank logging_dir logit_mean logit_std lora_alpha
        lora_dropout lora_layers lr_num_cycles lr_power lr_scheduler lr_warmup_steps max_grad_norm
        max_sequence_length max_train_steps mixed_precision mode_scale num_class_images
        num_train_epochs num_validation_images optimizer output_dir pretrained_model_name_or_path
        prior_generation_precision prior_loss_weight prodigy_beta3 prodigy_decouple
        prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub random_flip rank repeats
        report_to resolution resume_from_checkpoint revision sample_batch_size scale_lr seed
        text_encoder_lr train_batch_size train_text_encoder upcast_before_saving use_8bit_adam
        validation_epochs validation_prompt variant weighting_scheme with_prior_preservation""".split()),
    'textual_inversion.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 center_crop checkpointing_steps
        checkpoints_total_limit dataloader_num_workers enable_xformers_memory_efficient_attention
        gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token initializer_token
        learnable_property learning_rate local_rank logging_dir lr_num_cycles lr_scheduler
        lr_warmup_steps max_train_steps mixed_precision no_safe_serialization num_train_epochs
        num_validation_images num_vectors output_dir placeholder_token pretrained_model_name_or_path
        push_to_hub repeats report_to resolution resume_from_checkpoint revision
        save_as_full_pipeline save_steps scale_lr seed tokenizer_name train_batch_size
        train_data_dir validation_epochs validation_prompt validation_steps variant""".split()),
    'train_dreambooth_lora_sana.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay adam_weight_decay_text_encoder allow_tf32
        cache_dir cache_latents caption_column center_crop checkpointing_steps
        checkpoints_total_limit class_data_dir class_prompt complex_human_instruction
        dataloader_num_workers dataset_config_name dataset_name enable_npu_flash_attention
        enable_vae_tiling gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token
        image_column instance_data_dir instance_prompt learning_rate local_rank logging_dir
        logit_mean logit_std lora_alpha lora_dropout lora_layers lr_num_cycles lr_power lr_scheduler
        lr_warmup_steps max_grad_norm max_sequence_length max_train_steps mixed_precision mode_scale
        num_class_images num_train_epochs num_validation_images offload optimizer output_dir
        pretrained_model_name_or_path prior_loss_weight prodigy_beta3 prodigy_decouple
        prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub random_flip rank repeats
        report_to resolution resume_from_checkpoint revision sample_batch_size scale_lr seed
        train_batch_size upcast_before_saving use_8bit_adam validation_epochs validation_prompt
        variant weighting_scheme with_prior_preservation""".split()),
    'train_dreambooth_lora_qwen_image.py': frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 aspect_ratio_buckets
        bnb_quantization_config_path cache_dir cache_latents caption_column caption_dropout
        center_crop checkpointing_steps checkpoints_total_limit class_data_dir class_prompt
        dataloader_num_workers dataset_config_name dataset_name final_validation_prompt
        gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token image_column
        instance_data_dir instance_prompt learning_rate local_rank logging_dir logit_mean logit_std
        lora_alpha lora_dropout lora_layers lr_num_cycles lr_power lr_scheduler lr_warmup_steps
        max_grad_norm max_sequence_length max_train_steps mixed_precision mode_scale
        num_class_images num_train_epochs num_validation_images offload optimizer output_dir
        pretrained_model_name_or_path pretrained_text_encoder_4_name_or_path
        pretrained_tokenizer_4_name_or_path prior_loss_weight prodigy_beta3 prodigy_decouple
        prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub random_flip rank repeats
        report_to resolution resume_from_checkpoint revision sample_batch_size scale_lr seed
        skip_final_inference train_batch_size upcast_before_saving use_8bit_adam
        use_aspect_ratio_buckets validation_epochs validation_prompt variant weighting_scheme
        with_prior_preservation""".split()),
}

# how each argument's value is read: flag (store_true), int, float, str, bool (argparse type=bool: any non-empty
# text is True), list (nargs)
KINDS = {'adam_beta1': 'float', 'adam_beta2': 'float', 'adam_epsilon': 'float', 'adam_weight_decay': 'float',
         'adam_weight_decay_text_encoder': 'float', 'allow_tf32': 'flag', 'aspect_ratio_buckets': 'str',
         'bnb_quantization_config_path': 'str', 'cache_dir': 'str', 'cache_latents': 'flag', 'caption_column': 'str',
         'caption_dropout': 'float', 'center_crop': 'flag', 'checkpointing_steps': 'int', 'checkpoints_total_limit':
         'int', 'class_data_dir': 'str', 'class_labels_conditioning': 'str', 'class_prompt': 'str',
         'complex_human_instruction': 'str', 'dataloader_num_workers': 'int', 'dataset_config_name': 'str',
         'dataset_name': 'str', 'debug_loss': 'flag', 'do_edm_style_training': 'flag', 'dream_detail_preservation':
         'float', 'dream_training': 'flag', 'enable_npu_flash_attention': 'flag', 'enable_vae_tiling': 'flag',
         'enable_xformers_memory_efficient_attention': 'flag', 'final_validation_prompt': 'str', 'foreach_ema': 'flag',
         'gradient_accumulation_steps': 'int', 'gradient_checkpointing': 'flag', 'guidance_scale': 'float',
         'hub_model_id': 'str', 'hub_token': 'str', 'image_column': 'str', 'image_interpolation_mode': 'str',
         'initializer_token': 'str', 'input_perturbation': 'float', 'instance_data_dir': 'str', 'instance_prompt':
         'str', 'learnable_property': 'str', 'learning_rate': 'float', 'local_rank': 'int', 'logging_dir': 'str',
         'logit_mean': 'float', 'logit_std': 'float', 'lora_alpha': 'int', 'lora_blocks': 'str', 'lora_dropout':
         'float', 'lora_layers': 'str', 'lr_num_cycles': 'int', 'lr_power': 'float', 'lr_scheduler': 'str',
         'lr_warmup_steps': 'int', 'max_grad_norm': 'float', 'max_sequence_length': 'int', 'max_train_samples': 'int',
         'max_train_steps': 'int', 'mixed_precision': 'str', 'mode_scale': 'float', 'no_safe_serialization': 'flag',
         'noise_offset': 'float', 'non_ema_revision': 'str', 'num_class_images': 'int', 'num_train_epochs': 'int',
         'num_validation_images': 'int', 'num_vectors': 'int', 'offload': 'flag', 'offload_ema': 'flag', 'offset_noise':
         'flag', 'optimizer': 'str', 'output_dir': 'str', 'output_kohya_format': 'flag', 'placeholder_token': 'str',
         'pre_compute_text_embeddings': 'flag', 'precondition_outputs': 'int', 'prediction_type': 'str',
         'pretrained_model_name_or_path': 'str', 'pretrained_text_encoder_4_name_or_path': 'str',
         'pretrained_tokenizer_4_name_or_path': 'str', 'pretrained_vae_model_name_or_path': 'str',
         'prior_generation_precision': 'str', 'prior_loss_weight': 'float', 'prodigy_beta3': 'float',
         'prodigy_decouple': 'bool', 'prodigy_safeguard_warmup': 'bool', 'prodigy_use_bias_correction': 'bool',
         'proportion_empty_prompts': 'float', 'push_to_hub': 'flag', 'random_flip': 'flag', 'rank': 'int', 'repeats':
         'int', 'report_to': 'str', 'resolution': 'int', 'resume_from_checkpoint': 'str', 'revision': 'str',
         'sample_batch_size': 'int', 'save_as_full_pipeline': 'flag', 'save_steps': 'int', 'scale_lr': 'flag', 'seed':
         'int', 'set_grads_to_none': 'flag', 'skip_final_inference': 'flag', 'skip_save_text_encoder': 'flag',
         'snr_gamma': 'float', 'text_encoder_lr': 'float', 'text_encoder_use_attention_mask': 'flag',
         'timestep_bias_begin': 'int', 'timestep_bias_end': 'int', 'timestep_bias_multiplier': 'float',
         'timestep_bias_portion': 'float', 'timestep_bias_strategy': 'str', 'tokenizer_max_length': 'int',
         'tokenizer_name': 'str', 'tracker_project_name': 'str', 'train_batch_size': 'int', 'train_data_dir': 'str',
         'train_text_encoder': 'flag', 'upcast_before_saving': 'flag', 'use_8bit_adam': 'flag',
         'use_aspect_ratio_buckets': 'flag', 'use_dora': 'flag', 'use_ema': 'flag', 'validation_epochs': 'int',
         'validation_images': 'list', 'validation_prompt': 'str', 'validation_prompts': 'list', 'validation_scheduler':
         'str', 'validation_steps': 'int', 'variant': 'str', 'weighting_scheme': 'str', 'with_prior_preservation':
         'flag'}


# train_dreambooth_lora_lumina2.py, its parser read the same way (diffusers commit c56add80, July 2026): its one argument
# of its own (system_prompt), its defaults where the scripts differ, its arguments.
SHARED["system_prompt"] = None
KINDS["system_prompt"] = "str"
LUMINA2 = "train_dreambooth_lora_lumina2.py"
for _key, _value in {'caption_column': None, 'repeats': 1, 'max_sequence_length': 256, 'validation_epochs': 50,
                     'output_dir': 'lumina2-dreambooth-lora', 'resolution': 512, 'train_batch_size': 4,
                     'num_train_epochs': 1, 'max_train_steps': None, 'learning_rate': 0.0001,
                     'weighting_scheme': 'none', 'adam_weight_decay': 0.0001, 'mixed_precision': None}.items():
    BY_SCRIPT[_key][LUMINA2] = _value
SCRIPT_ARGS[LUMINA2] = frozenset("""
    adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32 cache_dir cache_latents caption_column
    center_crop checkpointing_steps checkpoints_total_limit class_data_dir class_prompt
    dataloader_num_workers dataset_config_name dataset_name final_validation_prompt
    gradient_accumulation_steps gradient_checkpointing hub_model_id hub_token image_column
    image_interpolation_mode instance_data_dir instance_prompt learning_rate local_rank logging_dir
    logit_mean logit_std lora_dropout lora_layers lr_num_cycles lr_power lr_scheduler lr_warmup_steps
    max_grad_norm max_sequence_length max_train_steps mixed_precision mode_scale num_class_images
    num_train_epochs num_validation_images offload optimizer output_dir pretrained_model_name_or_path
    prior_loss_weight prodigy_beta3 prodigy_decouple prodigy_safeguard_warmup prodigy_use_bias_correction
    push_to_hub random_flip rank repeats report_to resolution resume_from_checkpoint revision
    sample_batch_size scale_lr seed system_prompt train_batch_size upcast_before_saving use_8bit_adam
    validation_epochs validation_prompt variant weighting_scheme with_prior_preservation""".split())


# Per script, defaults of its own for arguments whose default is otherwise SHARED's (filled in below)
SCRIPT_OWN: dict[str, dict] = {}


def defaults(script: str) -> dict:
    """Every argument of `script` with its default."""
    if script in _FLUX2_SCRIPTS:
        own, dropped = _FLUX2_SCRIPTS[script]
        return {**{k: v for k, v in defaults(_QWEN_IMAGE).items() if k not in dropped}, **own}
    own = SCRIPT_OWN.get(script, {})
    return {key: own[key] if key in own else BY_SCRIPT[key][script] if key in BY_SCRIPT else SHARED[key]
            for key in SCRIPT_ARGS[script]}


# examples/dreambooth/train_dreambooth_lora_z_image.py (diffusers commit 2919c50962, July 2026), read the same way: its
# arguments, its defaults where SHARED does not give them, and the kinds of the two arguments no other script has
Z_IMAGE_SCRIPT = "train_dreambooth_lora_z_image.py"
SCRIPT_ARGS[Z_IMAGE_SCRIPT] = frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay
    adam_weight_decay_text_encoder allow_tf32 aspect_ratio_buckets bnb_quantization_config_path cache_dir cache_latents
    caption_column center_crop checkpointing_steps checkpoints_total_limit class_data_dir class_prompt
    dataloader_num_workers dataset_config_name dataset_name do_fp8_training enable_npu_flash_attention
    final_validation_prompt fsdp_text_encoder gradient_accumulation_steps gradient_checkpointing guidance_scale
    hub_model_id hub_token image_column instance_data_dir instance_prompt learning_rate local_rank logging_dir
    logit_mean logit_std lora_alpha lora_dropout lora_layers lr_num_cycles lr_power lr_scheduler lr_warmup_steps
    max_grad_norm max_sequence_length max_train_steps mixed_precision mode_scale num_class_images num_train_epochs
    num_validation_images offload optimizer output_dir pretrained_model_name_or_path prior_generation_precision
    prior_loss_weight prodigy_beta3 prodigy_decouple prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub
    random_flip rank repeats report_to resolution resume_from_checkpoint revision sample_batch_size scale_lr seed
    skip_final_inference text_encoder_lr train_batch_size upcast_before_saving use_8bit_adam use_aspect_ratio_buckets
    validation_epochs validation_prompt variant weighting_scheme with_prior_preservation""".split())
SHARED.update(do_fp8_training=False, fsdp_text_encoder=False)
KINDS.update(do_fp8_training="flag", fsdp_text_encoder="flag")
for _key, _default in {"adam_weight_decay": 0.0001, "caption_column": None, "learning_rate": 0.0001,
                       "max_sequence_length": 512, "max_train_steps": None, "mixed_precision": None,
                       "num_train_epochs": 1, "output_dir": "z-image-dreambooth-lora", "repeats": 1, "resolution": 512,
                       "train_batch_size": 4, "validation_epochs": 50, "weighting_scheme": "none"}.items():
    BY_SCRIPT[_key][Z_IMAGE_SCRIPT] = _default

# examples/dreambooth/train_dreambooth_lora_flux2.py and train_dreambooth_lora_flux2_klein.py (the same commit, read
# the same way): the Qwen-Image script's arguments and defaults, less its leftovers, with their own.
_QWEN_IMAGE = "train_dreambooth_lora_qwen_image.py"
_FLUX2_OWN = {"do_fp8_training": False, "text_encoder_out_layers": [10, 20, 30], "output_dir": "flux-dreambooth-lora",
              "guidance_scale": 3.5, "text_encoder_lr": 5e-06, "adam_weight_decay_text_encoder": 0.001,
              "prior_generation_precision": None, "enable_npu_flash_attention": False, "fsdp_text_encoder": False}
_FLUX2_SCRIPTS = {
    "train_dreambooth_lora_flux2.py": ({**_FLUX2_OWN, "remote_text_encoder": False},
                                       ("caption_dropout", "pretrained_text_encoder_4_name_or_path",
                                        "pretrained_tokenizer_4_name_or_path")),
    "train_dreambooth_lora_flux2_klein.py": (_FLUX2_OWN, ("pretrained_text_encoder_4_name_or_path",
                                                          "pretrained_tokenizer_4_name_or_path")),
}
KINDS |= {"do_fp8_training": "flag", "text_encoder_out_layers": "list", "remote_text_encoder": "flag",
          "fsdp_text_encoder": "flag"}
SCRIPT_ARGS |= {script: frozenset(defaults(script)) for script in _FLUX2_SCRIPTS}

# examples/dreambooth/train_dreambooth_lora_hidream.py, read the same way at the same commit: the Qwen-Image LoRA
# script's arguments and defaults (that script was written from it) without aspect_ratio_buckets, caption_dropout,
# lora_alpha (HiDream's LoRA alpha is its rank) and use_aspect_ratio_buckets, and with max_sequence_length 128.
HIDREAM_SCRIPT = "train_dreambooth_lora_hidream.py"
SCRIPT_ARGS[HIDREAM_SCRIPT] = SCRIPT_ARGS["train_dreambooth_lora_qwen_image.py"] - {
    "aspect_ratio_buckets", "caption_dropout", "lora_alpha", "use_aspect_ratio_buckets"}
for _by_script in BY_SCRIPT.values():
    if "train_dreambooth_lora_qwen_image.py" in _by_script:
        _by_script[HIDREAM_SCRIPT] = _by_script["train_dreambooth_lora_qwen_image.py"]
BY_SCRIPT["max_sequence_length"][HIDREAM_SCRIPT] = 128

# examples/dreambooth/train_dreambooth_lora_krea2.py (diffusers commit 58eb52c080, August 2026), read the same way: its
# arguments, its defaults where SHARED does not give them (rank and lora_alpha 32, the Krea 2 authors' LoRA), and the
# kinds of the three arguments no other script has (validation on another checkpoint, Krea 2 Turbo)
KREA2_SCRIPT = "train_dreambooth_lora_krea2.py"
SCRIPT_ARGS[KREA2_SCRIPT] = frozenset("""adam_beta1 adam_beta2 adam_epsilon adam_weight_decay allow_tf32
    aspect_ratio_buckets bnb_quantization_config_path cache_dir cache_latents caption_column caption_dropout center_crop
    checkpointing_steps checkpoints_total_limit class_data_dir class_prompt dataloader_num_workers dataset_config_name
    dataset_name do_fp8_training final_validation_prompt gradient_accumulation_steps gradient_checkpointing hub_model_id
    hub_token image_column instance_data_dir instance_prompt learning_rate local_rank logging_dir logit_mean logit_std
    lora_alpha lora_dropout lora_layers lr_num_cycles lr_power lr_scheduler lr_warmup_steps max_grad_norm
    max_sequence_length max_train_steps mixed_precision mode_scale num_class_images num_train_epochs
    num_validation_images offload optimizer output_dir pretrained_model_name_or_path prior_loss_weight prodigy_beta3
    prodigy_decouple prodigy_safeguard_warmup prodigy_use_bias_correction push_to_hub random_flip rank repeats report_to
    resolution resume_from_checkpoint revision sample_batch_size scale_lr seed skip_final_inference train_batch_size
    upcast_before_saving use_8bit_adam use_aspect_ratio_buckets validation_epochs validation_guidance_scale
    validation_model_path validation_num_inference_steps validation_prompt variant weighting_scheme
    with_prior_preservation""".split())
SHARED.update(validation_model_path=None, validation_num_inference_steps=8, validation_guidance_scale=0.0)
KINDS.update(validation_model_path="str", validation_num_inference_steps="int", validation_guidance_scale="float")
for _key, _default in {"adam_weight_decay": 0.0001, "caption_column": None, "learning_rate": 0.0003,
                       "max_sequence_length": 512, "max_train_steps": None, "mixed_precision": None,
                       "num_train_epochs": 1, "output_dir": "krea2-dreambooth-lora", "repeats": 1, "resolution": 512,
                       "train_batch_size": 4, "validation_epochs": 50, "weighting_scheme": "none"}.items():
    BY_SCRIPT[_key][KREA2_SCRIPT] = _default
SCRIPT_OWN[KREA2_SCRIPT] = {"rank": 32, "lora_alpha": 32}

# examples/dreambooth/train_dreambooth_lora_ideogram4.py (diffusers commit of August 2026), read the same way: the
# Z-Image script's arguments less use_aspect_ratio_buckets (its aspect_ratio_buckets list alone turns buckets on), with
# its own three (prompt upsampling, the training autocast switch) and its defaults where they differ: 2048 caption
# tokens, the logit-normal draw of std 1.5 (the pipeline's schedule), Flux's output_dir left in its parser.
IDEOGRAM4_SCRIPT = "train_dreambooth_lora_ideogram4.py"
SCRIPT_ARGS[IDEOGRAM4_SCRIPT] = (SCRIPT_ARGS[Z_IMAGE_SCRIPT] - {"use_aspect_ratio_buckets"}) | {
    "disable_training_autocast", "prompt_enhancer_head_id", "upsample_prompt"}
SHARED.update(disable_training_autocast=False, prompt_enhancer_head_id="diffusers/qwen3-vl-8b-instruct-lm-head",
              upsample_prompt=False)
KINDS.update(disable_training_autocast="flag", prompt_enhancer_head_id="str", upsample_prompt="flag")
for _by_script in BY_SCRIPT.values():
    if Z_IMAGE_SCRIPT in _by_script:
        _by_script[IDEOGRAM4_SCRIPT] = _by_script[Z_IMAGE_SCRIPT]
for _key, _default in {"max_sequence_length": 2048, "output_dir": "flux-dreambooth-lora",
                       "weighting_scheme": "logit_normal", "logit_std": 1.5}.items():
    if _key not in BY_SCRIPT:  # a default every other script shares: theirs stays SHARED's
        BY_SCRIPT[_key] = {script: SHARED[_key] for script, names in SCRIPT_ARGS.items() if _key in names}
    BY_SCRIPT[_key][IDEOGRAM4_SCRIPT] = _default
