"""OneTrainer's sample prompts (inline or in their sample definition file), their sampler and their interval as
ot_dist's `sampling` section."""

from __future__ import annotations

from pathlib import Path

from ot_dist.errors import InputFileError
from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import Imported, local_path, read_json
from ot_dist.models.families.registry import get_family

SAMPLERS_FROM_NOISE_SCHEDULER = ("sd1", "sd2", "sdxl", "pixart_alpha", "pixart_sigma")
NOISE_SCHEDULERS = {"DDIM": "ddim", "EULER": "euler", "EULER_A": "euler_a", "DPMPP": "dpmpp_2m", "UNIPC": "unipc"}
# The grid OneTrainer's samplers round a sample's width and height to (round(side / q) x q, their
# quantize_resolution calls in modules/modelSampler/*Sampler.py): the size OneTrainer actually samples.
SAMPLE_QUANTIZATION = {"sd1": 8, "sd2": 8, "sdxl": 64, "sd3": 16, "flux": 64, "chroma": 64, "pixart_alpha": 16,
                       "pixart_sigma": 16, "stable_cascade": 128, "wuerstchen_v2": 128}


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
    prompts, samplers = [], []
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
        width, height = (_quantized(sample[key], family, f"samples[{i}].{key}", out) for key in ("width", "height"))
        negative = sample["negative_prompt"] or ""
        if negative and not get_family(family).sample_negative_prompt:
            out.not_honoured.append(f"samples[{i}].negative_prompt: {family} samples without classifier-free "
                                    "guidance; OneTrainer ignores it too")
            negative = ""
        prompts.append({"prompt": sample["prompt"], "negative_prompt": negative,
                        "seed": sample["seed"], "width": width, "height": height,
                        "steps": sample["diffusion_steps"], "guidance_scale": sample["cfg_scale"]})
        samplers.append(str(sample["noise_scheduler"]))
    if prompts and family in SAMPLERS_FROM_NOISE_SCHEDULER:  # the others sample with their own scheduler only
        _sampler(samplers, c, out)
    if not prompts:
        return
    sampling = {"prompts": prompts}
    unit, every = ot["sample_after_unit"], ot["sample_after"]
    if unit == "STEP":
        sampling["every_n_steps"] = every
    elif unit == "EPOCH":
        sampling["every_n_epochs"] = every
    elif unit != "NEVER":
        out.not_honoured.append(f"sample_after_unit: {unit} (ot_dist samples every N steps or epochs, and at the end)")
    c["sampling"] = {**c.get("sampling", {}), **sampling}


def _quantized(side: int, family: str, label: str, out: Imported) -> int:
    """A sample side as OneTrainer's sampler for the family rounds it (noted when that changes it)."""
    step = SAMPLE_QUANTIZATION[family]
    rounded = max(step, round(side / step) * step)
    if rounded != side:
        out.notes.append(f"{label}: {side} px, sampled at {rounded} px as OneTrainer's sampler rounds it (a multiple "
                         f"of {step} for {family})")
    return rounded


def _sampler(samplers: list[str], c: dict, out: Imported) -> None:
    """OneTrainer's per-sample noise_scheduler; ot_dist has one sampling.sampler (the first sample's)."""
    first = samplers[0]
    if first in NOISE_SCHEDULERS:
        c["sampling"] = {"sampler": NOISE_SCHEDULERS[first]}
    else:
        out.not_honoured.append(f"samples[].noise_scheduler: {first} is not an ot_dist sampler (ddim, euler, euler_a, "
                                "dpmpp_2m, unipc); the model's own scheduler samples")
    if len(set(samplers)) > 1:
        out.not_honoured.append(f"samples[].noise_scheduler: {', '.join(sorted(set(samplers)))}: ot_dist samples every "
                                f"prompt with one sampler, the first's ({first})")
