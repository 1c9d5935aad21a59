"""OneTrainer's sample prompts (inline or in their sample definition file), each with its sampler and guidance
rescale, their interval and its non-EMA samples as ot_dist's `sampling` section."""

from __future__ import annotations

from pathlib import Path

from ot_dist.errors import InputFileError
from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import Imported, local_path, read_json
from ot_dist.models.families.registry import get_family

# The families whose OneTrainer sampler builds the sample's noise_scheduler (create_noise_scheduler in its
# StableDiffusion*, StableDiffusionXL* and PixArtAlpha samplers); the others sample with their model's own scheduler.
SAMPLERS_FROM_NOISE_SCHEDULER = ("sd1", "sd2", "sdxl", "pixart_alpha", "pixart_sigma")
NOISE_SCHEDULERS = {"DDIM": "ddim", "EULER": "euler", "EULER_A": "euler_a", "DPMPP": "dpmpp_2m", "DPMPP_SDE": "dpmpp_sde",
                    "UNIPC": "unipc", "EULER_KARRAS": "euler_karras", "DPMPP_KARRAS": "dpmpp_2m_karras",
                    "DPMPP_SDE_KARRAS": "dpmpp_sde_karras", "UNIPC_KARRAS": "unipc_karras"}
# The families whose OneTrainer sampler rescales the guidance (cfg_rescale: 0.7 with
# rescale_noise_scheduler_to_zero_terminal_snr, else 0; StableDiffusionSampler, StableDiffusionXLSampler).
CFG_RESCALE_FAMILIES = ("sd1", "sd2", "sdxl")
# The grid OneTrainer's samplers round a sample's width and height to (round(side / q) x q, their
# quantize_resolution calls in modules/modelSampler/*Sampler.py): the size OneTrainer actually samples.
SAMPLE_QUANTIZATION = {"sd1": 8, "sd2": 8, "sdxl": 64, "sd3": 16, "flux": 64, "chroma": 64, "pixart_alpha": 16,
                       "pixart_sigma": 16, "stable_cascade": 128, "wuerstchen_v2": 128,
                       "sana": 32, "qwen_image": 64, "z_image": 64, "hidream": 64,
                       # Flux2Sampler rounds nothing: sides off FLUX.2's 16 px grid fail there, ot_dist takes 16
                       "flux2": 16, "flux2_klein": 16}
SAMPLE_QUANTIZATION["krea2"] = 64  # Krea2Sampler's quantize_resolution(side, 64)
SAMPLE_QUANTIZATION["ernie_image"] = 16  # ErnieSampler rounds nothing either: ERNIE-Image's 16 px grid
SAMPLE_QUANTIZATION["anima"] = 64  # AnimaSampler
SAMPLE_QUANTIZATION["ideogram4"] = 64  # IdeogramSampler: quantize_resolution(side, 64)
SAMPLE_QUANTIZATION["hunyuan_video"] = 64  # HunyuanVideoSampler


def import_samples(ot: dict, c: dict, config_path: Path, samples_path: str | None, out: Imported) -> None:
    samples = ot["samples"]
    if samples is None or samples_path:  # --samples wins over samples stored in the config
        file = Path(samples_path or local_path(ot["sample_definition_file_name"], "sample_definition_file_name", out))
        if not file.is_absolute() and not file.exists():
            file = config_path.parent / file
        if not file.exists():
            if samples_path:
                raise InputFileError(f"--samples: {file} does not exist")
            return  # OneTrainer's default samples file is optional too
        samples = read_json(file, "--samples" if samples_path else "sample_definition_file_name")
    family = c["model"]["family"]
    prompts = []
    for i, sample in enumerate(samples):
        sample = {**defaults.SAMPLE, **defaults.SAMPLE_BY_FAMILY.get(family, {}), **sample}
        if not sample["enabled"]:
            continue
        if not sample["prompt"].strip():
            out.not_honoured.append(f"samples[{i}]: an empty prompt is not sampled by ot_dist")
            continue
        if sample["random_seed"]:
            out.not_honoured.append(f"samples[{i}].random_seed: true: ot_dist samples with a fixed seed "
                                    f"({sample['seed']}), the same image for the same weights")
        if sample["sample_inpainting"]:
            out.not_honoured.append(f"samples[{i}].sample_inpainting: true: ot_dist samples an inpainting model "
                                    "repainting the whole image (OneTrainer's samples without a base image and mask)")
        width, height = (_quantized(sample[key], family, f"samples[{i}].{key}", out) for key in ("width", "height"))
        negative = sample["negative_prompt"] or ""
        if negative and not get_family(family).sample_negative_prompt:
            out.not_honoured.append(f"samples[{i}].negative_prompt: {family} samples without classifier-free "
                                    "guidance; OneTrainer ignores it too")
            negative = ""
        prompt = {"prompt": sample["prompt"], "negative_prompt": negative, "seed": sample["seed"], "width": width,
                  "height": height, "steps": sample["diffusion_steps"], "guidance_scale": sample["cfg_scale"]}
        if family in SAMPLERS_FROM_NOISE_SCHEDULER:  # the others sample with their own scheduler only
            sampler = _sampler(str(sample["noise_scheduler"]), f"samples[{i}].noise_scheduler", out)
            prompt.update({"sampler": sampler} if sampler else {})
        if family in CFG_RESCALE_FAMILIES:
            prompt["guidance_rescale"] = 0.7 if ot["rescale_noise_scheduler_to_zero_terminal_snr"] else 0.0
        prompts.append(prompt)
    if not prompts:
        return
    sampling = {"prompts": prompts}
    if ot["ema"] != "OFF":  # OneTrainer samples the trained weights beside the EMA's unless non_ema_sampling is off
        sampling["non_ema_samples"] = bool(ot["non_ema_sampling"])
    unit, every = ot["sample_after_unit"], ot["sample_after"]
    if unit == "STEP":
        sampling["every_n_steps"] = every
    elif unit == "EPOCH":
        sampling["every_n_epochs"] = every
    elif unit != "NEVER":
        out.not_honoured.append(f"sample_after_unit: {unit} (ot_dist samples every N steps or epochs, and at the end)")
    if ot["sample_skip_first"] and unit != "NEVER":
        out.not_honoured.append(f"sample_skip_first: {ot['sample_skip_first']}: ot_dist samples from the first "
                                "interval on")
    c["sampling"] = {**c.get("sampling", {}), **sampling}


def _quantized(side: int, family: str, label: str, out: Imported) -> int:
    """A sample side as OneTrainer's sampler for the family rounds it (noted when that changes it)."""
    step = SAMPLE_QUANTIZATION[family]
    rounded = max(step, round(side / step) * step)
    if rounded != side:
        out.notes.append(f"{label}: {side} px, sampled at {rounded} px as OneTrainer's sampler rounds it (a multiple "
                         f"of {step} for {family})")
    return rounded


def _sampler(noise_scheduler: str, label: str, out: Imported) -> str | None:
    """OneTrainer's noise_scheduler of a sample as ot_dist's per-prompt sampler (None: not one ot_dist has)."""
    if noise_scheduler in NOISE_SCHEDULERS:
        return NOISE_SCHEDULERS[noise_scheduler]
    out.not_honoured.append(f"{label}: {noise_scheduler} is not an ot_dist sampler ({', '.join(NOISE_SCHEDULERS)}); "
                            "sampling.sampler samples it")
    return None
