"""OneTrainer's defaults for the fields the import reads, so a preset (which stores only what differs) imports like
the full config OneTrainer would save. Source: OneTrainer modules/util/config/TrainConfig.py, ConceptConfig.py and
SampleConfig.py `default_values()` (github.com/Nerogar/OneTrainer @ 23df3832, config version 11)."""

TRAIN = {
    "training_method": "FINE_TUNE", "model_type": "STABLE_DIFFUSION_15",
    "base_model_name": "stable-diffusion-v1-5/stable-diffusion-v1-5", "output_dtype": "FLOAT_32",
    "output_model_format": "SAFETENSORS", "output_model_destination": "models/model.safetensors",
    "concept_file_name": "training_concepts/concepts.json", "concepts": None, "latent_caching": True,
    "learning_rate_scheduler": "CONSTANT", "custom_learning_rate_scheduler": None, "scheduler_params": [],
    "learning_rate": 3e-6, "learning_rate_warmup_steps": 200.0, "learning_rate_cycles": 1.0,
    "learning_rate_min_factor": 0.0, "epochs": 100, "batch_size": 1, "gradient_accumulation_steps": 1,
    "ema": "OFF", "ema_decay": 0.999, "ema_update_step_interval": 5, "train_dtype": "FLOAT_16", "resolution": "512",
    "mse_strength": 1.0, "mae_strength": 0.0, "log_cosh_strength": 0.0, "huber_strength": 0.0,
    "vb_loss_strength": 1.0, "loss_weight_fn": "CONSTANT", "loss_weight_strength": 5.0, "loss_scaler": "NONE",
    "learning_rate_scaler": "NONE", "clip_grad_norm": 1.0, "offset_noise_weight": 0.0,
    "generalized_offset_noise": False, "perturbation_noise_weight": 0.0, "min_noising_strength": 0.0,
    "max_noising_strength": 1.0, "timestep_distribution": "UNIFORM", "masked_training": False,
    "unmasked_probability": 0.1, "unmasked_weight": 0.1, "normalize_masked_area_loss": False,
    "text_encoder_layer_skip": 0, "text_encoder_2_layer_skip": 0, "lora_rank": 16, "lora_alpha": 1.0, "dropout_probability": 0.0,
    "layer_filter_preset": "full", "layer_filter": "", "embedding_learning_rate": None,
    "sample_definition_file_name": "training_samples/samples.json", "samples": None, "sample_after": 10,
    "sample_after_unit": "MINUTE", "sample_skip_first": 0, "non_ema_sampling": True, "save_every": 0, "save_every_unit": "NEVER", "save_skip_first": 0,
    "save_filename_prefix": "", "backup_after": 30, "backup_after_unit": "MINUTE", "rolling_backup": False,
    "rolling_backup_count": 3,
    "rescale_noise_scheduler_to_zero_terminal_snr": False, "force_v_prediction": False,
    "force_epsilon_prediction": False, "noising_weight": 0.0, "noising_bias": 0.0, "timestep_shift": 1.0,
    "dynamic_timestep_shifting": False, "lora_model_name": "", "embedding_weight_dtype": "FLOAT_32",
    "preserve_embedding_norm": False,
}
# TrainModelPartConfig's defaults (config version 11 keeps weight_dtype and gradient checkpointing per part) ...
PART = {"train": True, "learning_rate": None, "stop_training_after": None, "stop_training_after_unit": "NEVER",
        "weight_dtype": "FLOAT_32", "model_name": "", "include": True, "dropout_probability": 0.0,
        "train_embedding": True, "attention_mask": False, "guidance_scale": 1.0, "gradient_checkpointing": True,
        "offload_fraction": 0.0, "activation_offloading": False}
# ... and what TrainConfig sets on top for each part: the text encoders stop training after 30 epochs, so a preset
# that leaves them out (or names only their dtype) trains them for 30 epochs in OneTrainer.
PART_OVERRIDES = {"unet": {"stop_training_after": 0}, "prior": {"stop_training_after": 0},
                  "transformer": {"stop_training_after": 0},
                  **{f"text_encoder{n}": {"stop_training_after": 30, "stop_training_after_unit": "EPOCH"}
                     for n in ("", "_2", "_3", "_4")}}
# Anima's LLM adapter has no section in OneTrainer's config: it is always frozen there (AnimaLoRASetup,
# AnimaFineTuneSetup: text_conditioner.requires_grad_(False)) and loaded in bfloat16 (AnimaModelLoader: "no user
# dtype control")
PART_OVERRIDES["text_conditioner"] = {"train": False, "weight_dtype": "BFLOAT_16"}
# TrainOptimizerConfig's defaults (of the options some ot_dist optimizer has): what OneTrainer runs for a preset
# without an optimizer section (the per-optimizer table of optimizer_util applies only when one is chosen in the UI).
OPTIMIZER = {"optimizer": "ADAMW", "amsgrad": False, "capturable": False, "centered": False, "decouple": False,
             "differentiable": False, "foreach": False, "fsdp_in_use": False, "fused": False, "fused_back_pass": False,
             "is_paged": False, "maximize": False, "nesterov": False, "no_prox": False, "relative_step": False,
             "safeguard_warmup": False, "scale_parameter": False, "stochastic_rounding": True,
             "use_bias_correction": False, "warmup_init": False, "decoupled_decay": False, "fixed_decay": False,
             "rectify": False, "degenerated_to_sgd": False, "cautious": False, "weight_decay_by_lr": True,
             "use_speed": False, "split_groups": True, "split_groups_mean": True, "factored": True,
             "factored_fp32": True, "use_stableadamw": True, "use_cautious": False, "use_grams": False,
             "use_adopt": False, "d_limiter": True, "use_schedulefree": True, "use_orthograd": False,
             "ams_bound": False, "cautious_wd": False, "nnmf_factor": False, "orthogonal_gradient": False,
             "use_atan2": False, "kourkoutas_beta": False, "compile": False, "auto_kappa_p": False,
             "accelerated_ns": False, "low_rank_ortho": False, "rms_rescaling": True, "normuon_variant": False,
             "approx_mars": False}
EMBEDDING = {"placeholder": "<embedding>", "token_count": 1, "initial_embedding_text": "*", "train": True,
             "model_name": "", "stop_training_after": None, "stop_training_after_unit": "NEVER",
             "is_output_embedding": False}
# TrainOptimizerConfig's own defaults of the options whose default is not None / False / {}: a UI-saved config carries
# every option of every optimizer at these "unset" values, which no optimizer then reads.
OPTIMIZER_UNSET_TRUE = ("stochastic_rounding", "weight_decay_by_lr", "split_groups", "split_groups_mean", "factored",
                        "factored_fp32", "use_stableadamw", "d_limiter", "use_schedulefree", "rms_rescaling")
# Options of the *_ADV optimizers OneTrainer passes to adv_optm 2.2 (its pin) that adv_optm 2.5 (ot_dist's) no longer has,
# at the value with which they change nothing (AdEMAMix off; LION_ADV's clip_threshold unset, OneTrainer's 0.0).
ADV_REMOVED = {"use_AdEMAMix": False, "beta3_ema": 0.9999, "alpha": 5, "Simplified_AdEMAMix": False, "alpha_grad": 100.0,
               "clip_threshold": 0.0}
# Options OneTrainer's optimizer_util.OPTIMIZER_DEFAULT_PARAMETERS gives an optimizer ot_dist also has, that ot_dist's
# implementation lacks, with OneTrainer's default: at that default they change nothing ot_dist would do differently.
OPTIMIZER_OPTIONS_NOT_IN_OT_DIST = {
    "ADAGRAD": {"optim_bits": 32, "min_8bit_size": 4096, "percentile_clipping": 100, "block_wise": True},
    "ADAGRAD_8BIT": {"lr_decay": 0, "initial_accumulator_value": 0, "optim_bits": 8, "percentile_clipping": 100,
                     "block_wise": True, "fused_back_pass": False},
    "ADAM_8BIT": {"amsgrad": False, "optim_bits": 32, "percentile_clipping": 100, "block_wise": True},
    "ADAMW_8BIT": {"amsgrad": False, "optim_bits": 32, "percentile_clipping": 100, "block_wise": True},
    "AdEMAMix": {"optim_bits": 32, "min_8bit_size": 4096},
    "LAMB": {"bias_correction": True, "amsgrad": False, "adam_w_mode": True, "optim_bits": 32, "min_8bit_size": 4096,
             "percentile_clipping": 100, "block_wise": False},
    "LAMB_8BIT": {"bias_correction": True, "amsgrad": False, "adam_w_mode": True, "percentile_clipping": 100,
                  "block_wise": False, "max_unorm": 1.0},
    "LARS": {"dampening": 0, "nesterov": False, "optim_bits": 32, "min_8bit_size": 4096, "percentile_clipping": 100},
    "LARS_8BIT": {"dampening": 0, "nesterov": False, "percentile_clipping": 100},
    "LION": {"use_triton": False},
    "LION_8BIT": {"percentile_clipping": 100, "block_wise": True},
    "RMSPROP": {"optim_bits": 32, "min_8bit_size": 4096, "percentile_clipping": 100, "block_wise": True},
    "RMSPROP_8BIT": {"momentum": 0, "centered": False, "percentile_clipping": 100, "block_wise": True},
    "SGD_8BIT": {"dampening": 0, "nesterov": False, "percentile_clipping": 100, "block_wise": True},
    "PRODIGY_PLUS_SCHEDULE_FREE": {"fused_back_pass": False},
    "CAME": {"use_cautious": False, "fused_back_pass": False},
    "CAME_8BIT": {"fused_back_pass": False},
    "YOGI": {"r": 0.95, "adanorm": False, "adam_debias": False},
    "MUON": {"MuonWithAuxAdam": True, "muon_hidden_layers": None, "muon_adam_regex": False, "muon_te1_adam_lr": None,
             "muon_te2_adam_lr": None, "muon_adam_config": {}},
    "AIDA": {"r": 0.95, "adanorm": False, "adam_debias": False},
    **{name: dict(ADV_REMOVED) for name in ("ADAMW_ADV", "ADOPT_ADV", "SIGNSGD_ADV")},
    "PRODIGY_ADV": {**ADV_REMOVED, "fused_back_pass": False},
    "LION_ADV": {**ADV_REMOVED, "compile": False},  # adv_optm 2.5's Lion_adv drops it
    **{name: {**ADV_REMOVED, "MuonWithAuxAdam": True, "muon_hidden_layers": None,
              "muon_adam_regex": False, "muon_te1_adam_lr": None, "muon_te2_adam_lr": None, "muon_adam_config": {}}
       for name in ("MUON_ADV", "ADAMUON_ADV")},
}
CONCEPT = {"name": "", "path": "", "enabled": True, "type": "STANDARD", "include_subdirectories": False,
           "balancing": 1.0, "balancing_strategy": "REPEATS", "loss_weight": 1.0, "image_variations": 1,
           "text_variations": 1}
CONCEPT_TEXT = {"prompt_source": "sample", "prompt_path": "", "enable_tag_shuffling": False,
                "tag_dropout_enable": False, "caps_randomize_enable": False}
# Image options that change what a sample looks like; their "off" values.
CONCEPT_IMAGE_OFF = {"enable_random_flip": False, "enable_fixed_flip": False, "enable_random_rotate": False,
                     "enable_fixed_rotate": False, "enable_random_brightness": False, "enable_fixed_brightness": False,
                     "enable_random_contrast": False, "enable_fixed_contrast": False,
                     "enable_random_saturation": False, "enable_fixed_saturation": False, "enable_random_hue": False,
                     "enable_fixed_hue": False, "enable_resolution_override": False,
                     "enable_random_circular_mask_shrink": False, "enable_random_mask_rotate_crop": False}
# SampleConfig's defaults: `_get_model_defaults(model_type)` of SampleConfig.py, by ot_dist family.
SAMPLE = {"enabled": True, "prompt": "", "negative_prompt": "", "height": 512, "width": 512, "seed": 42,
          "random_seed": False, "diffusion_steps": 30, "cfg_scale": 7.0, "noise_scheduler": "DDIM",
          "sample_inpainting": False}
_SIDE_1024 = {"width": 1024, "height": 1024}
SAMPLE_BY_FAMILY = {
    "sd1": {"cfg_scale": 7.5, "noise_scheduler": "EULER_A"},
    "sd2": {"width": 768, "height": 768, "cfg_scale": 7.5},
    "sdxl": {**_SIDE_1024, "cfg_scale": 7.5, "noise_scheduler": "EULER_A"},
    "sd3": {**_SIDE_1024, "diffusion_steps": 28},
    "flux": {**_SIDE_1024, "cfg_scale": 3.5},
    "chroma": {**_SIDE_1024, "cfg_scale": 3.5, "negative_prompt": (
        "This low-quality, greyscale, unfinished sketch is inaccurate and flawed. The image is very blurred and lacks "
        "detail, with excessive chromatic aberrations and artifacts. The image is overly saturated with excessive "
        "bloom.")},
    **{name: {**_SIDE_1024, "diffusion_steps": 25, "cfg_scale": 4.5} for name in ("pixart_alpha", "pixart_sigma")},
    **{name: {**_SIDE_1024, "diffusion_steps": 25, "cfg_scale": 4.0} for name in ("stable_cascade", "wuerstchen_v2")},
    "qwen_image": {**_SIDE_1024, "diffusion_steps": 25, "cfg_scale": 3.5},
    "sana": {**_SIDE_1024, "diffusion_steps": 20, "cfg_scale": 4.5},
    "z_image": {**_SIDE_1024, "diffusion_steps": 28, "cfg_scale": 4.0},
    **{name: {**_SIDE_1024, "cfg_scale": 4.0} for name in ("flux2", "flux2_klein")},
    "hidream": {**_SIDE_1024, "diffusion_steps": 28, "cfg_scale": 5.0},
}
SAMPLE_BY_FAMILY["krea2"] = {**_SIDE_1024, "diffusion_steps": 28, "cfg_scale": 3.5}
SAMPLE_BY_FAMILY["ernie_image"] = {**_SIDE_1024, "diffusion_steps": 25, "cfg_scale": 4.0}  # as Wuerstchen's
SAMPLE_BY_FAMILY["anima"] = {**_SIDE_1024, "diffusion_steps": 25, "cfg_scale": 4.0,
                             "negative_prompt": "worst quality, low quality, score_1, score_2, score_3, artist name"}
SAMPLE_BY_FAMILY["ideogram4"] = {**_SIDE_1024, "diffusion_steps": 25, "cfg_scale": 3.0}
SAMPLE_BY_FAMILY["hunyuan_video"] = {"width": 848, "height": 480, "diffusion_steps": 30, "cfg_scale": 6.0}
