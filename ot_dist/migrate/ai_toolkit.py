"""`ot-dist import ai-toolkit`: an ostris ai-toolkit job file (config/examples/train_lora_*.yaml and what its UI
saves: `config.process[0]` with `model`, `network`, `train`, `datasets`, `sample`, `save`) as an ot_dist config that
validates.

Every key the process sets either maps to an ot_dist key with the same meaning, is noted as one that changes how
ai-toolkit runs but not what it trains (device, logging, uploads, quantisation of the text encoder's storage, ...),
or is listed with the reason it is not honoured, in the written file and on stderr. A key the file leaves out takes
ai-toolkit's default (toolkit/config_modules.py), so where ai-toolkit's default differs from ot_dist's its value is
written: learning rate 1e-6, 1000 steps, float32 training, gradient checkpointing on, LoRA rank 4 with alpha 1.0,
AdamW with eps 1e-6, a save every 1000 steps with 5 kept, EMA without warm-up.

This module maps the model, the method, the run's length, precision, the LoRA network, the optimizer and its
schedule, the loss and timesteps, EMA and saves; ai_toolkit_data maps the datasets and the sample prompts;
ai_toolkit_args reads the file."""

from __future__ import annotations

import math

from ot_dist.errors import ConfigError
from ot_dist.migrate.ai_toolkit_args import NO_EFFECT, P, Section, list_unread, read_process
from ot_dist.migrate.ai_toolkit_data import import_datasets, import_samples
from ot_dist.migrate.common import Imported, local_path, note_local_model, warmup_micro_steps
from ot_dist.models.families.registry import get_family

# ai-toolkit's model.arch (ModelArch and the extensions' `arch`) -> ot_dist's family
ARCHES = {
    "sd1": "sd1", "sd2": "sd2", "sdxl": "sdxl", "sd3": "sd3", "flux": "flux", "flex1": "flux", "chroma": "chroma",
    "pixart": "pixart_alpha", "pixart_sigma": "pixart_sigma", "lumina2": "lumina2", "qwen_image": "qwen_image",
    "qwen_image_edit": "qwen_image_edit", "qwen_image_edit_plus": "qwen_image_edit_plus",
    "flux_kontext": "flux_kontext", "flux2": "flux2", "flux2_klein_4b": "flux2_klein", "flux2_klein_9b": "flux2_klein",
    "hidream": "hidream", "zimage": "z_image", "wan21": "wan", "ernie_image": "ernie_image", "anima": "anima",
    "ideogram4": "ideogram4", "krea2": "krea2",
}
# The older is_* flags, in the order ModelConfig tests them when arch is unset (none: sd1)
FLAGS = (("is_v2", "sd2"), ("is_v3", "sd3"), ("is_xl", "sdxl"), ("is_pixart", "pixart"),
         ("is_pixart_sigma", "pixart_sigma"), ("is_auraflow", "auraflow"), ("is_flux", "flux"),
         ("is_lumina2", "lumina2"), ("is_vega", "vega"), ("is_ssd", "ssd"))
UNETS = ("sd1", "sd2", "sdxl")
# ai-toolkit's LoRA on a transformer (transformer_only, its default) adapts the Linear layers inside the transformer
# blocks (get_transformer_block_names, or `transformer_blocks`): the same blocks under diffusers' names
BLOCK_FILTERS = {
    "flux": ["transformer_blocks"], "flux_kontext": ["transformer_blocks"], "chroma": ["transformer_blocks"],
    "sd3": ["transformer_blocks"], "pixart_alpha": ["transformer_blocks"], "pixart_sigma": ["transformer_blocks"],
    "qwen_image": ["transformer_blocks"], "qwen_image_edit": ["transformer_blocks"],
    "qwen_image_edit_plus": ["transformer_blocks"], "flux2": ["transformer_blocks"],
    "flux2_klein": ["transformer_blocks"], "lumina2": ["layers.", "noise_refiner.", "context_refiner."],
    "hidream": ["double_stream_blocks", "single_stream_blocks"], "z_image": ["layers."], "wan": ["blocks."],
}
PRECISION = {"fp32": "float32", "float32": "float32", "float": "float32", "fp16": "float16", "float16": "float16",
             "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
FLOAT8_QTYPES = ("qfloat8", "float8", "float8_e4m3fn")
# ai-toolkit's optimizer (toolkit/optimizer.py, lower-cased) -> (ot_dist's, the options ai-toolkit builds it with:
# eps 1e-6 where it passes one, the library's defaults otherwise, in ot_dist's names)
OPTIMIZERS = {
    "adamw": ("ADAMW", {"eps": 1e-6, "weight_decay": 0.01}),
    "adam": ("ADAM", {"eps": 1e-6, "weight_decay": 0.0}),
    "adamw8bit": ("ADAMW_8BIT", {"eps": 1e-6, "weight_decay": 0.01}),
    "adam8bit": ("ADAM_8BIT", {"eps": 1e-6, "weight_decay": 0.0}),
    "adamw8": ("ADAMW_8BIT", {"eps": 1e-6, "weight_decay": 0.0}),  # its own Adam8bit(decouple=True)
    "adam8": ("ADAM_8BIT", {"eps": 1e-6, "weight_decay": 0.0}),
    "ademamix8bit": ("AdEMAMix_8BIT", {"eps": 1e-6}),
    "lion": ("LION", {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}),  # lion_pytorch's defaults
    "lion8bit": ("LION_8BIT", {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}),  # bitsandbytes'
    "adagrad": ("ADAGRAD", {}),
    "adafactor": ("ADAFACTOR", {"relative_step": False, "scale_parameter": False, "warmup_init": False}),
    "prodigy": ("PRODIGY", {"eps": 1e-6, "slice_p": 1}),  # prodigyopt's slice_p
    "prodigy8bit": ("PRODIGY", {"eps": 1e-6, "slice_p": 1}),
    "dadaptation": ("DADAPT_ADAM", {"eps": 1e-6}),
}
OWN_IMPLEMENTATION = {"adamw8": "its own 8-bit Adam", "adam8": "its own 8-bit Adam",
                      "prodigy8bit": "Prodigy with 8-bit state", "adafactor": "its Adafactor with stochastic rounding"}


def import_ai_toolkit(path: str) -> Imported:
    process, name, file = read_process(path)
    out = Imported({}, origins={})
    c = out.config
    sections = {key: Section(process.get(key), f"{P}.{key}") for key in ("model", "train", "save", "sample")}
    model, train, save = sections["model"], sections["train"], sections["save"]
    family = _model(model, c, out)
    network = process.get("network")
    c["method"] = "lora" if network is not None else "full"
    c["output_dir"] = local_path(f"{process.get('training_folder') or 'output'}/{name}", "training_folder", out)
    _length(train, c, out)
    _precision(train, model, c, out)
    if network is not None:
        sections["network"] = Section(network, f"{P}.network")
        _network(sections["network"], c, family, out)
    _parts(train, c, out)
    _optimizer(train, c, out)
    _scheduler(train, c, out)
    _loss(train, c, family, out)
    _ema(train, c, out)
    datasets = process.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(f"{P}.datasets: not a list of datasets (ot_dist trains from folders: each dataset's "
                          "folder_path)")
    trigger = process.get("trigger_word")
    import_datasets([Section(item, f"{P}.datasets[{i}]") for i, item in enumerate(datasets)], trigger, train, c,
                    family, out)
    import_samples(sections["sample"], trigger, c, family, out)
    _saves(save, c, out)
    if process.get("training_seed") is not None:
        c["seed"] = int(process["training_seed"])
    else:
        out.notes.append("training_seed: not set (ai-toolkit seeds nothing then); seed 42 is written")
    _process_keys(process, out)
    for section in sections.values():
        list_unread(section, out)
    out.origins |= ORIGINS
    out.notes.insert(0, f"imported from ai-toolkit's {file.name} (config.process[0])")
    return out


ORIGINS = {
    "model": f"{P}.model.arch", "model.path": f"{P}.model.name_or_path", "output_dir": "training_folder / config.name",
    "max_steps": f"{P}.train.steps", "batch_size": f"{P}.train.batch_size",
    "gradient_accumulation_steps": f"{P}.train.gradient_accumulation", "learning_rate": f"{P}.train.lr",
    "train_dtype": f"{P}.train.dtype", "weight_dtype": f"{P}.model.quantize",
    "clip_grad_norm": f"{P}.train.max_grad_norm",
    "optimizer": f"{P}.train.optimizer / optimizer_params", "scheduler": f"{P}.train.lr_scheduler",
    "lora": f"{P}.network", "loss": f"{P}.train", "ema": f"{P}.train.ema_config", "data": f"{P}.datasets",
    "resolution": f"{P}.datasets[].resolution", "sampling": f"{P}.sample", "checkpoint": f"{P}.save",
    "output_dtype": f"{P}.save.dtype", "seed": f"{P}.training_seed",
}


def _arch(model: Section) -> str:
    arch = model.get("arch")
    for flag, _ in FLAGS:
        model.get(flag)
    if arch:
        return str(arch).split(":")[0]
    return next((name for flag, name in FLAGS if model.values.get(flag)), "sd1")


def _model(model: Section, c: dict, out: Imported) -> str:
    path = model.get("name_or_path")
    if not path:
        raise ConfigError(f"{P}.model.name_or_path: not set (ai-toolkit requires it: the base model)")
    arch = _arch(model)
    if arch not in ARCHES:
        raise ConfigError(f"{P}.model.arch: {arch} is not a model ot_dist trains (ot_dist imports "
                          f"{', '.join(sorted(ARCHES))})")
    family = ARCHES[arch]
    if not model.given("arch") and arch == "sd1" and any(word in str(path).lower() for word in ("xl", "flux", "sd3")):
        out.notes.append(f"{P}.model: no arch or is_* flag: ai-toolkit loads {path} as SD 1.x, and so does this "
                         "config (set model.arch if that is not the model)")
    path = local_path(str(path), "model.name_or_path", out)
    note_local_model(path, "model.name_or_path", out)
    c["model"] = {"family": family, "path": path}
    if model.get("is_v_pred"):
        if family in UNETS:
            c["model"]["prediction_type"] = "v_prediction"
        else:
            out.not_honoured.append(f"model.is_v_pred: {family} trains as its model does")
    for key, why in (("vae_path", "a replacement VAE (model.path's is used)"),
                     ("te_name_or_path", "text encoders from another model (model.path's are used)"),
                     ("extras_name_or_path", "the VAE / text encoders from another model (model.path's are used)"),
                     ("assistant_lora_path", "an assistant LoRA (a distilled model trained through a de-distilling "
                                             "LoRA) is not loaded"),
                     ("lora_path", "a LoRA fused into the base model before training is not supported"),
                     ("inference_lora_path", "a LoRA loaded for the samples only is not supported"),
                     ("refiner_name_or_path", "the SDXL refiner is not trained or sampled"),
                     ("unet_path", "a separate denoiser file (model.path's is used)"),
                     ("accuracy_recovery_adapter", "an accuracy-recovery LoRA for a quantised model is not loaded"),
                     ("model_paths", "component paths (model.path's components are used)"),
                     ("attn_masking", "Flux's attention mask over T5 padding is not supported"),
                     ("use_flux_cfg", "true CFG while training Flux is not supported")):
        if model.given(key) and model.get(key) not in (False, {}, model.values["name_or_path"]):
            out.not_honoured.append(f"model.{key}: {model.get(key)}: {why}")
    if model.get("compile"):
        c.setdefault("performance", {})["compile"] = True
    return family


def _length(train: Section, c: dict, out: Imported) -> None:
    """train.steps counts optimizer steps with `gradient_accumulation` (several batches per step) and batches with
    the older `gradient_accumulation_steps` (an optimizer step every N of them); ot_dist counts optimizer steps and
    stops at max_steps (epochs as many, as every epoch is at least one step)."""
    steps = train.number("steps", 1000, int)
    accumulation = train.number("gradient_accumulation", 1, int)
    legacy = train.number("gradient_accumulation_steps", 1, int)
    c["batch_size"] = train.number("batch_size", 1, int)
    if legacy == -1:
        out.not_honoured.append("train.gradient_accumulation_steps: -1 (a step per epoch) is not supported; no "
                                "accumulation is written")
        legacy = 1
    if accumulation > 1 and legacy > 1:
        raise ConfigError(f"{P}.train.gradient_accumulation: with gradient_accumulation_steps {legacy}: ai-toolkit "
                          "refuses both")
    if legacy > 1:
        optimizer_steps = math.ceil(steps / legacy)
        out.notes.append(f"train.gradient_accumulation_steps: {legacy}: ai-toolkit's steps {steps} count batches, "
                         f"{optimizer_steps} optimizer steps (max_steps)")
        steps, accumulation = optimizer_steps, legacy
    if steps < 1:
        raise ConfigError(f"{P}.train.steps: {steps} is not a positive number of steps")
    c["gradient_accumulation_steps"] = accumulation
    c["max_steps"] = steps
    c["epochs"] = steps


def _precision(train: Section, model: Section, c: dict, out: Imported) -> None:
    """train.dtype is the compute dtype and the dtype ai-toolkit loads the model in (it copies it to model.dtype);
    model.quantize with qtype qfloat8 stores the frozen transformer in 8 bits, quantize_te the text encoders;
    model.vae_dtype is the VAE's."""
    dtype = str(train.get("dtype", "fp32")).lower()
    if dtype not in PRECISION:
        raise ConfigError(f"{P}.train.dtype: {dtype} is not fp32, fp16 or bf16")
    c["train_dtype"] = PRECISION[dtype]
    if c["train_dtype"] != "float32":
        c["weight_dtype"] = c["train_dtype"]
    model.get("dtype")  # overwritten by train.dtype in ai-toolkit
    family = get_family(c["model"]["family"])
    quantize = bool(model.get("quantize"))
    # ai-toolkit's ModelConfig: quantize the transformer in qtype, the text encoders (quantize_te, by default
    # quantize) in qtype_te (qfloat8 by default)
    chosen = {(family.denoiser,): ("qtype", str(model.get("qtype", "qfloat8")).split("|")[0]) if quantize else None,
              family.text_encoders: ("qtype_te", str(model.get("qtype_te", "qfloat8")).split("|")[0])
              if model.get("quantize_te", quantize) else None}
    for parts, quantized in chosen.items():
        if quantized is None:
            continue
        key, qtype = quantized
        if qtype in FLOAT8_QTYPES:
            for part in parts:
                c.setdefault(part, {})["weight_dtype"] = "float8"
            out.notes.append(f"model.{key}: {qtype}: ot_dist's float8 stores {', '.join(parts)} in one byte per "
                             "weight with a per-tensor scale")
        else:
            out.not_honoured.append(f"model.{key}: {qtype}: integer / low-bit quantisation is not supported "
                                    f"({', '.join(parts)} stored in weight_dtype {c.get('weight_dtype', 'float32')})")
    vae = model.get("vae_dtype")
    if vae is not None:
        if str(vae).lower() not in PRECISION:
            raise ConfigError(f"{P}.model.vae_dtype: {vae} is not fp32, fp16 or bf16")
        c["vae_weight_dtype"] = PRECISION[str(vae).lower()]
    c["gradient_checkpointing"] = bool(train.get("gradient_checkpointing", True))
    grad_norm = train.number("max_grad_norm", 1.0)
    c["clip_grad_norm"] = grad_norm if grad_norm else None


def _network(network: Section, c: dict, family: str, out: Imported) -> None:
    """network.type lora / locon / lokr: rank from `linear` (or the older `rank`, default 4), alpha from
    `linear_alpha` (or `alpha`, default 1.0); the modules ai-toolkit adapts (every Linear of the UNet, with `conv` its
    convolutions; a transformer's blocks) as ot_dist's preset or layer filter."""
    kind = str(network.get("type", "lora")).lower()
    if kind not in ("lora", "locon", "lokr"):
        raise ConfigError(f"{P}.network.type: {kind} is not lora, locon or lokr (ot_dist has no LoRM)")
    rank, linear = network.number("rank", None, int), network.number("linear", 4, int)
    rank = rank or linear  # the older `rank` wins, as NetworkConfig reads it
    alpha, linear_alpha = network.number("alpha", 1.0), network.number("linear_alpha", None)
    alpha = alpha if linear_alpha is None else linear_alpha
    lora = {"rank": rank, "alpha": alpha}
    if kind == "lokr":
        lora["variant"] = "lokr"
        if network.get("lokr_full_rank", True):
            out.not_honoured.append(f"network.lokr_full_rank: true (ai-toolkit's default): its LoKr keeps the second "
                                    f"Kronecker factor full and unscaled; ot_dist's lokr of rank {rank} and alpha "
                                    f"{alpha} is written")
        if network.get("lokr_factor", -1) != -1:
            out.not_honoured.append(f"network.lokr_factor: {network.get('lokr_factor')}: ot_dist's lokr (peft's) "
                                    "splits the dimensions its own way")
    dropout = network.number("dropout", None)
    if dropout:
        if kind == "lokr":
            out.not_honoured.append(f"network.dropout: {dropout}: not with ot_dist's lokr")
        else:
            lora["dropout"] = dropout  # both drop the rank features (LoRAModule's down projection output)
    conv, conv_alpha = network.number("conv", None, int), network.number("conv_alpha", None)
    if family in UNETS:
        if conv and (conv, conv_alpha if conv_alpha is not None else conv) == (rank, alpha):
            lora["preset"] = "all_layers"  # every Linear and Conv2d of the UNet
        else:
            lora["preset"] = "all_linear"
            if conv:
                out.not_honoured.append(f"network.conv: {conv} (conv_alpha {conv_alpha}): ot_dist adapts the "
                                        "convolutions at the Linear layers' rank and alpha only; they are left out")
    else:
        if conv:
            out.notes.append(f"network.conv: {conv}: {family}'s transformer blocks have no convolutions to adapt")
        blocks = BLOCK_FILTERS.get(family)
        if not network.get("transformer_only", True):
            lora["preset"] = "all_linear"
        elif blocks:
            lora["layer_filter"] = blocks
        else:
            lora["preset"] = "all_linear"
            out.not_honoured.append(f"network: ai-toolkit adapts the Linear layers of {family}'s transformer blocks; "
                                    "ot_dist's all_linear preset (every Linear of the transformer) is written")
    kwargs = network.get("network_kwargs", {}) or {}
    if kwargs.get("only_if_contains"):
        lora.pop("preset", None)
        lora["layer_filter"] = list(kwargs["only_if_contains"])  # substrings of the module path, as ai-toolkit's
        out.notes.append("network_kwargs.only_if_contains: written as lora.layer_filter (substrings of diffusers' "
                         "module paths; ai-toolkit also matches its own underscored names)")
    for key in kwargs:
        if key != "only_if_contains":
            out.not_honoured.append(f"network.network_kwargs.{key}: {kwargs[key]!r} has no ot_dist counterpart")
    if network.get("pretrained_lora_path"):
        lora["init_from"] = network.get("pretrained_lora_path")
    for key in ("all_layers", "layer_offloading", "lorm"):
        if network.given(key) and network.get(key):
            out.not_honoured.append(f"network.{key}: {network.get(key)!r} has no ot_dist counterpart")
    network.get("split_multistage_loras")
    network.get("old_lokr_format")
    c["lora"] = lora


def _parts(train: Section, c: dict, out: Imported) -> None:
    """train_unet / train_text_encoder, all at train.lr: ai-toolkit builds every parameter group with it (its
    unet_lr / text_encoder_lr are parsed and never read)."""
    lr = train.number("lr", 1e-6)
    c["learning_rate"] = lr  # ai-toolkit's default 1e-6 included (ot_dist's is 1e-5)
    for key in ("unet_lr", "text_encoder_lr"):
        if train.given(key):
            out.notes.append(f"train.{key}: {train.get(key)} is not read by ai-toolkit (train.lr is every part's)")
    if not train.get("train_unet", True):
        out.not_honoured.append("train.train_unet: false: ot_dist always trains the denoiser")
    if not train.get("train_text_encoder", False):
        return
    if c["method"] == "full" and c["model"]["family"] in UNETS:
        parts = ("text_encoder", "text_encoder_2") if c["model"]["family"] == "sdxl" else ("text_encoder",)
        for part in parts:
            c[part] = {"train": True}
        if c.get("clip_grad_norm"):
            out.notes.append("train.max_grad_norm: ai-toolkit clips each parameter group's norm; ot_dist clips the "
                             "norm over all trained parts")
    else:
        out.not_honoured.append(f"train.train_text_encoder: ai-toolkit's text encoder training of a "
                                f"{c['model']['family']} {c['method']} is not mapped; the text encoders stay frozen")


def _optimizer(train: Section, c: dict, out: Imported) -> None:
    from ot_dist.optim.registry import SPECS

    kind = str(train.get("optimizer", "adamw")).lower()
    params = dict(train.get("optimizer_params", {}) or {})
    if kind not in OPTIMIZERS:
        why = ("ai-toolkit builds DAdaptLion with an eps it does not take (it stops)" if kind.startswith("dadaptation")
               else "not in ot_dist's optimizer stack")
        out.not_honoured.append(f"train.optimizer: {kind}: {why}; ADAMW is written")
        c["optimizer"] = {"name": "ADAMW", "eps": 1e-6}
        return
    name, defaults = OPTIMIZERS[kind]
    spec = SPECS[name]
    options = {"name": name, **defaults}
    for key, value in params.items():
        if key == "betas" and isinstance(value, (list, tuple)) and len(value) <= len(spec.betas):
            options.update(zip(spec.betas, map(float, value)))
        elif key in spec.defaults:
            options[key] = value
        else:
            out.not_honoured.append(f"train.optimizer_params.{key}: {value!r}: not an option of ot_dist's {name}")
    if kind.startswith(("prodigy", "dadaptation")) and c["learning_rate"] < 0.1:
        out.notes.append(f"train.lr: {c['learning_rate']}: ai-toolkit runs {kind} at lr 1.0 below 0.1; 1.0 is "
                         "written")
        c["learning_rate"] = 1.0
    if kind in OWN_IMPLEMENTATION:
        out.notes.append(f"train.optimizer: {kind} is ai-toolkit's {OWN_IMPLEMENTATION[kind]}; ot_dist's {name}")
    if kind == "adafactor":
        c["clip_grad_norm"] = None  # SDTrainer clips every optimizer's gradients but Adafactor's
    c["optimizer"] = options


def _scheduler(train: Section, c: dict, out: Imported) -> None:
    """ai-toolkit's schedules (toolkit/scheduler.py) over train.steps: constant, cosine (CosineAnnealingLR to
    eta_min), constant_with_warmup (num_warmup_steps, 1000 by default), and torch's linear, step and
    cosine_with_restarts classes, which ot_dist runs as a CUSTOM schedule of the same class."""
    name = str(train.get("lr_scheduler", "constant"))
    params = dict(train.get("lr_scheduler_params", {}) or {})
    lr = c["learning_rate"]
    if name == "constant" and params.get("factor", 1.0) == 1.0:
        c["scheduler"] = {"name": "CONSTANT"}
    elif name == "cosine" and set(params) <= {"eta_min"}:
        c["scheduler"] = {"name": "COSINE", "min_factor": params.get("eta_min", 0.0) / lr if lr else 0.0}
    elif name == "constant_with_warmup" and set(params) <= {"num_warmup_steps"}:
        warmup = warmup_micro_steps(int(params.get("num_warmup_steps", 1000)), c["gradient_accumulation_steps"],
                                    "train.lr_scheduler_params.num_warmup_steps", out.not_honoured.append)
        c["scheduler"] = {"name": "CONSTANT", "warmup_steps": warmup}
    elif name in ("linear", "step", "cosine_with_restarts", "cosine", "constant"):
        classes = {"linear": ("LinearLR", "total_iters"), "step": ("StepLR", None), "constant": ("ConstantLR",
                   "total_iters"), "cosine": ("CosineAnnealingLR", "T_max"),
                   "cosine_with_restarts": ("CosineAnnealingWarmRestarts", "T_0")}
        cls, length = classes[name]
        if length and length not in params:
            params[length] = "%TOTAL_STEPS%"
        c["scheduler"] = {"name": "CUSTOM", "class_name": f"torch.optim.lr_scheduler.{cls}", "params": params}
    else:
        out.not_honoured.append(f"train.lr_scheduler: {name} with {params}: not mapped; CONSTANT is written")
        c["scheduler"] = {"name": "CONSTANT"}


# train.timestep_type of a flow-matching model (CustomFlowMatchEulerDiscreteScheduler.set_train_timesteps):
# sigmoid, ai-toolkit's default, is sigmoid(N(0, 1)) unshifted; linear the table's 1000 timesteps drawn uniformly,
# unshifted; shift / flux_shift / lumina2_shift the uniform draw shifted as the scheduler samples (ot_dist's auto)
TIMESTEP_TYPES = {"sigmoid": ("logit_normal", 1.0), "linear": ("uniform", 1.0), "shift": ("uniform", "auto"),
                  "flux_shift": ("uniform", "auto"), "lumina2_shift": ("uniform", "auto")}
LOSS_TYPES = {"mse": {}, "mae": {"mse_strength": 0.0, "mae_strength": 1.0}}


def _loss(train: Section, c: dict, family: str, out: Imported) -> None:
    loss = {}
    skip = out.not_honoured.append
    flow = "flow_euler" in get_family(family).samplers
    kind = str(train.get("timestep_type", "sigmoid"))
    train.get("noise_scheduler")  # ai-toolkit picks flowmatch or DDPM with the model; ot_dist the family's own
    if flow:
        if kind == "weighted":
            skip("train.timestep_type: weighted: ai-toolkit weights each timestep's loss by its bell-shaped table; "
                 "ot_dist's uniform draw without the weights is written")
            kind = "linear"
        if kind not in TIMESTEP_TYPES:
            skip(f"train.timestep_type: {kind} has no ot_dist counterpart; ai-toolkit's default (sigmoid) is written")
            kind = "sigmoid"
        distribution, shift = TIMESTEP_TYPES[kind]
        loss["timestep_distribution"] = distribution
        loss["timestep_shift"] = shift
        if shift == 1.0:
            loss["dynamic_timestep_shifting"] = False
        if train.get("min_denoising_steps", 0) != 0 or train.get("max_denoising_steps", 999) != 999:
            skip("train.min_denoising_steps / max_denoising_steps: on a flow model they bound the index into "
                 "ai-toolkit's drawn table; not mapped")
        for key in ("min_snr_gamma", "snr_gamma"):
            if train.get(key):
                skip(f"train.{key}: {train.get(key)}: min-SNR weighting is defined for DDPM models only in ot_dist")
    else:
        if train.given("timestep_type"):
            out.notes.append(f"train.timestep_type: {kind}: not read for {family} (DDPM: uniform), as in ai-toolkit")
        low, high = train.number("min_denoising_steps", 0, int), train.number("max_denoising_steps", 999, int)
        if low:
            loss["min_timestep"] = low
        if high != 999:
            loss["max_timestep"] = high
        gamma = train.get("min_snr_gamma") or train.get("snr_gamma")
        if gamma:
            loss["min_snr_gamma"] = float(gamma)
    offset = train.number("noise_offset", 0.0)
    if offset:  # apply_noise_offset: offset x one N(0, 1) value per sample and channel, as ot_dist's
        loss["offset_noise_weight"] = offset
    style = train.get("content_or_style", "balanced")
    if style != "balanced":
        skip(f"train.content_or_style: {style}: ai-toolkit's cubic bias of the timesteps is not supported")
    kind = str(train.get("loss_type", "mse"))
    if kind in LOSS_TYPES:
        loss |= LOSS_TYPES[kind]
    else:
        skip(f"train.loss_type: {kind} has no ot_dist counterpart; MSE is written")
    if loss:
        c["loss"] = loss


def _ema(train: Section, c: dict, out: Imported) -> None:
    """ema_config: ai-toolkit's ExponentialMovingAverage updates every step at the fixed decay (no warm-up)."""
    ema = train.get("ema_config") or {}
    if not isinstance(ema, dict):
        raise ConfigError(f"{P}.train.ema_config: {ema!r} is not a mapping")
    if not ema.get("use_ema"):
        return
    c["ema"] = {"enabled": True, "decay": float(ema.get("ema_decay", 0.999)), "update_step_interval": 1}
    out.not_honoured.append("train.ema_config: ai-toolkit's EMA uses its decay from the first step; ot_dist's warms "
                            "up as min((1 + n) / (10 + n), decay)")
    for key in ("use_feedback", "param_multiplier"):
        if ema.get(key) not in (None, False, 1.0):
            out.not_honoured.append(f"train.ema_config.{key}: {ema[key]} has no ot_dist counterpart")


def _saves(save: Section, c: dict, out: Imported) -> None:
    """ai-toolkit saves the trained weights (its resume point too) every save_every steps, keeping
    max_step_saves_to_keep; it has no saves on a clock."""
    c["checkpoint"] = {"every_n_steps": save.number("save_every", 1000, int),
                       "keep_last": save.number("max_step_saves_to_keep", 5, int), "every_n_minutes": None}
    dtype = str(save.get("dtype", "float16")).lower()
    if dtype in PRECISION:
        c["output_dtype"] = PRECISION[dtype]
    else:
        out.not_honoured.append(f"save.dtype: {dtype}: not float32, float16 or bfloat16; float32 is written")
    if save.get("save_format", "safetensors") != "safetensors":
        out.notes.append(f"save.save_format: {save.get('save_format')}: ot_dist exports its own layouts "
                         "(docs/export.md)")


PROCESS_KEYS = ("type", "training_folder", "network", "train", "model", "save", "sample", "datasets",
                "trigger_word", "training_seed", "name")


def _process_keys(process: dict, out: Imported) -> None:
    more = process.pop("__more_processes", 0)
    if more:
        out.not_honoured.append(f"config.process: {more} more process(es) after the first are not imported")
    for key, value in process.items():
        if key in PROCESS_KEYS or value in (None, False, "", [], {}):
            continue
        if key in NO_EFFECT:
            out.notes.append(f"{key}: ignored ({NO_EFFECT[key]}: it does not change what trains)")
        else:
            out.not_honoured.append(f"{key}: {value!r}: this section has no ot_dist counterpart")
