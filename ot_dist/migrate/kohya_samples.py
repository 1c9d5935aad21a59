"""kohya's sample prompts (--sample_prompts: a .txt of prompt lines with `--n` negative prompt, `--w` / `--h` size,
`--s` steps, `--l` CFG scale, `--d` seed, `--g` Flux's distilled guidance, `--ss` sampler; or a .toml / .json of the
same keys) and their interval (sample_every_n_steps / _epochs, sample_sampler) as ot_dist's `sampling` section.

kohya's defaults for what a prompt leaves out: 512 x 512, a random seed, and 30 steps at CFG 7.5 (SD 1.x / 2.x,
SDXL, SD3) or 20 steps at distilled guidance 3.5 (Flux), Lumina: 1024 x 1024, 36 steps at CFG 3.5; sizes are floored
to a multiple of 8 (Flux, Lumina: 16, as their patches need), at least 64.
kohya samples only at its intervals (sample_every_n_epochs wins over _steps), not at the end."""

from __future__ import annotations

import re
from pathlib import Path

from ot_dist.errors import InputFileError
from ot_dist.migrate.common import Imported, local_path, read_json, read_toml
from ot_dist.migrate.kohya_args import KohyaArgs

# One `--x value` option of a prompt line (train_util.line_to_prompt_dict: the line split at " --").
OPTIONS = {"w": "width", "h": "height", "d": "seed", "s": "sample_steps", "l": "scale", "g": "guidance_scale",
           "n": "negative_prompt", "ss": "sample_sampler"}
NUMBERS = {"width": int, "height": int, "seed": int, "sample_steps": int, "scale": float, "guidance_scale": float}
FLOW_SAMPLERS = ("flux", "chroma", "sd3", "lumina2")  # kohya samples these with its own flow-matching Euler
SAMPLERS = {"ddim": "ddim", "euler": "euler", "k_euler": "euler", "euler_a": "euler_a", "k_euler_a": "euler_a",
            "dpmsolver++": "dpmpp_2m"}


def parse_prompt_line(line: str) -> dict:
    """A kohya prompt line as a dict of its keys (kohya's names): the text before the first ` --` is the prompt."""
    parts = line.split(" --")
    prompt = {"prompt": parts[0].strip()}
    for part in parts[1:]:
        match = re.match(r"(ss|[a-z]+)\s+(.+)", part.strip(), re.IGNORECASE)
        if not match or match.group(1).lower() not in OPTIONS:
            prompt.setdefault("unknown", []).append("--" + part.strip())
            continue
        key = OPTIONS[match.group(1).lower()]
        value = match.group(2).strip()
        try:
            prompt[key] = NUMBERS[key](value) if key in NUMBERS else value
        except ValueError:
            prompt.setdefault("unknown", []).append("--" + part.strip())
    return prompt


def read_prompts(path: Path) -> list[dict]:
    """kohya's load_prompts: .txt lines (blank and `#` lines skipped), a .toml [prompt] with its [[prompt.subset]]s,
    or a .json list of dicts or lines."""
    if path.suffix == ".toml":
        table = read_toml(path, "sample_prompts").get("prompt", {})
        common = {k: v for k, v in table.items() if k != "subset"}
        return [{**common, **subset} for subset in table.get("subset", [])]
    if path.suffix == ".json":
        return [parse_prompt_line(p) if isinstance(p, str) else p for p in read_json(path, "sample_prompts")]
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputFileError(f"sample_prompts: {path} does not exist") from None
    return [parse_prompt_line(line.strip()) for line in lines if line.strip() and not line.startswith("#")]


def import_samples(args: KohyaArgs, c: dict, prompts_path: str | None, out: Imported) -> None:
    skip = out.not_honoured.append
    path = args["sample_prompts"]  # read either way: an option given here wins over it
    path = prompts_path or path
    family = c["model"]["family"]
    every_steps, every_epochs, sampler = args["sample_every_n_steps"], args["sample_every_n_epochs"], args["sample_sampler"]
    if args["sample_at_first"]:
        skip("sample_at_first: ot_dist samples at its intervals and at the end, not before the first step")
    if not path:
        return
    prompts = []
    for i, raw in enumerate(read_prompts(Path(local_path(str(path), "sample_prompts", out)))):
        prompt = _prompt(raw, family, f"sample_prompts[{i}]", out)
        if prompt:
            out.origins[f"sampling.prompts[{len(prompts)}]"] = f"sample_prompts[{i}] ({raw['prompt'][:40]!r})"
            prompts.append(prompt)
    if not prompts:
        return
    sampling = {"prompts": prompts, "at_end": False}  # kohya samples at its intervals only
    if every_epochs:
        sampling["every_n_epochs"] = every_epochs  # kohya: the epochs win over the steps
    elif every_steps:
        sampling["every_n_steps"] = every_steps
    if family == "lumina2":  # lumina_train_util's denoise: CFG while Lumina's t (0: noise) < cfg_trunc_ratio 0.25
        skip("sample prompts: kohya's Lumina sampler applies CFG only while Lumina's time is below cfg_trunc_ratio "
             "0.25 (the noisiest quarter), its norm capped by renorm_cfg; ot_dist samples as Lumina2Pipeline (CFG at "
             "every step)")
    if family in FLOW_SAMPLERS:
        if args.given("sample_sampler"):
            out.notes.append(f"sample_sampler: {sampler}: kohya's {family} samples with its own flow-matching Euler "
                             "sampler, as ot_dist's flow_euler")
    elif sampler in SAMPLERS:
        sampling["sampler"] = SAMPLERS[sampler]
    else:
        skip(f"sample_sampler: {sampler} is not an ot_dist sampler (ddim, euler, euler_a, dpmsolver++ as dpmpp_2m); "
             "ddim is used")
    for i, prompt in enumerate(prompts):  # a prompt's own --ss: its `sampler`
        own = prompt.pop("_sampler", None)
        if own is None:
            continue
        if family in FLOW_SAMPLERS:
            out.notes.append(f"sampling.prompts[{i}] --ss {own}: kohya's {family} samples with its flow-matching "
                             "Euler sampler, as ot_dist's flow_euler")
        elif own in SAMPLERS:
            prompt["sampler"] = SAMPLERS[own]
        else:
            skip(f"sampling.prompts[{i}] --ss {own} is not an ot_dist sampler; the run's sampler is used")
    c["sampling"] = sampling


def _prompt(raw: dict, family: str, label: str, out: Imported) -> dict | None:
    skip = out.not_honoured.append
    if not str(raw.get("prompt", "")).strip():
        skip(f"{label}: an empty prompt is not sampled by ot_dist")
        return None
    flux = family == "flux"
    grid = 16 if family in ("flux", "chroma", "lumina2") else 8
    size = 1024 if family == "lumina2" else 512
    width, height = (max(64, int(raw.get(k, size)) - int(raw.get(k, size)) % grid) for k in ("width", "height"))
    steps = {"flux": 20, "chroma": 20, "lumina2": 36}.get(family, 30)
    prompt = {"prompt": str(raw["prompt"]), "width": width, "height": height,
              "steps": int(raw.get("sample_steps", steps))}
    if flux:  # Flux: --g is the distilled guidance ot_dist's guidance_scale is; kohya's true CFG --l stays 1
        prompt["guidance_scale"] = float(raw.get("guidance_scale", 3.5))
        if float(raw.get("scale", 1.0)) != 1.0:
            skip(f"{label} --l {raw['scale']}: true classifier-free guidance on Flux is not supported")
    elif family == "chroma":  # kohya's Flux sampler: true CFG --l (default 1.0), as ChromaPipeline's guidance_scale
        prompt["guidance_scale"] = float(raw.get("scale", 1.0))
    else:
        prompt["guidance_scale"] = float(raw.get("scale", 3.5 if family == "lumina2" else 7.5))
    if raw.get("negative_prompt"):
        if flux:
            skip(f"{label} --n: Flux samples without a negative prompt in ot_dist")
        else:
            prompt["negative_prompt"] = str(raw["negative_prompt"])
    if raw.get("seed") is not None:
        prompt["seed"] = int(raw["seed"])
    else:
        out.notes.append(f"{label}: no --d seed (kohya draws one each time); ot_dist samples with seed 42")
    if raw.get("sample_sampler"):
        prompt["_sampler"] = str(raw["sample_sampler"]).lower()
    for option in raw.get("unknown", []) + [f"{k}" for k in raw if k not in (*OPTIONS.values(), "prompt", "unknown")]:
        skip(f"{label} {option}: not an option ot_dist samples with")
    return prompt
