"""`ot-dist import onetrainer CONFIG.json`: a OneTrainer training config (its JSON as the UI saves it, config versions
0-11, or a preset that stores only what differs from the defaults) as an ot_dist config that validates.

Every OneTrainer field either maps to an ot_dist key with the same meaning (ot_dist uses OneTrainer's names and
counts: optimizer and scheduler names, warmup in OneTrainer's steps, `stop_training_after`), or is listed with the
reason it is not honoured, in the written file and on stderr. Nothing is dropped without a line.

This module drives the import and maps the model, the training method (LoRA, embedding) and the top-level settings.
Each other group of OneTrainer's fields has its own module beside it, so one can be read (and checked against
OneTrainer's code) alone: onetrainer_upgrade (older config versions), onetrainer_parts, onetrainer_layers (the LoRA
layer filter), onetrainer_embeddings (additional embeddings), onetrainer_optim, onetrainer_loss, onetrainer_concepts,
onetrainer_samples, onetrainer_checkpoint; onetrainer_common holds what they share. The sections run in a fixed order: the order of the listed lines."""

from __future__ import annotations

from pathlib import Path, PureWindowsPath

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.onetrainer_checkpoint import import_checkpoint
from ot_dist.migrate.common import T5_DEFAULTS, Imported, is_windows_path, local_path, note_local_model, read_json
from ot_dist.migrate.onetrainer_concepts import import_concepts, import_latent_caching
from ot_dist.migrate.onetrainer_embeddings import (import_additional_embeddings, output_embedding_refusal,
                                                 output_init_text, padded_init_text, vector_setting)
from ot_dist.migrate.onetrainer_layers import import_layer_filter, import_text_encoder_layers
from ot_dist.migrate.onetrainer_loss import import_loss
from ot_dist.migrate.onetrainer_optim import (fused_clipping, import_ema, import_optimizer, import_scheduler,
                                              scale_learning_rates, streamed_trained_denoiser)
from ot_dist.migrate.onetrainer_parts import import_parts
from ot_dist.migrate.onetrainer_samples import import_samples
from ot_dist.migrate.onetrainer_unmapped import import_unmapped
from ot_dist.migrate.onetrainer_upgrade import upgrade
from ot_dist.models.families.registry import get_family

FAMILIES = {  # OneTrainer model_type -> (model.family, inpainting)
    "STABLE_DIFFUSION_15": ("sd1", False), "STABLE_DIFFUSION_15_INPAINTING": ("sd1", True),
    "STABLE_DIFFUSION_20": ("sd2", False), "STABLE_DIFFUSION_20_BASE": ("sd2", False),
    "STABLE_DIFFUSION_21": ("sd2", False), "STABLE_DIFFUSION_21_BASE": ("sd2", False),
    "STABLE_DIFFUSION_20_INPAINTING": ("sd2", True),
    "STABLE_DIFFUSION_XL_10_BASE": ("sdxl", False), "STABLE_DIFFUSION_XL_10_BASE_INPAINTING": ("sdxl", True),
    "STABLE_DIFFUSION_3": ("sd3", False), "STABLE_DIFFUSION_35": ("sd3", False),
    "FLUX_DEV_1": ("flux", False), "CHROMA_1": ("chroma", False),
    "PIXART_ALPHA": ("pixart_alpha", False), "PIXART_SIGMA": ("pixart_sigma", False),
    "STABLE_CASCADE_1": ("stable_cascade", False), "WUERSTCHEN_2": ("wuerstchen_v2", False),
    "SANA": ("sana", False), "QWEN": ("qwen_image", False), "FLUX_2": ("flux2", False),
    "HI_DREAM_FULL": ("hidream", False),
}
FAMILIES["Z_IMAGE"] = ("z_image", False)
FAMILIES["KREA_2"] = ("krea2", False)
FAMILIES["ERNIE"] = ("ernie_image", False)
FAMILIES["FLUX_FILL_DEV_1"] = ("flux", True)  # Flux.1 Fill [dev]: Flux's inpainting model (FluxFillPipeline)
# SD 2.0 depth: sd2, its 5-channel UNet detected when loaded (ot_dist/models/depth.py). ot_dist computes each step's
# depth map from the images (no latent cache) and cannot sample it yet (its pipeline is image-to-image).
FAMILIES["STABLE_DIFFUSION_20_DEPTH"] = ("sd2", False)
DEPTH_MODEL_TYPES = ("STABLE_DIFFUSION_20_DEPTH",)
FAMILIES["ANIMA"] = ("anima", False)
FAMILIES["IDEOGRAM_4"] = ("ideogram4", False)
FAMILIES["HUNYUAN_VIDEO"] = ("hunyuan_video", False)
# OneTrainer's one FLUX_2 type trains [dev] and [klein] (Flux2Model.is_dev: the transformer's 48 heads); the base
# model's name tells them apart here (black-forest-labs/FLUX.2-dev, FLUX.2-klein-base-4B / -9B).
KLEIN_FAMILY = {"flux2": "flux2_klein"}
METHODS = {"FINE_TUNE": "full", "LORA": "lora", "EMBEDDING": "embedding"}
DTYPES = {"FLOAT_32": "float32", "TFLOAT_32": "float32", "FLOAT_16": "float16", "BFLOAT_16": "bfloat16",
          "FLOAT_8": "float8", "NFLOAT_4": "nf4"}
STORAGE_ONLY = ("FLOAT_8", "NFLOAT_4")  # what only frozen weights are stored in, never computed or exported in


def import_onetrainer(path: str | Path, concepts_path: str | None = None, samples_path: str | None = None) -> Imported:
    path = Path(path)
    raw = read_json(path, "CONFIG")
    if not isinstance(raw, dict):
        raise InputFileError(f"CONFIG: {path} is not a OneTrainer training config (a JSON object)")
    version = raw.get("__version", 0)
    ot = {**defaults.TRAIN, **upgrade(raw)}
    out = Imported({})
    c = out.config
    skip = out.not_honoured.append

    model_type = ot["model_type"]
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type: {model_type} is not trained by ot_dist (it trains "
                          f"{', '.join(sorted(FAMILIES))})")
    family, inpainting = FAMILIES[model_type]
    if family in KLEIN_FAMILY and "klein" in str(ot["base_model_name"]).lower():
        family = KLEIN_FAMILY[family]
    if ot["training_method"] not in METHODS:
        raise ConfigError(f"training_method: {ot['training_method']} is not an ot_dist method (FINE_TUNE, LORA, "
                          "EMBEDDING)")
    method = METHODS[ot["training_method"]]
    c["model"] = {"family": family, "path": local_path(ot["base_model_name"], "base_model_name", out)}
    if inpainting:
        c["model"]["inpainting"] = True
    note_local_model(c["model"]["path"], "base_model_name", out)
    llama = (ot.get("text_encoder_4") or {}).get("model_name")
    if llama:  # OneTrainer's HiDream loads its Llama from a model of its own
        out.notes.append(f"text_encoder_4.model_name: {llama}: ot_dist reads the Llama from model.path's "
                         "text_encoder_4 / tokenizer_4: save the base folder with it once (docs/families.md, "
                         "HiDream-I1)")
    c["method"] = method
    destination = local_path(ot["output_model_destination"], "output_model_destination", out)
    destination = PureWindowsPath(destination) if is_windows_path(destination) else Path(destination)
    c["output_dir"] = str(destination.with_suffix(""))
    out.notes.append(f"output_model_destination: {destination} -> output_dir {c['output_dir']} (ot_dist writes "
                     "model/ + model.safetensors, lora.safetensors or embedding.safetensors inside it)")

    c["resolution"] = _resolution(str(ot["resolution"]).replace(" ", ""), family, skip)
    for key in ("batch_size", "gradient_accumulation_steps", "epochs", "learning_rate", "clip_grad_norm"):
        c[key] = ot[key]
    c["train_dtype"] = _dtype(ot, "train_dtype", skip) or "float16"
    if ot["train_dtype"] == "TFLOAT_32":
        c["tf32"] = True
    c["output_dtype"] = _dtype(ot, "output_dtype", skip) or "float32"

    import_parts(ot, c, family, method, out)
    _performance(ot, c, skip)
    _layer_skip(ot, c, family, skip)
    _t5_length(ot, c, family)
    _caption_length(ot, family, skip)
    if family in ("stable_cascade", "wuerstchen_v2") and (ot.get("decoder") or {}).get("model_name"):
        c["model"]["decoder"] = local_path(ot["decoder"]["model_name"], "decoder.model_name", out)
    import_optimizer(ot, c, skip)
    streamed_trained_denoiser(c, get_family(family).denoiser, out)
    fused_clipping(c, out)
    import_scheduler(ot, c, skip)
    import_ema(ot, c)
    import_loss(ot, c, skip)
    if method == "lora":
        c["lora"] = {"rank": ot["lora_rank"], "alpha": ot["lora_alpha"], "dropout": ot["dropout_probability"]}
        import_layer_filter(ot, c["lora"], family, get_family(family).denoiser, out)
        import_text_encoder_layers(c, family, out)
        spec = get_family(family)
        _lora_variant(ot, c["lora"], skip,
                      oft_written=spec.lora_file_prefixes is not None or spec.lora_oft_diffusers_layout)
        if ot.get("lora_weight_dtype") not in (None, "FLOAT_32"):
            skip(f"lora_weight_dtype: {ot['lora_weight_dtype']} (adapters train in float32) is not supported")
        if ot["lora_model_name"]:  # OneTrainer continues training this LoRA file
            if c["lora"].get("variant", "lora") == "lora":
                c["lora"]["init_from"] = local_path(ot["lora_model_name"], "lora_model_name", out)
                _continued_alpha(c["lora"], out)
            else:
                skip(f"lora_model_name: {ot['lora_model_name']}: ot_dist continues plain LoRA files only")
    if method == "embedding":
        _embedding(ot, c, out)
    import_additional_embeddings(ot, c, method, out)

    crop_jitter = import_concepts(ot, c, path, concepts_path, out)
    if not ot.get("aspect_ratio_bucketing", True):  # every image scaled to cover the square and cropped to it
        c["data"]["bucket_assignment"] = "square"
    import_samples(ot, c, path, samples_path, out)
    import_checkpoint(ot, c, skip)
    import_latent_caching(ot, c, inpainting, crop_jitter, out)
    if model_type in DEPTH_MODEL_TYPES:
        _depth_model(c, out)
    scale_learning_rates(ot, c, out)
    import_unmapped(ot, c, out)
    c["mlflow"] = {"run_name": destination.stem}
    out.notes.insert(0, f"imported from {path.name} (OneTrainer config version {version})")
    return out


def _depth_model(c: dict, out: Imported) -> None:
    """What a depth-conditioned model changes in the imported config: no latent cache (each step's depth map is
    computed from the images), no samples (they would need an image to take the depth of)."""
    if c.get("data", {}).pop("cache_latents", False):
        out.notes.append("latent_caching: off, because a depth model is trained (ot_dist computes each step's depth "
                         "map from the images)")
    prompts = c.get("sampling", {}).pop("prompts", None)
    if prompts:
        out.not_honoured.append(f"samples: {len(prompts)} prompt(s) left out: ot_dist cannot sample a depth model "
                                "yet (StableDiffusionDepth2ImgPipeline needs an image to take the depth of)")


# OneTrainer's attention_mechanism (BaseModelSetup._set_attention_backend) as performance.attention_backend: SDP is
# torch's own choice; FLASH is the flash-attn package's kernel, which ot_dist takes from torch's SDPA (the same
# FlashAttention-2 algorithm); CUDNN is SDPA's cuDNN kernel.
ATTENTION_BACKENDS = {"SDP": "auto", "FLASH": "flash", "CUDNN": "cudnn"}


def _performance(ot: dict, c: dict, skip) -> None:
    """`compile` and `attention_mechanism` as ot_dist's performance options."""
    performance = {}
    mechanism = str(ot.get("attention_mechanism") or "SDP")
    if mechanism not in ATTENTION_BACKENDS:
        skip(f"attention_mechanism: {mechanism} is not an ot_dist attention backend (torch's SDPA kernels: flash, "
             "cudnn, efficient, math); torch chooses")
    elif ATTENTION_BACKENDS[mechanism] != "auto":
        performance["attention_backend"] = ATTENTION_BACKENDS[mechanism]
    if ot.get("compile"):
        # the denoiser's blocks, regionally, as OneTrainer compiles them (streamed ones: their forward only)
        performance["compile"] = True
    if performance:
        c["performance"] = {**c.get("performance", {}), **performance}


def _resolution(value: str, family: str, skip) -> int | list[int]:
    """OneTrainer's `resolution`: sides of square-area buckets ("512" or "512,768"), or one fixed size "WxH" (mgds'
    AspectBucketing) that every image is cropped to."""
    if "x" in value and "," not in value:
        width, height = (int(side) for side in value.split("x"))
        step = get_family(family).bucket_step
        side = max(step, round((width * height) ** 0.5 / step) * step)
        skip(f"resolution: {value} (every image cropped to {width}x{height}) is not supported: ot_dist buckets by "
             f"aspect ratio at the area of a {side} px square")
        return side
    try:
        resolutions = [int(r) for r in value.split(",") if r]
    except ValueError:
        raise ConfigError(f"resolution: {value!r} is not OneTrainer's '512', '512,768' or '768x512'") from None
    return resolutions[0] if len(resolutions) == 1 else resolutions


def _embedding(ot: dict, c: dict, out: Imported) -> None:
    skip = out.not_honoured.append
    embedding = {**defaults.EMBEDDING, **(ot.get("embedding") or {})}
    init_text = (embedding["initial_embedding_text"] or "").strip() or "*"
    token = embedding["placeholder"]
    continued = embedding["model_name"]  # OneTrainer continues this file; its vector count is the file's
    if continued and not continued.lower().endswith(".safetensors"):
        skip(f"embedding.model_name: {continued} is not a .safetensors file (a .pt / .bin is a pickle, which can run "
             "code when loaded: convert it to continue it); the vectors start from embedding.init_text")
        continued = ""
    vectors, several = vector_setting(embedding, continued)
    if several and token != token.lower():  # OneTrainer swaps the placeholder, in any case
        out.notes.append(f"embedding.placeholder: {token} is written {token.lower()} (a token of several vectors "
                         "must be lower case, as CLIP tokenizers read the prompt; captions match it in any case)")
        token = token.lower()
    c["embedding"] = {"token": token, "vectors": vectors, "init_text": padded_init_text(init_text, vectors)}
    if embedding["is_output_embedding"]:
        if why := output_embedding_refusal(c):
            skip(f"embedding.is_output_embedding: true (an embedding of the text encoder's output): {why}; an input "
                 "embedding is trained instead")
        else:
            c["embedding"].update(output_embedding=True, init_text=output_init_text(embedding))
    if continued:
        del c["embedding"]["vectors"]
        c["embedding"]["init_from"] = local_path(continued, "embedding.model_name", out)
    if ot["embedding_learning_rate"]:
        c["embedding"]["learning_rate"] = ot["embedding_learning_rate"]
    if embedding["stop_training_after"] is not None and embedding["stop_training_after_unit"] != "NEVER":
        skip(f"embedding.stop_training_after: {embedding['stop_training_after']} "
             f"{embedding['stop_training_after_unit']} is not supported (the embedding trains to the end)")
    if ot["preserve_embedding_norm"]:  # the same rescale, of these vectors and the additional embeddings'
        c["preserve_embedding_norm"] = True
    if ot["embedding_weight_dtype"] not in ("FLOAT_32", None):
        skip(f"embedding_weight_dtype: {ot['embedding_weight_dtype']} (the vectors train in float32) is not supported")


def _dtype(ot: dict, key: str, skip) -> str | None:
    value = ot.get(key)
    if value is None:
        return None
    if value not in DTYPES:
        skip(f"{key}: {value} is not an ot_dist dtype (float32, float16, bfloat16); the default is used")
        return None
    if key in ("train_dtype", "output_dtype") and value in STORAGE_ONLY:
        skip(f"{key}: {value} is a storage dtype in ot_dist (weight_dtype), not a {key}; the default is used")
        return None
    return DTYPES[value]


def _t5_length(ot: dict, c: dict, family: str) -> None:
    """OneTrainer pads Flux's T5 tokens to text_encoder_2_sequence_length (default 77) and SD3's to 77 (fixed);
    Chroma's to its tokenizer's length, ot_dist's default too."""
    length = (ot.get("text_encoder_2_sequence_length") or 77) if family == "flux" else 77 if family == "sd3" else None
    if length is not None and length != T5_DEFAULTS[family]:
        c["model"]["t5_max_tokens"] = length


def _caption_length(ot: dict, family: str, skip) -> None:
    """OneTrainer pads FLUX.2's chat-templated captions to text_encoder_sequence_length (default 512, the pipelines'
    max_sequence_length); ot_dist's FLUX.2 families use 512."""
    length = ot.get("text_encoder_sequence_length")
    if family in ("flux2", "flux2_klein") and length not in (None, 512):
        skip(f"text_encoder_sequence_length: {length} is not supported for {family}; ot_dist pads to 512 tokens, as "
             "the pipelines")


def _layer_skip(ot: dict, c: dict, family: str, skip) -> None:
    fam = get_family(family)
    for key in ("text_encoder_layer_skip", "text_encoder_2_layer_skip"):  # clip skip, OneTrainer's names
        if ot.get(key):
            if key.removesuffix("_layer_skip") in fam.layer_skip_encoders:
                c["model"][key] = ot[key]
            else:
                skip(f"{key}: {ot[key]}: {family} takes no layer skip for that encoder")
    for key in ("text_encoder_3_layer_skip", "text_encoder_4_layer_skip"):
        if ot.get(key):
            skip(f"{key}: {ot[key]}: {family} takes no layer skip for that encoder")


def _continued_alpha(lora: dict, out: Imported) -> None:
    """OneTrainer loads a continued LoRA's `.alpha` tensors into its modules (a buffer of each LoRAModule), so they
    train, and are saved, at the file's alpha / rank whatever lora_alpha; ot_dist trains at lora.alpha from the file's
    starting change. The file's alpha becomes lora.alpha where the file is on this machine and has one."""
    from ot_dist.lora_tools.files import read_lora_file

    path = Path(lora["init_from"])
    what = f"lora_model_name: OneTrainer trains a continued LoRA at the file's alpha (its .alpha tensors replace " \
           f"lora_alpha {lora['alpha']})"
    if not path.is_file():
        out.notes.append(f"{what}; {path} is not on this machine: set lora.alpha to the file's alpha")
        return
    try:
        alphas = {pair.alpha for pair in read_lora_file(path, tool="lora_model_name").pairs.values()}
    except InputFileError as err:  # training says it again, at lora.init_from
        out.notes.append(f"{what}; {err}")
        return
    if len(alphas) != 1 or None in alphas:
        out.notes.append(f"{what}; {path} has no single alpha ({sorted(map(str, alphas))}): lora.alpha is kept")
        return
    [alpha] = alphas
    if alpha != lora["alpha"]:
        out.notes.append(f"{what}: lora.alpha {alpha}, the file's")
        lora["alpha"] = alpha


PEFT_VARIANTS = {"LORA": "lora", "LOHA": "loha", "LOKR": "lokr", "OFT_2": "oft"}
# TrainConfig's OFT options beside oft_block_size (OneTrainer's defaults)
OFT_DEFAULTS = {"oft_block_share": False, "oft_scaled": False}
# TrainConfig's LoKr options (lokr_vec_trick only changes how OneTrainer computes the same product).
LOKR_DEFAULTS = {"lokr_dim": 16, "lokr_decompose_both": False, "lokr_decompose_factor": -1, "lokr_use_tucker": False,
                 "lokr_weight_decompose": False, "lokr_full_matrix": False}


def _lora_variant(ot: dict, lora: dict, skip, oft_written: bool = True) -> None:
    """OneTrainer's peft_type / lora_decompose as lora.variant. ot_dist's DoRA (peft's) decomposes on the output
    axis: OneTrainer's default input-axis DoRA is another adapter, so it is listed, and plain LoRA trains instead.
    `oft_written`: whether ot_dist writes oft files for the family (the kohya-layout families, and the diffusers-layout
    ones whose file ComfyUI applies as trained: `Family.lora_oft_diffusers_layout`)."""
    peft_type = str(ot.get("peft_type") or "LORA")
    if peft_type not in PEFT_VARIANTS:
        skip(f"peft_type: {peft_type} has no ot_dist variant (lora, dora, loha, lokr, oft); plain LoRA instead")
        return
    if peft_type == "OFT_2" and not oft_written:
        skip("peft_type: OFT_2: ot_dist's oft is not written for this model family (ComfyUI would not apply its "
             "file as trained); plain LoRA instead")
        return
    variant = PEFT_VARIANTS[peft_type]
    if ot.get("lora_decompose"):
        if variant != "lora":
            skip(f"lora_decompose: DoRA on {peft_type} is not supported ({variant} without it)")
        elif not ot.get("lora_decompose_output_axis"):
            skip("lora_decompose: OneTrainer's DoRA on the input axis (lora_decompose_output_axis false); ot_dist's "
                 "DoRA (peft's) decomposes on the output axis: plain LoRA instead, or set lora.variant: dora")
        else:
            variant = "dora"
    if variant != "lora":
        lora["variant"] = variant
        if variant in ("loha", "lokr", "oft") and lora.get("dropout"):
            skip(f"dropout_probability: {lora['dropout']} ({variant} has no such dropout here); 0 instead")
            lora["dropout"] = 0.0
    if variant == "oft":
        # OneTrainer rotates blocks of each layer's input (peft's OFT v2); ot_dist's oft rotates output rows, the
        # layout ComfyUI reads: the same block size, another (file-loadable) rotation
        lora["oft_block_size"] = ot.get("oft_block_size", 32)
        for key, default in OFT_DEFAULTS.items():
            if ot.get(key, default) != default:
                skip(f"{key}: {ot[key]} is not an option of ot_dist's oft (one rotation per block, unscaled)")
    if variant == "lokr":
        lora["rank"] = ot.get("lokr_dim", LOKR_DEFAULTS["lokr_dim"])  # OneTrainer's LoKr rank; lora_rank is not read
        for key, default in LOKR_DEFAULTS.items():
            if key != "lokr_dim" and ot.get(key, default) != default:
                skip(f"{key}: {ot[key]} is not an option of ot_dist's lokr (peft's LoKr: factor -1, w1 whole, no "
                     "Tucker, no weight decomposition)")
