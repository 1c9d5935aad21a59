"""ai-toolkit's `datasets` (toolkit/config_modules.py DatasetConfig) as ot_dist concepts, and its `sample` section
(SampleConfig, SampleItem, the `--flag value` words GenerateImageConfig reads from a prompt) as `sampling`.

A dataset's folder_path is the concept's path; caption_ext, caption_dropout_rate, shuffle_tokens, token_dropout_rate
with keep_tokens, flip_x, num_repeats, is_reg (with train.reg_weight), the trigger word (put before every caption
that lacks it) and control_path (one folder or a list, or control_path_1 .. _3) as the concept's reference_path list,
in order ([data.md](docs/data.md#several-reference-images-per-sample)). Its resolution list becomes ot_dist's
resolution list (ai-toolkit trains every dataset at each of its resolutions; ot_dist draws one per step)."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.ai_toolkit_args import Section, list_unread
from ot_dist.migrate.common import Imported, local_path
from ot_dist.models.families.registry import get_family

# ai-toolkit's samplers (toolkit/sampler.py) -> ot_dist's, for the UNet families (a flow model samples with its one)
SAMPLERS = {"ddim": "ddim", "euler": "euler", "euler_a": "euler_a", "dpmsolver": "dpmpp_2m",
            "dpmsolver++": "dpmpp_2m", "unipc": "unipc"}
UNETS = ("sd1", "sd2", "sdxl")
# prompt words GenerateImageConfig._process_prompt_string reads -> the SamplePrompt field (its type)
PROMPT_FLAGS = {"n": ("negative_prompt", str), "w": ("width", int), "h": ("height", int), "d": ("seed", int),
                "seed": ("seed", int), "l": ("guidance_scale", float), "cfg": ("guidance_scale", float),
                "s": ("steps", int), "steps": ("steps", int), "gr": ("guidance_rescale", float),
                "ctrl_img": ("ctrl_img", str)}


def import_datasets(datasets: list[Section], trigger, train: Section, c: dict, family: str, out: Imported) -> None:
    skip = out.not_honoured.append
    concepts, resolutions, cached, text_cached = [], [], True, bool(train.get("cache_text_embeddings", False))
    varying = False
    for i, data in enumerate(datasets):
        where = f"datasets[{i}]"
        folder = data.get("folder_path") or data.get("dataset_path")
        if not folder:
            raise ConfigError(f"{data.where}.folder_path: not set (the folder of images and captions)")
        concept = {"path": local_path(str(folder), f"{where}.folder_path", out)}
        kind = data.get("type", "image")
        if kind != "image":
            raise ConfigError(f"{data.where}.type: {kind} datasets are not imported (ot_dist trains image folders)")
        extension = data.get("caption_ext", ".txt") or ".txt"
        concept["caption_extension"] = extension if extension.startswith(".") else f".{extension}"
        dropout = data.number("caption_dropout_rate", 0.0)
        if dropout:
            concept["caption_dropout_probability"] = dropout
        keep = data.number("keep_tokens", 0, int)
        if data.get("shuffle_tokens", False):
            concept["tag_shuffling"] = True
            concept["keep_tags_count"] = 0  # ai-toolkit shuffles every tag; keep_tokens only guards its dropout
            if keep:
                skip(f"{where}.keep_tokens: {keep} with shuffle_tokens: ai-toolkit shuffles the kept tokens too; "
                     "ot_dist keeps nothing in place")
        token_dropout = data.number("token_dropout_rate", 0.0)
        if token_dropout:
            concept |= {"tag_dropout_probability": token_dropout, "tag_dropout_mode": "random"}
            concept.setdefault("keep_tags_count", keep)
        if dropout or token_dropout or concept.get("tag_shuffling"):
            varying = True
        word = data.get("trigger_word") or trigger
        if word and not data.get("is_reg", False):
            concept["caption_prefix"] = str(word)
            out.notes.append(f"{where}: the trigger word {word!r} is put before every caption; ai-toolkit adds it "
                             "only where a caption lacks it and replaces [trigger] in captions, which ot_dist does "
                             "not")
        if data.get("default_caption"):
            skip(f"{where}.default_caption: ot_dist reads no caption for images without a caption file")
        if data.get("flip_x", False):
            concept["flip_probability"] = 0.5
        if data.get("flip_y", False):
            skip(f"{where}.flip_y: vertical flips are not supported")
        repeats = data.number("num_repeats", 1)
        if repeats != 1:
            concept["balancing"] = repeats
        if data.get("is_reg", False):
            concept["type"] = "prior_preservation"
            concept["loss_weight"] = train.number("reg_weight", 1.0)
            out.notes.append(f"{where}.is_reg: ai-toolkit trains a regularisation batch every other step; ot_dist "
                             "draws the prior_preservation concept into batches by its balancing")
        weight = data.number("loss_multiplier", 1.0)
        if weight != 1.0:
            concept["loss_weight"] = concept.get("loss_weight", 1.0) * weight
        references = _references(data, where, family, out)
        if references:
            concept["reference_path"] = references[0] if len(references) == 1 else references
        if data.get("random_crop", False):
            c.setdefault("data", {})["crop"] = "random"
        if not data.get("buckets", True):
            skip(f"{where}.buckets: false (square crops): ot_dist always buckets by aspect ratio")
        resolution = data.get("resolution", 512)
        for value in resolution if isinstance(resolution, list) else [resolution]:
            try:
                resolutions.append(int(value))
            except (TypeError, ValueError):
                raise ConfigError(f"{data.where}.resolution: {value!r} is not a number of pixels") from None
        cached &= bool(data.get("cache_latents", False) or data.get("cache_latents_to_disk", False))
        text_cached |= bool(data.get("cache_text_embeddings", False))
        _unsupported(data, where, out)
        list_unread(data, out)
        concepts.append(concept)
    data_section = c.setdefault("data", {})
    data_section["concepts"] = concepts
    step = datasets[0].number("bucket_tolerance", 64, int)  # ai-toolkit's bucket divisor
    data_section["bucket_step"] = step
    values = sorted({max(step, round(value / step) * step) for value in resolutions})
    if values != sorted(set(resolutions)):
        out.notes.append(f"datasets[].resolution: {sorted(set(resolutions))}: ot_dist's resolutions are multiples of "
                         f"the bucket step {step}; {values} is written (ai-toolkit fits its buckets to the area)")
    c["resolution"] = values[0] if len(values) == 1 else values
    if len(values) > 1:
        out.notes.append(f"datasets[].resolution: {values}: ai-toolkit trains every image at each of its dataset's "
                         "resolutions; ot_dist draws one of them per step for all datasets")
    if cached and not any(concept.get("flip_probability") for concept in concepts):
        data_section["cache_latents"] = True
    if text_cached:
        if varying:
            out.notes.append("cache_text_embeddings: not written, as captions vary per epoch here (ot_dist caches "
                             "fixed captions only)")
        else:
            data_section["cache_text"] = True


def _references(data: Section, where: str, family: str, out: Imported) -> list[str]:
    """control_path (a folder or a list) or control_path_1 .. _3, which win over it, as DatasetConfig reads them."""
    numbered = [data.get(f"control_path_{n}") for n in (1, 2, 3)]
    paths = [path for path in numbered if path] or data.get("control_path") or []
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        return []
    spec = get_family(family)
    if not spec.reference_images:
        out.not_honoured.append(f"{where}.control_path: {family} takes no reference images (ot_dist's edit "
                                "families: flux_kontext, qwen_image_edit, qwen_image_edit_plus, flux2, flux2_klein); "
                                "left out")
        return []
    if len(paths) > spec.max_reference_images:
        out.not_honoured.append(f"{where}.control_path: {len(paths)} folders; {family} takes "
                                f"{spec.max_reference_images} reference image(s) per sample: the first are used")
        paths = paths[:spec.max_reference_images]
    return [local_path(str(path), f"{where}.control_path", out) for path in paths]


UNSUPPORTED = {"mask_path": "a mask folder (ot_dist reads `-masklabel.png` beside each image)",
               "alpha_mask": "masks from the alpha channel", "inpaint_path": "inpainting masks",
               "unconditional_path": "unconditional images", "augments": "augmentations",
               "augmentations": "albumentations", "random_scale": "random scaling", "scale": "image scaling",
               "square_crop": "square crops", "controls": "control images computed by ai-toolkit",
               "control_from_same_folder": "controls drawn from the image's folder",
               "clip_image_path": "adapter images", "random_triggers": "random trigger words",
               "use_short_captions": "short captions from a JSON", "num_frames": "video clips",
               "network_weight": "a LoRA multiplier per dataset", "prior_reg": "prior regularisation",
               "replacements": "caption replacements", "standardize_images": "image standardisation",
               "do_i2v": "image-to-video", "do_audio": "audio"}


def _unsupported(data: Section, where: str, out: Imported) -> None:
    defaults = {"scale": 1.0, "num_frames": 1, "network_weight": 1.0}
    for key, what in UNSUPPORTED.items():
        value = data.get(key)
        if value not in (None, False, "", [], {}) and value != defaults.get(key):
            out.not_honoured.append(f"{where}.{key}: {value!r}: {what} are not supported")
    for key in ("cache_latents", "cache_latents_to_disk", "cache_text_embeddings", "caption_type",
                "full_size_control_images", "replay_transforms", "bucket_tolerance", "batch_size"):
        data.get(key)


def import_samples(sample: Section, trigger, c: dict, family: str, out: Imported) -> None:
    """Each sample (sample.samples, or sample.prompts as prompts alone) with its size, negative prompt, seed
    (sample.seed, + i with walk_seed; a sample's own seed, which without walk_seed the samples after it keep),
    guidance, steps and control images, every sample_every steps."""
    items = sample.get("samples")
    if items is None:
        items = [{"prompt": text} for text in sample.get("prompts", []) or []]
    if not isinstance(items, list):
        raise ConfigError(f"{sample.where}.samples: not a list")
    if not items:
        return
    skip = out.not_honoured.append
    spec = get_family(family)
    common = {"width": sample.number("width", 512, int), "height": sample.number("height", 512, int),
              "negative_prompt": sample.get("neg", "") or "", "guidance_scale": sample.number("guidance_scale", 7.0),
              "steps": sample.number("sample_steps", 20, int),
              "guidance_rescale": sample.number("guidance_rescale", 0.0)}
    start, walk = sample.number("seed", 0, int), bool(sample.get("walk_seed", False))
    current = start
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not item.get("prompt"):
            raise ConfigError(f"{sample.where}.samples[{i}].prompt: not set")
        if walk:
            current = start + i
        if item.get("seed") is not None:
            current = int(item["seed"])
        fields = common | {key: item[key] for key in ("width", "height", "guidance_scale", "guidance_rescale")
                           if item.get(key) is not None}
        if item.get("neg") is not None:
            fields["negative_prompt"] = item["neg"]
        if item.get("sample_steps") is not None:
            fields["steps"] = int(item["sample_steps"])
        text, flags = _prompt_flags(str(item["prompt"]), i, out)
        if trigger:
            text = text.replace("[trigger]", str(trigger)).replace("[name]", str(trigger))
        prompt = {"prompt": text, "seed": current, **fields, **flags}
        images = [item.get("ctrl_img_1") or item.get("ctrl_img") or prompt.pop("ctrl_img", None)]
        prompt.pop("ctrl_img", None)
        images += [item.get(f"ctrl_img_{n}") for n in (2, 3)]
        images = [path for path in images if path]
        if len(images) > spec.max_reference_images and spec.reference_images:
            skip(f"sample.samples[{i}]: {len(images)} control images; {family} takes {spec.max_reference_images}: "
                 "the first are used")
            images = images[:spec.max_reference_images]
        if images:
            if spec.reference_images:
                prompt["reference_image"] = images[0] if len(images) == 1 else images
            else:
                skip(f"sample.samples[{i}].ctrl_img: {family} samples without reference images; left out")
        if prompt["seed"] < 0:
            skip(f"sample seed {prompt['seed']}: a random seed per sample is not supported; 42 is written")
            prompt["seed"] = 42
        if family not in UNETS:
            if prompt.pop("guidance_rescale", 0.0):
                skip(f"sample guidance_rescale: {family}'s pipeline does not take it")
            if family == "flux" and prompt.get("negative_prompt"):
                skip("sample neg: Flux.1 samples without a negative prompt")
                prompt["negative_prompt"] = ""
        elif not prompt.get("guidance_rescale"):
            prompt.pop("guidance_rescale", None)
        if not prompt["negative_prompt"]:
            del prompt["negative_prompt"]
        for key in ("network_multiplier", "num_frames", "fps", "ctrl_idx", "do_cfg_norm"):
            if item.get(key) not in (None, 1, 1.0, 0, False):
                skip(f"sample.samples[{i}].{key}: {item[key]!r} has no ot_dist counterpart")
        if spec.sample_reference_required and "reference_image" not in prompt:
            skip(f"sample.samples[{i}]: {family} samples only with a control image (ctrl_img); left out")
            continue
        prompts.append(prompt)
    if not prompts:
        return
    sampling = {"prompts": prompts, "every_n_steps": sample.number("sample_every", 100, int)}
    name = str(sample.get("sampler", "ddpm"))
    if family in UNETS:
        if name in SAMPLERS:
            sampling["sampler"] = SAMPLERS[name]
        else:
            skip(f"sample.sampler: {name} has no ot_dist counterpart; ddim is written")
    for key in ("network_multiplier", "num_frames"):
        if sample.get(key) not in (None, 1, 1.0):
            skip(f"sample.{key}: {sample.get(key)!r} has no ot_dist counterpart")
    for key in ("fps", "format", "do_cfg_norm", "refiner_start_at", "adapter_conditioning_scale", "extra_values"):
        sample.get(key)
    if not sample.get("skip_first_sample", False):
        out.notes.append("sample: ai-toolkit also samples before the first step; ot_dist samples at sample_every "
                         "and at the end")
    c["sampling"] = sampling


def _prompt_flags(text: str, i: int, out: Imported) -> tuple[str, dict]:
    """A prompt's `--flag value` words, split at `--` as GenerateImageConfig does."""
    parts = text.strip().split("--")
    flags = {}
    for part in parts[1:]:
        flag = part.split(" ")[0].strip()
        value = part[len(flag):].strip()
        if flag not in PROMPT_FLAGS:
            out.not_honoured.append(f"sample prompt {i}: --{flag} {value} has no ot_dist counterpart")
            continue
        key, kind = PROMPT_FLAGS[flag]
        try:
            flags[key] = kind(value)
        except ValueError:
            raise ConfigError(f"config.process[0].sample prompt {i}: --{flag} {value!r} is not a {kind.__name__}") \
                from None
    return parts[0].strip(), flags
