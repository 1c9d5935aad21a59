"""SimpleTuner's validation images (validation_prompt and the user_prompt_library JSON, `{"shortname": "prompt"}` or
`{"shortname": {"prompt": ...}}`, each at every validation_resolution: `1024`, `1024x768` or several comma-separated;
validation_guidance, validation_num_inference_steps, validation_negative_prompt, validation_seed,
validation_guidance_rescale, every validation_step_interval steps / validation_epoch_interval epochs) as ot_dist's
`sampling` section."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import Imported, read_json
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs

SAMPLERS = {"ddim": "ddim", "euler": "euler", "euler-a": "euler_a", "unipc": "unipc", "dpm++": "dpmpp_2m"}
GRID_16 = ("sd3", "flux", "chroma", "pixart_sigma")
UNUSED_WITHOUT_PROMPTS = ("validation_resolution", "validation_seed", "validation_num_inference_steps",
                          "validation_guidance", "validation_negative_prompt", "validation_guidance_rescale",
                          "validation_step_interval", "validation_epoch_interval", "validation_noise_scheduler",
                          "validation_guidance_real", "num_validation_images", "ema_validation")
EMA_VALIDATION = {"comparison": (True, True), "ema_only": (True, False), "none": (False, False)}


def import_samples(args: SimpleTunerArgs, c: dict, library_file: str | None, out: Imported) -> None:
    skip = out.not_honoured.append
    family = c["model"]["family"]
    texts = _prompts(args, library_file, out)
    if args["validation_disable"] or not texts:
        for key in UNUSED_WITHOUT_PROMPTS:
            args[key]  # SimpleTuner validates nothing either
        return
    sizes = [_size(value.strip(), family) for value in str(args["validation_resolution"]).split(",")]
    seed = args["validation_seed"] if args["validation_seed"] is not None else args["seed"]
    common = {"steps": int(args["validation_num_inference_steps"]),
              "guidance_scale": float(args["validation_guidance"])}
    if seed is not None:
        common["seed"] = int(seed)
    else:
        out.notes.append("validation_seed / seed: not set (SimpleTuner draws one); the samples use seed 42")
    if family == "flux":  # SimpleTuner's Flux uses the negative prompt only with true CFG (validation_guidance_real)
        if args["validation_guidance_real"] > 1.0:
            skip(f"validation_guidance_real: {args['validation_guidance_real']}: true classifier-free guidance on "
                 "Flux is not supported")
    elif args["validation_negative_prompt"]:
        common["negative_prompt"] = str(args["validation_negative_prompt"])
    if args["validation_guidance_rescale"]:
        common["guidance_rescale"] = float(args["validation_guidance_rescale"])
    prompts = []
    for label, text in texts:
        for width, height in sizes:
            out.origins[f"sampling.prompts[{len(prompts)}]"] = label
            prompts.append({"prompt": text, "width": width, "height": height, **common})
    sampling = {"prompts": prompts}
    if args["validation_epoch_interval"]:
        sampling["every_n_epochs"] = int(args["validation_epoch_interval"])
    if args["validation_step_interval"]:
        sampling["every_n_steps"] = int(args["validation_step_interval"])
    scheduler = args["validation_noise_scheduler"]
    if scheduler in SAMPLERS:
        sampling["sampler"] = SAMPLERS[scheduler]
    elif scheduler:
        skip(f"validation_noise_scheduler: {scheduler} is not an ot_dist sampler; the family's is used")
    if c.get("ema", {}).get("enabled"):
        use_ema, both = EMA_VALIDATION.get(args["ema_validation"], (True, True))
        sampling |= {"use_ema": use_ema, "non_ema_samples": both}
    if int(args["num_validation_images"]) > 1:
        skip(f"num_validation_images: {args['num_validation_images']}: ot_dist samples one image per prompt and size")
    c["sampling"] = sampling


def _prompts(args: SimpleTunerArgs, library_file: str | None, out: Imported) -> list[tuple[str, str]]:
    texts = []
    if args["validation_prompt"]:
        texts.append(("validation_prompt", str(args["validation_prompt"])))
    path = args.file(library_file, "user_prompt_library", out)
    if path is not None:
        library = read_json(path, "user_prompt_library")
        if not isinstance(library, dict):
            raise ConfigError(f"user_prompt_library: {path} is not an object of shortname -> prompt")
        for name, entry in library.items():
            label = f"user_prompt_library[{name}]"
            if isinstance(entry, dict):
                for key in entry:
                    if key != "prompt" and entry[key] is not None:
                        out.not_honoured.append(f"{label}.{key}: not an option ot_dist samples with")
                entry = entry.get("prompt")
            if not entry:
                raise ConfigError(f"{label}: has no prompt")
            texts.append((label, str(entry)))
    if args["validation_prompt_library"]:
        out.not_honoured.append("validation_prompt_library: SimpleTuner's built-in prompt library is not imported")
    return texts


def _size(value: str, family: str) -> tuple[int, int]:
    """parse_validation_resolution: `N` (a square) or `WxH`, floored to the family's pixel grid."""
    grid = 16 if family in GRID_16 else 8
    parts = value.lower().split("x")
    if not all(p.strip().isdigit() for p in parts) or len(parts) > 2:
        raise ConfigError(f"validation_resolution: {value!r} is not N or WxH")
    width, height = int(parts[0]), int(parts[-1])
    return max(grid, width - width % grid), max(grid, height - height % grid)
