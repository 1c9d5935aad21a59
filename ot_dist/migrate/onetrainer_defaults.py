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
    "sample_after_unit": "MINUTE", "save_every": 0, "save_every_unit": "NEVER", "gradient_checkpointing": "ON",
    "weight_dtype": "FLOAT_32", "rescale_noise_scheduler_to_zero_terminal_snr": False,
    "force_v_prediction": False, "force_epsilon_prediction": False,
}
PART = {"train": True, "learning_rate": None, "stop_training_after": None, "stop_training_after_unit": "NEVER",
        "weight_dtype": "FLOAT_32", "model_name": ""}
OPTIMIZER = {"optimizer": "ADAMW"}
EMBEDDING = {"placeholder": "<embedding>", "token_count": 1, "initial_embedding_text": "*", "train": True}
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
SAMPLE = {"enabled": True, "prompt": "", "negative_prompt": "", "height": 512, "width": 512, "seed": 42,
          "random_seed": False, "diffusion_steps": 20, "cfg_scale": 7.0}
