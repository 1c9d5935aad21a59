"""kohya sd-scripts' training arguments and their defaults: every argparse dest of train_network.py,
sdxl_train_network.py, sdxl_train.py, train_db.py, flux_train_network.py and sd3_train_network.py (sd-scripts of
February 2026, `setup_parser().parse_args([])` of each; a key has the same default in every script that has it, except
save_model_as: "safetensors" in the network scripts, and t5xxl_max_token_length: 256 in sd3_train_network.py and
sd3_train.py; flux_train.py and sd3_train.py add FULL_TRANSFORMER below, the Lumina scripts LUMINA and their own
defaults of three flow arguments). What kohya trains with for a key a config
leaves out; a key at its default is not set by the user (kohya's --output_config writes only the others)."""

from __future__ import annotations

ARGS = {'adaptive_noise_scale': None, 'ae': None, 'alpha_mask': False, 'apply_lg_attn_mask': False,
        'apply_t5_attn_mask': False, 'async_upload': False, 'base_weights': None, 'base_weights_multiplier': None,
        'block_lr': None, 'blocks_to_swap': None, 'bucket_no_upscale': False, 'bucket_reso_steps': 64,
        'cache_info': False, 'cache_latents': False, 'cache_latents_to_disk': False,
        'cache_text_encoder_outputs': False, 'cache_text_encoder_outputs_to_disk': False,
        'caption_dropout_every_n_epochs': 0, 'caption_dropout_rate': 0.0, 'caption_extension': '.caption',
        'caption_extention': None, 'caption_prefix': None, 'caption_separator': ',', 'caption_suffix': None,
        'caption_tag_dropout_rate': 0.0, 'clip_g': None, 'clip_g_dropout_rate': 0.0, 'clip_l': None,
        'clip_l_dropout_rate': 0.0, 'clip_skip': None, 'color_aug': False, 'conditioning_data_dir': None,
        'config_file': None, 'console_log_file': None, 'console_log_level': None, 'console_log_simple': False,
        'controlnet_model_name_or_path': None, 'cpu_offload_checkpointing': False, 'dataset_class': None,
        'dataset_config': None, 'dataset_repeats': 1, 'ddp_gradient_as_bucket_view': False, 'ddp_static_graph': False,
        'ddp_timeout': None, 'debiased_estimation_loss': False, 'debug_dataset': False, 'deepspeed': False,
        'diffusers_xformers': False, 'dim_from_weights': False, 'disable_mmap_load_safetensors': False,
        'discrete_flow_shift': 3.0, 'dynamo_backend': 'inductor', 'enable_bucket': False,
        'enable_scaled_pos_embed': False, 'enable_wildcard': False, 'face_crop_aug_range': None, 'flip_aug': False,
        'fp16_master_weights_and_gradients': False, 'fp8_base': False, 'fp8_base_unet': False, 'full_bf16': False,
        'full_fp16': False, 'fused_backward_pass': False, 'fused_optimizer_groups': None,
        'gradient_accumulation_steps': 1, 'gradient_checkpointing': False, 'guidance_scale': 3.5, 'highvram': False,
        'huber_c': 0.1, 'huber_scale': 1.0, 'huber_schedule': 'snr', 'huggingface_path_in_repo': None,
        'huggingface_repo_id': None, 'huggingface_repo_type': None, 'huggingface_repo_visibility': None,
        'huggingface_token': None, 'in_json': None, 'initial_epoch': None, 'initial_step': None,
        'ip_noise_gamma': None, 'ip_noise_gamma_random_strength': False, 'keep_tokens': 0,
        'keep_tokens_separator': '', 'learning_rate': 2e-06, 'learning_rate_te': None, 'learning_rate_te1': None,
        'learning_rate_te2': None, 'log_config': False, 'log_prefix': None, 'log_tracker_config': None,
        'log_tracker_name': None, 'log_with': None, 'logging_dir': None, 'logit_mean': 0.0, 'logit_std': 1.0,
        'loss_type': 'l2', 'lowram': False, 'lr_decay_steps': 0, 'lr_scheduler': 'constant',
        'lr_scheduler_args': None, 'lr_scheduler_min_lr_ratio': None, 'lr_scheduler_num_cycles': 1,
        'lr_scheduler_power': 1, 'lr_scheduler_timescale': None, 'lr_scheduler_type': '', 'lr_warmup_steps': 0,
        'masked_loss': False, 'max_bucket_reso': 1024, 'max_data_loader_n_workers': 8, 'max_grad_norm': 1.0,
        'max_timestep': None, 'max_token_length': None, 'max_train_epochs': None, 'max_train_steps': 1600,
        'max_validation_steps': None, 'mem_eff_attn': False, 'metadata_author': None, 'metadata_description': None,
        'metadata_is_negative_embedding': None, 'metadata_license': None, 'metadata_merged_from': None,
        'metadata_preprocessor': None, 'metadata_tags': None, 'metadata_thumbnail': None, 'metadata_title': None,
        'metadata_trigger_phrase': None, 'metadata_usage_hint': None, 'min_bucket_reso': 256, 'min_snr_gamma': None,
        'min_timestep': None, 'mixed_precision': 'no', 'mode_scale': 1.29, 'model_prediction_type': 'sigma_scaled',
        'model_type': 'flux', 'multires_noise_discount': 0.3, 'multires_noise_iterations': None, 'network_alpha': 1,
        'network_args': None, 'network_dim': None, 'network_dropout': None, 'network_module': None,
        'network_train_text_encoder_only': False, 'network_train_unet_only': False, 'network_weights': None,
        'no_half_vae': False, 'no_metadata': False, 'no_token_padding': False, 'noise_offset': None,
        'noise_offset_random_strength': False, 'offload_optimizer_device': None, 'offload_optimizer_nvme_path': None,
        'offload_param_device': None, 'offload_param_nvme_path': None, 'optimizer_args': None, 'optimizer_type': '',
        'output_config': False, 'output_dir': None, 'output_name': None, 'persistent_data_loader_workers': False,
        'pos_emb_random_crop_rate': 0.0, 'pretrained_model_name_or_path': None, 'prior_loss_weight': 1.0,
        'random_crop': False, 'reg_data_dir': None, 'resize_interpolation': None, 'resolution': None, 'resume': None,
        'resume_from_huggingface': False, 'sample_at_first': False, 'sample_every_n_epochs': None,
        'sample_every_n_steps': None, 'sample_prompts': None, 'sample_sampler': 'ddim', 'save_clip': False,
        'save_every_n_epochs': None, 'save_every_n_steps': None, 'save_last_n_epochs': None,
        'save_last_n_epochs_state': None, 'save_last_n_steps': None, 'save_last_n_steps_state': None,
        'save_model_as': None, 'save_n_epoch_ratio': None, 'save_precision': None, 'save_state': False,
        'save_state_on_train_end': False, 'save_state_to_huggingface': False, 'save_t5xxl': False,
        'scale_v_pred_loss_like_noise_pred': False, 'scale_weight_norms': None, 'sdpa': False,
        'secondary_separator': None, 'seed': None, 'shuffle_caption': False, 'sigmoid_scale': 1.0,
        'skip_cache_check': False, 'skip_until_initial_step': False, 'split_mode': False,
        'stop_text_encoder_training': None, 't5_dropout_rate': 0.0, 't5xxl': None, 't5xxl_device': None,
        't5xxl_dtype': None, 't5xxl_max_token_length': None, 'text_encoder_batch_size': None, 'text_encoder_lr': None,
        'timestep_sampling': 'sigma', 'token_warmup_min': 1, 'token_warmup_step': 0, 'tokenizer_cache_dir': None,
        'torch_compile': False, 'train_batch_size': 1, 'train_data_dir': None, 'train_text_encoder': False,
        'training_comment': None, 'training_shift': 1.0, 'unet_lr': None, 'use_8bit_adam': False,
        'use_lion_optimizer': False, 'use_safetensors': False, 'v2': False, 'v_parameterization': False,
        'v_pred_like_loss': None, 'vae': None, 'vae_batch_size': 1, 'validate_every_n_epochs': None,
        'validate_every_n_steps': None, 'validation_seed': None, 'validation_split': 0.0, 'wandb_api_key': None,
        'wandb_run_name': None, 'weighted_captions': False, 'weighting_scheme': 'uniform', 'xformers': False,
        'zero3_init_flag': False, 'zero3_save_16bit_model': False, 'zero_stage': 2, 'zero_terminal_snr': False}

# The textual-inversion scripts' own arguments (train_textual_inversion.py's argparse; sdxl_train_textual_inversion.py
# adds none): the other arguments they take are the ones above.
TEXTUAL_INVERSION = {'token_string': None, 'init_word': None, 'num_vectors_per_token': 1, 'weights': None,
                     'use_object_template': False, 'use_style_template': False}
ARGS |= TEXTUAL_INVERSION

# The arguments flux_train.py and sd3_train.py add to the ones above (their setup_parser()s, February 2026)
FULL_TRANSFORMER = {'mem_eff_save': False, 'blockwise_fused_optimizers': False, 'skip_latents_validity_check': False,
                    'double_blocks_to_swap': None, 'single_blocks_to_swap': None, 'train_t5xxl': False,
                    'use_t5xxl_cache_only': False, 'learning_rate_te3': None, 'num_last_block_to_freeze': None}
ARGS |= FULL_TRANSFORMER

# lumina_train_network.py / lumina_train.py (library/lumina_train_util.py's add_lumina_train_arguments): its own
# arguments, and the flow arguments it shares with the Flux scripts at other defaults (SCRIPT_DEFAULTS)
LUMINA = {'gemma2': None, 'gemma2_max_token_length': None, 'use_flash_attn': False, 'use_sage_attn': False,
          'system_prompt': '', 'sample_batch_size': None}
ARGS |= LUMINA
LUMINA_DEFAULTS = {'timestep_sampling': 'shift', 'model_prediction_type': 'raw', 'discrete_flow_shift': 6.0}
SCRIPT_DEFAULTS = {'lumina_train_network.py': LUMINA_DEFAULTS, 'lumina_train.py': LUMINA_DEFAULTS}


def script_defaults(script: str) -> dict:
    """The defaults `script` trains with: ARGS, with the few a script sets otherwise."""
    return ARGS | SCRIPT_DEFAULTS.get(script, {})

# store_true flags (a flag on a saved command line takes no value) and the arguments that take several values
FLAGS = frozenset(key for key, value in ARGS.items() if value is False)
SEVERAL_VALUES = frozenset({"optimizer_args", "lr_scheduler_args", "network_args", "base_weights",
                            "base_weights_multiplier", "text_encoder_lr"})
