"""The transformer families under every strategy: 2 gloo ranks (batch 2 each) against 1 process (batch 4),
full finetune and LoRA, with plain SGD and no clipping, so a gradient that is summed instead of averaged
(or averaged twice) moves the weights by twice (half) the step and fails the comparison. All cases of a
family run in one launch (tests/helpers/family_cases.py) to pay the process start-up once. SD3 and Stable Cascade
add bfloat16 cases to their launch (BFLOAT16_CASES); SD 1.x runs every strategy in bfloat16 and float16."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config, with_reference_images as with_references
from safetensors.torch import load_file

from ot_dist.config.load import apply_override, validate
from ot_dist.models.families.registry import get_family
from ot_dist.models.tiny import make_tiny_model
from ot_dist.precision import DTYPES
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
sys.path.insert(0, str(REPO / "tests" / "helpers"))  # what the launched ranks use too
from block_casts_record import OWN_DOWN_PROJECTIONS, PER_LAYER_CASTS  # noqa: E402
from denoiser_inputs import record_denoiser_inputs  # noqa: E402
from overflow import inject  # noqa: E402
# Plain SGD (no momentum) keeps no state, so what a third step could show a second shows already: the strategy's own
# state carried from one step to the next (ZeRO-3's recorded trace and prefetch, ZeRO-1/2's deferred gradient
# cleanup, FSDP's resharded units). The low-precision cases take 3: a float16 step after the skipped one.
STEPS = 2
LOW_PRECISION_STEPS = 3
TOLERANCE = 1e-5
FAMILIES = ["sd1", "sd3", "flux", "pixart_alpha"]
STRATEGIES = {"ddp": {}, "fsdp": {"gradient_checkpointing": True}, "zero1": {}, "zero2": {},
              "zero3": {"gradient_checkpointing": True}}
# Gradient accumulation (batch 1 x 2 micro steps x 2 ranks) must average, not sum, the micro steps too. (zero3:
# DeepSpeed counts its micro steps when its engine is called; uncalled, each micro step's gradients replaced the last's.)
ACCUMULATION = {"ddp", "fsdp", "zero2", "zero3"}
# fsdp's accumulation reduce-scatters at the last micro step only (sd1, flux) or after every micro step, the ranks
# accumulating their shards (fsdp.reduce_every_micro_step: sd3, pixart_alpha)
ACCUMULATION_SETTINGS = {("fsdp", "sd3"): {"fsdp.reduce_every_micro_step": True},
                         ("fsdp", "pixart_alpha"): {"fsdp.reduce_every_micro_step": True}}
# Families checked under some strategies only (the others' cases cover the strategy code itself); PixArt-α:
# its VB term and micro-conditioning under fsdp and zero2; Stable Cascade: its prior's nested block lists as
# sharding units and its continuous-time objective under fsdp and zero2; Würstchen v2: its prior's flat block list
# and scaled time / latents under fsdp and zero2.
FAMILY_STRATEGIES = {"pixart_alpha": ("fsdp", "zero2"), "stable_cascade": ("fsdp", "zero2"),
                     "wuerstchen_v2": ("fsdp", "zero2"),
                     # Sana: its Gemma mask, DC-AE latents and raw-t flow under fsdp and zero2 (zero2's two cases:
                     # +1.4 and +2.1 CPU s on the pixart_alpha launch, two before / after pairs)
                     "sana": ("fsdp", "zero2")}
# Qwen-Image: its one-frame VAE, packed latents and trimmed text mask under fsdp (units: transformer_blocks)
FAMILY_STRATEGIES["qwen_image"] = ("fsdp",)
# Families whose cases ride in another family's launch (no process start-up of their own), without the
# accumulation cases.
RIDERS = {"pixart_alpha": ("stable_cascade", "wuerstchen_v2", "sana")}
RIDERS["flux"] = ("qwen_image",)
# Lumina 2: its system-prompted Gemma with the mask, the reversed flow (1 - s in, output negated) and its three block
# lists (context / noise refiners, joint layers) as units under fsdp and zero2, in PixArt-α's launch
FAMILY_STRATEGIES["lumina2"] = ("fsdp", "zero2")
RIDERS["pixart_alpha"] += ("lumina2",)
# Z-Image: the per-caption cut of Qwen3's hidden states, one-frame list inputs and the negated output under fsdp (units:
# layers, noise_refiner, context_refiner) and zero2, riding in Flux's launch (CPU s of that launch: 30.7 without
# Z-Image, 33.5 with fsdp, 35.1 with fsdp and zero2)
FAMILY_STRATEGIES["z_image"] = ("fsdp", "zero2")
RIDERS["flux"] += ("z_image",)
# FLUX.2 [dev]: its batch-norm-normalised patchified latents, stacked Mistral-3 layers and guidance input under fsdp
# (units: its double and single blocks) and zero2, riding in SD3's launch (CPU s of that launch, two before / after
# pairs: 28.7 -> 32.1, 27.1 -> 32.1)
FAMILY_STRATEGIES["flux2"] = ("fsdp", "zero2")
RIDERS["sd3"] = ("flux2",)
# HiDream-I1: its mixture of experts (data-dependent routing per rank, the gate's rows and each expert sharded) trained
# through the differentiable branch, four text encoders, the negated output, under fsdp and zero2, riding in PixArt-α's
# launch (+5 to 6 CPU s on it: 29.5 / 28.6 before, 33.9 / 34.3 / 34.9 after)
FAMILY_STRATEGIES["hidream"] = ("fsdp", "zero2")
RIDERS["pixart_alpha"] += ("hidream",)
# Flux.1 Kontext: its reference tokens (ids (1, row, col)) and the prediction read from the target's tokens under fsdp
# and zero2 (+3.5 CPU s on the flux launch for both, zero2's cases +0.3 of it);
# an edit model trains on pairs, so its runs read the shapes with a reference image each (conftest.py).
FAMILY_STRATEGIES["flux_kontext"] = ("fsdp", "zero2")
RIDERS["flux"] += ("flux_kontext",)
# Qwen-Image-Edit: its reference latents beside the noisy ones (img_shapes listing both) and the reference through
# Qwen2.5-VL's vision tower in the text (the processor per batch) under fsdp, riding in Flux's launch.
FAMILY_STRATEGIES["qwen_image_edit"] = ("fsdp",)
RIDERS["flux"] += ("qwen_image_edit",)
# Qwen-Image-Edit-2509 (one reference: "Picture 1: ", the vision copy at 384^2) under fsdp, in the same launch
FAMILY_STRATEGIES["qwen_image_edit_plus"] = ("fsdp",)
RIDERS["flux"] += ("qwen_image_edit_plus",)
# Wan 2.1: UMT5 with zeroed padding, the 5-D one-frame latents with per-channel mean / std and the raw-t flow under fsdp
# (units: blocks), riding in PixArt-α's launch
FAMILY_STRATEGIES["wan"] = ("fsdp",)
RIDERS["pixart_alpha"] += ("wan",)
# Krea 2: the stacked Qwen3-VL taps with real tokens moved to the front and the text stream trimmed per batch, packed
# one-frame latents and position ids under fsdp (units: transformer blocks, text-fusion blocks) and zero2, riding in
# Flux's launch (CPU s of that launch, fsdp alone, two before / after pairs: 45.5 -> 48.6, 43.6 -> 47.2; zero2's cases
# +1.6 after the merge with main: 46.3 -> 47.9)
FAMILY_STRATEGIES["krea2"] = ("fsdp", "zero2")
RIDERS["flux"] += ("krea2",)
# ERNIE-Image: its masked caption lengths (text_lens), batch-norm-normalised patchified latents and raw-t flow under fsdp
# (units: layers) and zero2, riding in SD3's launch (CPU s of that launch: 34.7 -> 37.1)
FAMILY_STRATEGIES["ernie_image"] = ("fsdp", "zero2")
RIDERS["sd3"] += ("ernie_image",)
# Anima: Qwen3 through its LLM adapter (a second text part, frozen here), the 5-D one-frame latents with per-channel mean
# / std, t = s in and the zero padding mask under fsdp (units: transformer_blocks) and zero2, riding in SD3's launch
# (CPU s of that launch: 34.6 without Anima, 36.2 and 36.9 with it)
FAMILY_STRATEGIES["anima"] = ("fsdp", "zero2")
RIDERS["sd3"] += ("anima",)
# Ideogram 4: its packed [left padding][caption][image] sequence (packed to each rank's longest caption), Qwen3-VL's
# tapped layers, t = 1 - sigma and the negated output under fsdp (units: layers) and zero2, riding in PixArt-α's launch
# (CPU s of that launch on a shared machine: 41.8 without Ideogram 4, 44.9 with fsdp, 42.6 / 43.0 with fsdp and zero2)
FAMILY_STRATEGIES["ideogram4"] = ("fsdp", "zero2")
RIDERS["pixart_alpha"] += ("ideogram4",)
# HunyuanVideo: Llava-Llama-3's cropped template states with their mask, CLIP-L's pooled output, the guidance input and
# the 5-D one-frame latents under fsdp (units: transformer_blocks, single_transformer_blocks) and zero2, in PixArt-α's
# launch (CPU s of that launch: 41.2 before, 44.6 with fsdp, 44.1 with fsdp and zero2)
FAMILY_STRATEGIES["hunyuan_video"] = ("fsdp", "zero2")
RIDERS["pixart_alpha"] += ("hunyuan_video",)
# FLUX.2 [dev] as an edit model (the concepts with reference_path): its reference tokens (ids (10, row, col, 0)) and the
# prediction read from the target's tokens, a full finetune under fsdp beside its text-to-image cases in SD3's launch
EDITED = {"family": "flux2", "launch": "sd3", "strategies": ("fsdp",)}
# Flux.1 Fill [dev] (flux with model.inpainting, a 384-channel transformer): its condition (the masked image's latent
# beside the 8x8-folded mask; the shapes have no masks, so every mask is a random draw keyed by sample id, the same on
# any rank) packed with the noisy tokens, a full finetune under fsdp in Flux's launch
INPAINTED = {"family": "flux", "strategies": ("fsdp",)}
# SD 2.0 depth (sd2 with a 5-channel UNet): each rank's images' depth maps from the frozen DPT estimator (placed like
# the VAE) beside the noisy latent, a full finetune under fsdp in Flux's launch
DEPTHED = {"family": "sd2", "launch": "flux", "strategies": ("fsdp",)}
# optimizer.fused_back_pass under ddp (parallel/fused_reduce.py: each gradient averaged and its parameter stepped inside
# backward), a full finetune against the plain one process (with plain SGD the fused back pass is the same update): SD
# 1.x with its text encoder (two modules, one shared issue order), Flux with half its blocks' trained weights streamed
# (each stepped on its device copy once averaged), HiDream with its routed experts (a rank may not reach one), each in
# its family's launch.
FUSED = {"sd1": {}, "flux": {"transformer.offload_fraction": 0.5, "gradient_checkpointing": True}, "hidream": {}}
# and SD 1.x's fused back pass with accumulation (batch 1 x 2 micro steps x 2 ranks: the first micro step's gradients
# accumulate unreduced, the last one's backward averages and steps) and each gradient clipped by its own norm (OneTrainer's
# fused clipping, clip_grad_norm_scope per_tensor, after the average), against one process of batch 4 with the same
# clipping: a gradient clipped before its average, or a micro step stepped alone, fails the comparison
FUSED_CLIPPED = {"family": "sd1", "settings": {"optimizer.fused_back_pass": True, "clip_grad_norm": 0.2,
                                              "clip_grad_norm_scope": "per_tensor"}}
# whole EfficientNet latents: sides of 128 px
FAMILY_SETTINGS = {"stable_cascade": {"resolution": 128}, "wuerstchen_v2": {"resolution": 128}}
# Würstchen v2's tiny prior starts with a small output conv (its build_tiny), so its LoRA gradients are small: a
# larger step moves the LoRA weights well beyond the tolerance.
FAMILY_METHOD_SETTINGS = {("wuerstchen_v2", "lora"): {"learning_rate": 10.0}}
METHODS = {"full": {"learning_rate": 0.05}, "lora": {"learning_rate": 0.5, "lora.rank": 4, "lora.alpha": 8}}
# SD 1.x's LoRA cases train an additional embedding too (pivotal tuning), bundled into lora.safetensors so that the
# comparison covers its vectors under every strategy: rows appended to the text encoder's token embedding, which
# ZeRO-3 partitions with the encoder and gathers for the forward and the export. Its token is in every caption.
# Under zero3 the rows are also gathered for the EMA and the samples: that case (and the one process) keeps an EMA and
# samples its weights at the end, both compared too (lora_ema.safetensors; the image within one level, as
# tests/test_sampling.py allows another process's float rounding). Neither changes what trains.
PIVOTAL = {"family": "sd1", "token": "<tok>", "vectors": 2}
BUNDLED = f"bundle_emb.{PIVOTAL['token']}.string_to_param.*"
# PixArt-α's LoRA cases (fsdp, zero2) carry the same embedding in its T5 (rows after the tokenizer's vocabulary in
# the T5's root unit, gradients through the whole T5): bundled as `t5` and ComfyUI's copy `t5xxl`, compared too.
# Its rows' gradients through the tiny T5 are small: at the LoRA's rate they moved 9.4e-4 in two steps, under the
# 100 x TOLERANCE that shows the comparison can fail, so they take a rate of their own.
PIVOTAL_T5 = {"family": "pixart_alpha", "bundled": f"bundle_emb.{PIVOTAL['token']}.t5", "learning_rate": 50.0}
PIVOTAL_KEYS = {PIVOTAL["family"]: BUNDLED, PIVOTAL_T5["family"]: PIVOTAL_T5["bundled"]}
PIVOTAL_GATHERED = {"strategy": "zero3", "settings": {
    "ema.enabled": True, "ema.decay": 0.5, "ema.update_step_interval": 1,
    "sampling.prompts": [{"prompt": f"{PIVOTAL['token']}, a circle", "seed": 1, "steps": 2, "width": 64, "height": 64}]}}
# SD 1.x's full finetunes (and their accumulation and clipped cases) train its text encoder too: two trained modules under every
# strategy (FSDP shards both, DeepSpeed's container holds both), compared on both exports. (tests/test_strategies.py
# relies on these cases for the plain strategies and keeps only the variants: sharding modes, offload.)
TEXT_ENCODER_TRAINED = {"sd1"}
# Gradient clipping that bites (the tiny models' gradient norms are far above it), with SGD: a norm computed over
# one rank's shards only, or summed over replicas, scales the step and fails the comparison. SD 1.x only: the
# strategies' clipping code knows no family.
CLIPPED = {"family": "sd1", "clip_grad_norm": 0.2, "strategies": ("ddp", "fsdp", "zero2", "zero3")}
# loss.scaler GLOBAL_BOTH (OneTrainer's loss_scaler) multiplies the loss by the global batch: batch 1 x 2 micro steps x 2
# ranks against one process of batch 4, both x 4, with SGD (a factor counted per rank, or without the accumulation,
# scales the step and fails the comparison). SD 1.x only: the trainer applies it, the strategies know nothing of it.
SCALED = {"family": "sd1", "loss.scaler": "GLOBAL_BOTH", "strategies": ("ddp", "fsdp", "zero2")}
# Families whose denoiser takes a float32 input that bfloat16 would round, changing the prediction: SD3's timestep
# (near 1000, to a multiple of 4), Stable Cascade's timestep ratio (its sinusoidal embedding scales it by 10000). Each
# adds full finetunes in bfloat16 to its family's launch, against one process in bfloat16: the denoiser must receive
# its inputs in the dtypes (and under the autocast) the one process gives it, and the weights must end within
# BFLOAT16_NOISE x the distance between the one process's bfloat16 and float32 runs. fsdp: with FSDP2's default cast
# of the root's inputs to bfloat16 they ended 5.8x (SD3) and 33x (Stable Cascade) that noise away; without it 0.53x
# and 0.35x. zero2: in DeepSpeed's bf16 engine (deepspeed.mixed_precision: engine; weights, and so the ratio, in
# bfloat16) Stable Cascade ended 31x away; under autocast over float32 weights, the default, 0.46x.
BFLOAT16_CASES = {"sd3": ("fsdp",), "stable_cascade": ("fsdp", "zero2")}
BFLOAT16_NOISE = 2


def settings(family: str, method: str, **extra) -> dict:
    return {"max_steps": STEPS, "optimizer.name": "SGD", "clip_grad_norm": None, **METHODS[method],
            **FAMILY_SETTINGS.get(family, {}), **FAMILY_METHOD_SETTINGS.get((family, method), {}), **extra}


def with_pivotal(raw: dict) -> dict:
    """`raw` with PIVOTAL's embedding where it applies (SD 1.x's and PixArt-α's LoRA): the entry, bundled, its token
    in the captions."""
    if raw["model"]["family"] not in PIVOTAL_KEYS or raw["method"] != "lora":
        return raw
    data = raw["data"]
    gathered = raw["model"]["family"] == PIVOTAL["family"]
    if gathered and raw.get("strategy", PIVOTAL_GATHERED["strategy"]) == PIVOTAL_GATHERED["strategy"]:  # and 1 process
        for key, value in PIVOTAL_GATHERED["settings"].items():
            apply_override(raw, f"{key}={json.dumps(value)}")
    entry = {"token": PIVOTAL["token"], "vectors": PIVOTAL["vectors"]}
    if raw["model"]["family"] == PIVOTAL_T5["family"]:
        entry["learning_rate"] = PIVOTAL_T5["learning_rate"]
    return {**raw, "bundle_additional_embeddings": True, "additional_embeddings": [entry],
            "data": {"concepts": [{"path": data["path"], "caption_prefix": PIVOTAL["token"]}], "shards": data["shards"]}}


def pivotal_start(model: Path) -> torch.Tensor:
    """The bundled vectors' start: init_text "*"'s rows of the token table (CLIP's or the T5's), repeated up to the
    vector count."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model / "tokenizer")("*", add_special_tokens=False).input_ids
    (table,) = [v for k, v in load_file(model / "text_encoder" / "model.safetensors").items()
                if k.endswith(("token_embedding.weight", "shared.weight"))]
    return table[(ids * PIVOTAL["vectors"])[:PIVOTAL["vectors"]]]


def assert_gathered_like_one_process(reference: Path, out: Path, case: str) -> None:
    """PIVOTAL_GATHERED's case: its EMA export and its sample equal one process's."""
    from test_sampling import images_of

    ema, got = load_file(reference / "lora_ema.safetensors"), load_file(out / "lora_ema.safetensors")
    assert ema.keys() == got.keys(), case
    assert distance(ema, got) <= TOLERANCE, f"{case}: EMA max abs diff {distance(ema, got):.3g}"
    assert distance({BUNDLED: ema[BUNDLED]}, load_file(out / "lora.safetensors")) > 100 * TOLERANCE, \
        f"{case}: the EMA's embedding is the trained one"
    (step,) = (reference / "samples").iterdir()
    (name, image), = images_of(step).items()
    difference = np.abs(image.astype(int) - images_of(out / "samples" / step.name)[name].astype(int))
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3, f"{case}: the sample differs from one process's"


def exported(out: Path, family: str, method: str, text_encoder: bool = False) -> dict[str, torch.Tensor]:
    """The trained weights a run exported (`text_encoder`: the full finetune's text encoder too)."""
    if method == "lora":
        return load_file(out / "lora.safetensors")
    denoiser = get_family(family).denoiser
    weights = load_file(out / "model" / denoiser / "diffusion_pytorch_model.safetensors")
    if text_encoder:
        weights |= {f"text_encoder.{k}": v for k, v in load_file(out / "model" / "text_encoder" / "model.safetensors").items()}
    return weights


def base_weights(model: Path, family: str, text_encoder: bool = False) -> dict[str, torch.Tensor]:
    """The full finetune's starting point, keyed as `exported` keys it."""
    weights = load_file(next((model / get_family(family).denoiser).glob("*.safetensors")))
    if text_encoder:
        weights |= {f"text_encoder.{k}": v for k, v in load_file(model / "text_encoder" / "model.safetensors").items()}
    return weights


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def recorded_inputs(output_dir: Path | str) -> dict[str, str]:
    """The dtypes the denoiser received at a run's first step (tests/helpers/denoiser_inputs.py)."""
    return json.loads(Path(f"{output_dir}.inputs.json").read_text())


def trained(family: str, method: str) -> dict:
    return {"text_encoder.train": True} if method == "full" and family in TEXT_ENCODER_TRAINED else {}


def family_cases(family: str, model: Path, data: Path, out: Path, accumulation: bool = True) -> dict[str, dict]:
    cases = {f"{family}/{strategy}-{method}": with_references(with_pivotal(base_config(
        model, data, out / f"{family}-{strategy}-{method}", family=family, method=method, batch_size=2,
        strategy=strategy, **settings(family, method, **extra, **trained(family, method)))))
        for strategy, extra in STRATEGIES.items() for method in METHODS
        if strategy in FAMILY_STRATEGIES.get(family, STRATEGIES)}
    if accumulation:
        cases |= {f"{family}/{strategy}+accumulation-full": base_config(
            model, data, out / f"{family}-{strategy}+accumulation-full", family=family, method="full", batch_size=1,
            strategy=strategy, gradient_accumulation_steps=2, **settings(family, "full", **trained(family, "full"),
                                                                         **ACCUMULATION_SETTINGS.get((strategy, family),
                                                                                                     {})))
            for strategy in ACCUMULATION
            if strategy in FAMILY_STRATEGIES.get(family, STRATEGIES)}
    return cases

def full_variant(kind: str, setting: dict, strategies, family: str, model: Path, data: Path, out: Path,
                 references: dict, paired: bool = False, change: float | None = 100 * TOLERANCE,
                 **split) -> dict[str, dict]:
    """A full finetune with `setting` (and, `paired`, a reference image for each image): one process's run (batch 4)
    as references[family, kind], checked to differ from the plain full finetune's by `change` (the comparison can
    fail), and its 2-rank cases under `strategies`, each rank's global-batch share given by `split` (batch_size,
    gradient_accumulation_steps)."""
    def data_of(raw):
        return with_references(raw, optional_too=True) if paired else raw

    ref = out / f"ref-{family}-{kind}"
    raw = data_of(base_config(model, data, ref, family=family, method="full", batch_size=4,
                              **settings(family, "full", **setting, **trained(family, "full"))))
    Trainer(validate(raw), log=lambda *_: None).train()
    references[family, kind] = exported(ref, family, "full", bool(trained(family, "full")))
    if change is not None:  # None: another model (its own start is what the cases are checked to move from)
        assert distance(references[family, kind], references[family, "full"]) > change, \
            f"{setting} changed nothing"
    return {f"{family}/{strategy}+{kind}-{kind}": data_of(base_config(
        model, data, out / f"{family}-{strategy}+{kind}-{kind}", family=family, method="full", strategy=strategy,
        **split, **settings(family, "full", **setting, **STRATEGIES[strategy], **trained(family, "full"))))
        for strategy in strategies}


@pytest.mark.parametrize("family", FAMILIES)
def test_strategies_equal_one_process(family, family_models, one_level_sd1, shapes_data, tmp_path):
    families = (family, *RIDERS.get(family, ()))
    # SD 1.x: the 1-level UNet (conftest.py one_level_sd1): its 19 runs cost per parameter, their assertions (TOLERANCE,
    # 100 x TOLERANCE moved) do not depend on the depth. FSDP's down- / upsampler units train in Flux's launch (DEPTHED,
    # the 4-level SD 2.0 depth UNet) and test_strategies.py's fsdp variants (small_sd1).
    models = {name: one_level_sd1 if name == "sd1" else family_models[name] for name in families}
    references = {}
    for name in families:
        for method in METHODS:
            out = tmp_path / f"ref-{name}-{method}"
            raw = with_references(with_pivotal(base_config(models[name], shapes_data, out, family=name, method=method,
                                                           batch_size=4, **settings(name, method, **trained(name, method)))))
            Trainer(validate(raw), log=lambda *_: None).train()
            references[name, method] = exported(out, name, method, bool(trained(name, method)))
    cases = {}
    for name in families:
        cases |= family_cases(name, models[name], shapes_data, tmp_path, accumulation=name == family)
    for name in (name for name in families if name in FUSED):
        cases[f"{name}/ddp+fused-full"] = base_config(
            models[name], shapes_data, tmp_path / f"{name}-ddp+fused-full", family=name, method="full", batch_size=2,
            strategy="ddp", **settings(name, "full", **{"optimizer.fused_back_pass": True}, **FUSED[name],
                                       **trained(name, "full")))
    if family == CLIPPED["family"]:
        cases |= full_variant("clipped", {"clip_grad_norm": CLIPPED["clip_grad_norm"]}, CLIPPED["strategies"],
                              family, models[family], shapes_data, tmp_path, references, batch_size=2)
    if family == FUSED_CLIPPED["family"]:
        cases |= full_variant("fusedclipped", FUSED_CLIPPED["settings"], ("ddp",), family, models[family], shapes_data,
                              tmp_path, references, batch_size=1, gradient_accumulation_steps=2)
    if family == SCALED["family"]:
        cases |= full_variant("scaled", {"loss.scaler": SCALED["loss.scaler"]}, SCALED["strategies"], family,
                              models[family], shapes_data, tmp_path, references, batch_size=1,
                              gradient_accumulation_steps=2)
    if family == EDITED["launch"]:
        edited = EDITED["family"]
        # the tiny transformer's reference tokens move its weights 7.4e-5 from the text-to-image run's: ranks that
        # dropped them (or gave them other ids) would fail the comparison by several TOLERANCEs
        cases |= full_variant("edited", {}, EDITED["strategies"], edited, models[edited], shapes_data, tmp_path,
                              references, paired=True, change=5 * TOLERANCE, batch_size=2)
    if family == INPAINTED["family"]:
        fill = make_tiny_model(tmp_path / "inpainting-model", family, inpainting=True)
        cases |= full_variant("inpainted", {"model.inpainting": True}, INPAINTED["strategies"], family, fill,
                              shapes_data, tmp_path, references, change=None, batch_size=2)
    if family == DEPTHED["launch"]:
        depth = make_tiny_model(tmp_path / "depth-model", DEPTHED["family"], depth=True)
        cases |= full_variant("depthed", {}, DEPTHED["strategies"], DEPTHED["family"], depth, shapes_data, tmp_path,
                              references, change=None, batch_size=2)
    bfloat16_cases = {}
    for name in (name for name in families if name in BFLOAT16_CASES):
        out = tmp_path / f"ref-{name}-bfloat16"
        raw = base_config(models[name], shapes_data, out, family=name, method="full", batch_size=4,
                          train_dtype="bfloat16", **settings(name, "full"))
        trainer = Trainer(validate(raw), log=lambda *_: None)
        record_denoiser_inputs(trainer, f"{out}.inputs.json")
        trainer.train()
        references[name, "bfloat16"] = exported(out, name, "full")
        for strategy in BFLOAT16_CASES[name]:
            out = tmp_path / f"{name}-{strategy}+bfloat16-full"
            bfloat16_cases[f"{name}/{strategy}+bfloat16-full"] = {
                **base_config(models[name], shapes_data, out, family=name, method="full", batch_size=2,
                              strategy=strategy, train_dtype="bfloat16",
                              **settings(name, "full", **STRATEGIES[strategy])),
                "_record_denoiser_inputs": f"{out}.inputs.json"}
    (tmp_path / "cases.json").write_text(json.dumps(cases | bfloat16_cases))
    done = run_ranks(str(REPO / "tests" / "helpers" / "family_cases.py"),
                           str(tmp_path / "cases.json"), env=ENV, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for case, raw in bfloat16_cases.items():
        name = raw["model"]["family"]
        noise = distance(references[name, "full"], references[name, "bfloat16"])
        diff = distance(references[name, "bfloat16"], exported(Path(raw["output_dir"]), name, "full"))
        print(f"{case}: max diff {diff:.3g} (bfloat16 noise {noise:.3g})")
        assert recorded_inputs(raw["output_dir"]) == recorded_inputs(tmp_path / f"ref-{name}-bfloat16"), case
        assert diff <= BFLOAT16_NOISE * noise, f"{case}: max abs diff {diff:.3g}, bfloat16 noise {noise:.3g}"
    for case, raw in cases.items():
        name, kind = raw["model"]["family"], case.rsplit("-", 1)[1]  # full, lora, clipped or scaled (a full finetune)
        method = "full" if kind in ("clipped", "scaled", "edited", "inpainted", "depthed", "fusedclipped") else kind
        with_text_encoder = bool(trained(name, method))  # the same for the clipped, scaled and edited cases
        reference, got = references[name, kind], exported(Path(raw["output_dir"]), name, method, with_text_encoder)
        assert reference.keys() == got.keys(), case
        diff = max((reference[k].float() - got[k].float()).abs().max().item() for k in reference)
        assert diff <= TOLERANCE, f"{case}: max abs diff {diff:.3g} > {TOLERANCE}"
        # The comparison can fail: training moved the weights far more than the tolerance.
        if method == "full":
            start = base_weights(Path(raw["model"]["path"]), name, with_text_encoder)  # the case's own model
        else:
            start = {k: torch.zeros_like(v) for k, v in got.items() if "lora_B" in k or "lora_up" in k}
        moved = max((start[k].float() - got[k].float()).abs().max().item() for k in start)
        assert moved > 100 * TOLERANCE, f"{case}: weights moved only {moved:.3g}"
        if method == "lora" and name in PIVOTAL_KEYS:  # the embedding's own update was compared, not its start
            emb_moved = (got[PIVOTAL_KEYS[name]] - pivotal_start(models[name])).abs().max().item()
            assert emb_moved > 100 * TOLERANCE, f"{case}: the embedding moved only {emb_moved:.3g}"
        if BUNDLED in got and raw["strategy"] == PIVOTAL_GATHERED["strategy"]:
            assert_gathered_like_one_process(tmp_path / f"ref-{name}-lora", Path(raw["output_dir"]), case)
        if with_text_encoder:  # the text encoder's own update was compared, not its start
            te_moved = max((start[k].float() - got[k].float()).abs().max().item() for k in start
                           if k.startswith("text_encoder."))
            assert te_moved > 100 * TOLERANCE, f"{case}: the text encoder moved only {te_moved:.3g}"


# strategy -> allowance in units of the measured bf16 / fp16 noise. DDP, FSDP and (in bfloat16, deepspeed.mixed_precision
# auto) ZeRO compute under autocast over float32 weights, as the one process does: measured 0.65 (ddp), 0.79 (fsdp),
# 0.74 (zero2), 1.03 (zero3) x the bf16 noise; float16 0.8-1.2x. DeepSpeed's bf16 engine (mixed_precision: engine:
# weights, gradients, norms and softmax in bfloat16) ended 4.2 (zero2) and 4.3 (zero3) x away. A 2x gradient error is
# far beyond: ddp summing instead of averaging ended 160x the bf16 noise away. On one_level_sd1 (conftest.py), where
# this launch runs since November 2026: 0.52 (ddp), 0.65 (fsdp), 0.71 (zero2), 0.74 (zero3) x the bf16 noise (the same
# launch on small_sd1: 0.83, 0.71, 0.85, 1.01), float16 0.81 (ddp), 1.02 (fsdp) (small_sd1: 0.66, 0.79); rank 1's
# gradients doubled (half an update too much) ended 67-68x the bf16 noise and 660x the fp16 noise away.
BF16_STRATEGIES = {"ddp": 4, "fsdp": 4, "zero2": 2, "zero3": 2}
# float16 under ZeRO is DeepSpeed's fp16 engine (autocast float16 is refused), another recipe: checked against its own
# one-process writing below (ENGINE_STRATEGIES), not against autocast.
FP16_STRATEGIES = {"ddp": 4, "fsdp": 4}
OVERFLOW_AT = 2  # float16 runs: this step's gradients overflow on the last rank (tests/helpers/overflow.py)
# DeepSpeed's bf16 / fp16 engine (deepspeed.mixed_precision: engine), 2 ranks of batch 2, against the same recipe in one
# process of batch 4 (tests/helpers/engine_reference.py: weights in train_dtype, float32 masters, no autocast, float16
# loss scaling), not against autocast: a different recipe ends 4-56x the bf16 noise away (docs/parallel.md). Both
# start from the same float32 masters and take the same SGD updates; what differs is rounding. Each step's gradient
# is rounded to train_dtype on each rank (batch 2) and again in the reduction, where the one process rounds the
# batch-4 gradient once; where the masters then differ, their half-precision copies may round apart and the next
# step's gradients differ by about one rounding more. So after 3 steps the weights may differ by a few unit
# roundoffs u (2^-8 for bfloat16, 2^-11 for float16) of the largest update: allowed ENGINE_ROUNDINGS u, measured
# 1.9-2.6 u (bfloat16, zero2 and zero3, weights and EMA: under 1 % of the update) and 1.2-2.3 u (float16: 0.1 %); on
# one_level_sd1 1.5-1.6 u (bfloat16, the resume too) and 1.0-1.5 u (float16), where the same launch on small_sd1 gave
# 2.0-2.4 u and 2.3-3.7 u, and rank 1's gradients doubled 123 u (bfloat16 zero2). A
# gradient summed instead of averaged moves the weights by 2x the update (halved: 0.5x): measured 385 u (bfloat16);
# a loss scale left in the update, or clipping of the scaled gradients (2^16 times the norm), by far more; an
# overflowed step applied, by a whole update; an export of the bf16 copies instead of the masters ended 36 u away,
# masters cloned from the rounded weights (DeepSpeed's own start: up to half a bf16 step of a weight) 10 u
# (bfloat16) and 14 u (float16).
ENGINE_STRATEGIES = ("zero2", "zero3")
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
ENGINE_ROUNDINGS = 8
# the engine cases keep an EMA (decay 0.5, every step: it follows the last steps closely), compared too: it must
# average the float32 masters, not their half-precision copies
ENGINE_EMA = {"ema.enabled": True, "ema.decay": 0.5, "ema.update_step_interval": 1}
ENGINE_CLIP = 0.2  # far below the tiny UNet's gradient norm: clips every step; of the scaled gradients: no update
# The block casts (ot_dist/methods/block_casts.py: under autocast a block's trained float32 weights are cast to bfloat16
# in one op, their gradients back in one) on 2 ranks, where the gradients' consumers are the strategies' own: DDP's
# reducer (hooks on the weights' AccumulateGrad nodes, which a block's one backward node now feeds) and ZeRO-2's
# gradient hooks and buckets. They must change no bit of what trains: each case on the block casts has a twin on the
# per-layer casts, exported weights compared exactly. In the bfloat16 launch: the full finetunes' bfloat16-ddp /
# bfloat16-zero2 cases (compared with one process below) and LoRA cases, which are compared with one LoRA process of
# batch 4 in bfloat16 within BF16_STRATEGIES x LoRA's own bfloat16 noise, measured 0.80 (ddp) and 0.62 (zero2) x it
# (on one_level_sd1: 0.52 and 0.48 shared (ddp), 0.65 and 0.65 (zero2); the same launch on small_sd1: 0.91 / 0.79,
# 0.72 / 0.74); a gradient scaled by 2 moves the adapters by a whole update (CastTogether's gradients doubled on the
# ranks: 45 noises away; rank 1's gradients doubled on one_level_sd1: 73). one_level_sd1's 3 transformer blocks each
# still share a self-attention q / k / v and a cross-attention k / v group (recorded: blocks 3, shared_groups 6, as
# shared_groups == 2 x blocks below wants). Each rank records how many blocks cast together and how often (helpers/
# block_casts_record.py): a run where they skipped themselves would compare the per-layer casts with themselves.
BLOCK_CASTS_STRATEGIES = ("ddp", "zero2")


def test_bfloat16_and_float16_under_every_strategy_match_one_process(one_level_sd1, shapes_data, tmp_path):
    """FSDP's MixedPrecisionPolicy, DeepSpeed's ZeRO under torch autocast (bfloat16's deepspeed.mixed_precision
    default) and DDP under autocast, against one process in the same dtype. Rounding makes them differ; the
    allowance is measured, not guessed: a multiple of the distance between the one-process low-precision and float32
    runs. A gradient off by 2x moves the weights by ~half an update, far beyond it. The exports are the float32
    masters (DeepSpeed's bf16 / fp16 engine's modules would hold low-precision copies).
    float16 adds loss scaling: step 2 overflows on one rank only, and every rank must skip it as the one process
    does (a rank that steps leaves the model one update away, 10-100x the allowance).
    The launch also trains the block casts' cases under ddp and zero2 (BLOCK_CASTS_STRATEGIES)."""
    family, model = "sd1", one_level_sd1  # the 1-level UNet (conftest.py): many runs, each paying per parameter
    base = load_file(next((model / get_family(family).denoiser).glob("*.safetensors")))
    full = settings(family, "full", max_steps=LOW_PRECISION_STEPS)

    overflowed = {}  # one-process run -> the steps it reported as overflowed

    def one_process(name: str, dtype: str, overflow_at: int | None = None, poison_gradient: int | None = None):
        raw = base_config(model, shapes_data, tmp_path / name, family=family, method="full", batch_size=4,
                          train_dtype=dtype, **full)
        trainer = Trainer(validate(raw), log=lambda *_: None)
        inject(trainer, overflow_at, poison_gradient)
        record_denoiser_inputs(trainer, f"{tmp_path / name}.inputs.json")
        overflowed[name] = trainer.train().overflowed_steps
        return exported(tmp_path / name, family, "full")

    fp32 = one_process("ref-fp32", "float32")
    references = {"bfloat16": one_process("ref-bf16", "bfloat16"), "float16": one_process("ref-fp16-skip", "float16",
                                                                                         OVERFLOW_AT)}
    fp16_no_overflow = one_process("ref-fp16", "float16")
    noise = {"bfloat16": distance(fp32, references["bfloat16"]), "float16": distance(fp32, fp16_no_overflow)}
    update = distance(references["bfloat16"], base)
    assert update > 20 * noise["bfloat16"], f"updates ({update:.3g}) must dwarf bf16 noise ({noise['bfloat16']:.3g})"
    skipped = distance(references["float16"], fp16_no_overflow)  # the skipped step is missing from the weights
    assert skipped > 20 * noise["float16"], f"the one process did not skip the overflow step ({skipped:.3g})"
    element = one_process("ref-fp16-element", "float16", poison_gradient=OVERFLOW_AT)  # skips like the overflow
    assert distance(element, references["float16"]) < noise["float16"], "the one process did not skip the inf step"
    assert overflowed["ref-fp16-skip"] == overflowed["ref-fp16-element"] == [OVERFLOW_AT] and not overflowed["ref-fp16"]
    cases = {f"bfloat16-{strategy}": base_config(model, shapes_data, tmp_path / f"bfloat16-{strategy}", family=family,
                                                 method="full", batch_size=2, strategy=strategy,
                                                 train_dtype="bfloat16", **full)
             for strategy in BF16_STRATEGIES}
    cases |= {f"float16-{strategy}": {**base_config(model, shapes_data, tmp_path / f"float16-{strategy}", family=family,
                                                    method="full", batch_size=2, strategy=strategy,
                                                    train_dtype="float16", **full),
                                      "_overflow_at_step": OVERFLOW_AT}
              for strategy in FP16_STRATEGIES}
    # one inf element after the reduction: under FSDP only the rank owning that shard sees it
    cases |= {f"float16+element-{strategy}": {**cases[f"float16-{strategy}"], "output_dir": str(tmp_path / f"element-{strategy}"),
                                              "_overflow_at_step": None, "_inf_gradient_element_at_step": OVERFLOW_AT}
              for strategy in FP16_STRATEGIES}
    # The denoiser receives its inputs in the dtypes the one process gives it (its weights' storage dtype, float32,
    # and autocast casting at each matmul / conv): FSDP's MixedPrecisionPolicy must not cast the root's, and ZeRO
    # must compute under autocast over float32 weights (deepspeed.mixed_precision auto), not in DeepSpeed's bf16
    # engine, whose weights and so every input the family derives come in bfloat16.
    inputs_checked = {"bfloat16-ddp": "ref-bf16", "bfloat16-fsdp": "ref-bf16", "float16-fsdp": "ref-fp16-skip",
                      "bfloat16-zero2": "ref-bf16", "bfloat16-zero3": "ref-bf16"}
    for name in inputs_checked:
        cases[name]["_record_denoiser_inputs"] = f"{cases[name]['output_dir']}.inputs.json"
    engine_cases, engine_references = deepspeed_engine_cases(model, shapes_data, tmp_path)
    casts_cases, lora_references = block_casts_cases(model, shapes_data, tmp_path, cases)
    # the block casts' cases last: after the ZeRO-3 cases, whose closed trainers must have given torch its linear back
    # (each block casts case records which linear it computed with: block_casts_record.py)
    (tmp_path / "cases.json").write_text(json.dumps(cases | engine_cases | casts_cases))
    done = run_ranks(str(REPO / "tests" / "helpers" / "family_cases.py"),
                           str(tmp_path / "cases.json"), env=ENV, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert_engine_like_one_process(engine_cases, engine_references, fp16_no_overflow, done.stdout, model, shapes_data,
                                   tmp_path)
    assert_block_casts_change_no_bit(cases | casts_cases, lora_references)
    for name in cases:
        kind, strategy = name.split("-")
        dtype = kind.split("+")[0]
        got = exported(Path(cases[name]["output_dir"]), family, "full")
        diff = distance(references[dtype], got)
        allowed = (BF16_STRATEGIES if dtype == "bfloat16" else FP16_STRATEGIES)[strategy] * noise[dtype]
        print(f"{kind} {strategy}: max diff {diff:.3g} (noise {noise[dtype]:.3g}, update {update:.3g})")
        assert diff <= allowed, f"{name}: weights differ by {diff:.3g} > {allowed:.3g} ({dtype} noise {noise[dtype]:.3g})"
    for name, reference in inputs_checked.items():
        assert recorded_inputs(cases[name]["output_dir"]) == recorded_inputs(tmp_path / reference), name


def engine_settings(dtype: str, **extra) -> dict:
    return {"train_dtype": dtype, "deepspeed.mixed_precision": "engine",
            **settings("sd1", "full", max_steps=LOW_PRECISION_STEPS, **ENGINE_EMA, **extra)}


def engine_case_name(dtype: str, variant: str, strategy: str) -> str:
    return f"engine-{dtype}{variant}-{strategy}"


def deepspeed_engine_cases(model: Path, data: Path, tmp_path: Path) -> tuple[dict, dict]:
    """The 2-rank cases of DeepSpeed's engine (ENGINE_STRATEGIES x bfloat16, float16 with an overflow at OVERFLOW_AT;
    float16 clipped at ENGINE_CLIP under zero2; the bfloat16 zero2 case saves a checkpoint at step 2), and their
    references: one process of batch 4 in the same recipe (engine_reference.py), trained here. 5 cases: +14 CPU s on
    the launch, its references and the resume (zero3's clipped case, +3.6 CPU s, and zero2 with accumulation,
    +1.8, were measured and left out: the clipping and the division by the accumulation are DeepSpeed's, the config
    and the backward ot_dist hands it the same in every stage)."""
    from engine_reference import one_process_engine

    variants = {("bfloat16", ""): {}, ("float16", ""): {"_overflow_at_step": OVERFLOW_AT},
                ("float16", "+clipped"): {"clip_grad_norm": ENGINE_CLIP}}
    references, cases = {}, {}
    for (dtype, variant), extra in variants.items():
        injected = {k: v for k, v in extra.items() if k.startswith("_")}
        more = {k: v for k, v in extra.items() if not k.startswith("_")}
        out = tmp_path / f"ref-engine-{dtype}{variant}"
        with one_process_engine():
            trainer = Trainer(validate(base_config(model, data, out, method="full", batch_size=4,
                                                   **engine_settings(dtype, **more))), log=lambda *_: None)
        inject(trainer, injected.get("_overflow_at_step"))
        result = trainer.train()
        assert result.overflowed_steps == ([OVERFLOW_AT] if injected else []), result.overflowed_steps
        references[dtype + variant] = out
        for strategy in ENGINE_STRATEGIES[:1] if variant else ENGINE_STRATEGIES:  # clipping: DeepSpeed's, zero2 only
            name = engine_case_name(dtype, variant, strategy)
            saves = (dtype, variant, strategy) == ("bfloat16", "", "zero2")  # the checkpoint the resume starts from
            checkpoint = {"checkpoint.every_n_steps": 2, "checkpoint.at_end": False} if saves else {}
            cases[name] = {**base_config(model, data, tmp_path / name, method="full", batch_size=2, strategy=strategy,
                                         **engine_settings(dtype, **more, **checkpoint)),
                           **injected, "_fp16_engine_on_cpu": dtype == "float16"}
    return cases, references


def assert_engine_like_one_process(cases: dict, references: dict, fp16_no_overflow: dict, launch_output: str,
                                   model: Path, data: Path, tmp_path: Path) -> None:
    """The engine's exports (trained weights and EMA) within ENGINE_ROUNDINGS unit roundoffs of the largest update
    of the one-process recipe, float32 masters (not the half-precision copies: most elements are not representable
    in train_dtype), the overflowed step skipped and reported, and the bfloat16 zero2 checkpoint of step 2 (its
    float32 masters and EMA) resumed in one process to the same end."""
    from engine_reference import one_process_engine

    base = base_weights(model, "sd1")

    def load(out: Path, suffix: str = "") -> dict[str, torch.Tensor]:
        return load_file(out / f"model{suffix}" / "unet" / "diffusion_pytorch_model.safetensors")

    def assert_close(case: str, reference: dict, got: dict, dtype: str) -> None:
        update = distance(base, reference)
        allowed = ENGINE_ROUNDINGS * UNIT_ROUNDOFF[dtype] * update
        diff = distance(reference, got)
        print(f"{case}: max diff {diff:.3g} = {diff / (UNIT_ROUNDOFF[dtype] * update):.2f} u of the update {update:.3g}")
        assert diff <= allowed, f"{case}: max abs diff {diff:.3g} > {allowed:.3g} ({ENGINE_ROUNDINGS} u of {update:.3g})"
        flat = torch.cat([v.reshape(-1) for v in got.values()])
        representable = (flat.to(DTYPES[dtype]).float() == flat).float().mean().item()
        assert representable < 0.5, f"{case}: {representable:.0%} of the weights are {dtype} values, not the masters"

    for name, raw in cases.items():
        dtype = raw["train_dtype"]
        reference_out = references[name.split("-", 2)[1]]
        for suffix in ("", "_ema"):
            assert_close(name + suffix, load(reference_out, suffix), load(Path(raw["output_dir"]), suffix), dtype)
        overflowed = [OVERFLOW_AT] if "_overflow_at_step" in raw else []
        assert f"case done: {name}; overflowed steps: {overflowed}" in launch_output, name
    skipped, applied = load(references["float16"]), fp16_no_overflow
    assert distance(skipped, applied) > 100 * ENGINE_ROUNDINGS * UNIT_ROUNDOFF["float16"] * distance(base, skipped), \
        "the one-process engine applied the overflowed step"
    clipped = load(references["float16+clipped"])
    assert distance(base, clipped) < 0.5 * distance(base, load(references["float16"])), "clipping did not bite"
    # resumed in one process (the engine's recipe) from the 2-rank bfloat16 zero2 checkpoint of step 2: its float32
    # masters, not their bf16 copies, and its EMA, else the end differs by up to half a bf16 step of a weight
    source = cases[engine_case_name("bfloat16", "", "zero2")]
    out = tmp_path / "engine-resumed"
    shutil.copytree(source["output_dir"], out, ignore=shutil.ignore_patterns("model*"))
    resumed_raw = base_config(model, data, out, method="full", batch_size=4, **engine_settings("bfloat16"))
    with one_process_engine():
        result = Trainer(validate(resumed_raw), log=lambda *_: None, resume="auto").train()
    assert result.first_step == 2 and result.steps == LOW_PRECISION_STEPS
    for suffix in ("", "_ema"):
        assert_close(f"resumed{suffix}", load(references["bfloat16"], suffix), load(out, suffix), "bfloat16")


def block_casts_cases(model: Path, data: Path, tmp_path: Path, cases: dict) -> tuple[dict, dict]:
    """BLOCK_CASTS_STRATEGIES' block casts cases: LoRA's (on the block casts, and on the per-layer casts) and the
    per-layer twins of the bfloat16 full finetunes of `cases` (which get recorded too); and LoRA's references, one
    process of batch 4 in float32 and in bfloat16."""
    lora = settings("sd1", "lora", max_steps=LOW_PRECISION_STEPS)
    references = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"ref-lora-{dtype}"
        Trainer(validate(base_config(model, data, out, method="lora", batch_size=4, train_dtype=dtype, **lora)),
                log=lambda *_: None).train()
        references[dtype] = exported(out, "sd1", "lora")
    added = {}
    for strategy in BLOCK_CASTS_STRATEGIES:
        full = cases[f"bfloat16-{strategy}"]
        full["_record_block_casts"] = f"{full['output_dir']}.casts"
        for method, variant in (("lora", "on"), ("lora", "per_layer"), ("lora", "shared"), ("full", "per_layer")):
            name = block_casts_case_name(method, strategy, variant)
            out = tmp_path / name
            trained = lora if method == "lora" else settings("sd1", "full", max_steps=LOW_PRECISION_STEPS)
            added[name] = {**base_config(model, data, out, method=method, batch_size=2, strategy=strategy,
                                         train_dtype="bfloat16", **trained),
                           "_undone": list(CASTS_UNDONE[variant]), "_record_block_casts": f"{out}.casts"}
    return added, references


# variant -> the fast-path changes its case undoes: "on" compares bit for bit with "per_layer", so LoRA's shared down
# projections (which sum in another order, ot_dist/methods/shared_inputs.py) are undone there; "shared" is LoRA as it
# trains by default, compared with one process only
CASTS_UNDONE = {"on": OWN_DOWN_PROJECTIONS, "per_layer": PER_LAYER_CASTS, "shared": ()}


def block_casts_case_name(method: str, strategy: str, variant: str) -> str:
    if method == "full" and variant == "on":  # the bfloat16 full finetune the launch compares with one process anyway
        return f"bfloat16-{strategy}"
    return f"casts-{method}-{strategy}" + ("" if variant == "on" else f"+{variant}")


def assert_block_casts_change_no_bit(cases: dict, lora_references: dict) -> None:
    """See BLOCK_CASTS_STRATEGIES."""
    def recorded(name: str) -> list[dict]:  # each rank's (block_casts_record.py)
        return [json.loads(Path(f"{cases[name]['output_dir']}.casts.rank{rank}.json").read_text()) for rank in (0, 1)]

    noise = distance(lora_references["float32"], lora_references["bfloat16"])
    # lora_B starts at zero: how far the one process moved it
    update = max(v.abs().max().item() for k, v in lora_references["bfloat16"].items()
                 if "lora_B" in k or "lora_up" in k)
    assert update > 20 * noise, f"LoRA's update ({update:.3g}) must dwarf its bf16 noise ({noise:.3g})"

    def assert_lora_like_one_process(name: str, strategy: str) -> None:
        diff = distance(lora_references["bfloat16"], exported(Path(cases[name]["output_dir"]), "sd1", "lora"))
        allowed = BF16_STRATEGIES[strategy] * noise
        print(f"{name}: max diff {diff:.3g} (LoRA bf16 noise {noise:.3g}, update {update:.3g})")
        assert diff <= allowed, f"{name}: weights differ by {diff:.3g} > {allowed:.3g} (noise {noise:.3g})"

    for strategy in BLOCK_CASTS_STRATEGIES:
        for method in ("full", "lora"):
            on, off = (block_casts_case_name(method, strategy, variant) for variant in ("on", "per_layer"))
            shared = block_casts_case_name(method, strategy, "shared") if method == "lora" else None
            for rank, (grouped, plain) in enumerate(zip(recorded(on), recorded(off))):
                # each block that casts together does so once in each step's forward and once in its backward (no
                # checkpointing, one micro step); the twin's switch left every layer on its own casts
                assert grouped["blocks"] > 0, f"{on}: no block cast together on rank {rank}"
                casts = grouped["blocks"] * LOW_PRECISION_STEPS
                assert grouped["forward"] == grouped["backward"] == casts, f"{on} on rank {rank}: {grouped}"
                assert grouped["shared_groups"] == 0, f"{on} on rank {rank}: {grouped}"
                assert plain == {"blocks": 0, "forward": 0, "backward": 0, "torch_linear": True,
                                 "shared_groups": 0}, f"{off} on rank {rank}: {plain}"
                assert grouped["torch_linear"], f"{on}: an earlier ZeRO-3 case left DeepSpeed's linear in place"
                if shared:  # the self-attentions' q / k / v and the cross-attentions' k / v of each block
                    sharing = recorded(shared)[rank]
                    assert sharing["shared_groups"] == 2 * sharing["blocks"] > 0, f"{shared} on rank {rank}: {sharing}"
                    assert sharing["forward"] == sharing["backward"] == casts, f"{shared} on rank {rank}: {sharing}"
            got, twin = (exported(Path(cases[name]["output_dir"]), "sd1", method) for name in (on, off))
            if method == "lora":  # (the full finetune's on case is compared with one process by the caller)
                assert_lora_like_one_process(on, strategy)
                assert_lora_like_one_process(shared, strategy)
            assert got.keys() == twin.keys(), on
            changed = [k for k in got if not torch.equal(got[k], twin[k])]
            assert not changed, f"{on}: {len(changed)} tensors differ from the per-layer casts', by up to " \
                                f"{distance(got, twin):.3g} (e.g. {changed[0]})"


def test_zero_low_precision_recipe_follows_deepspeed_mixed_precision(small_sd1, shapes_data, tmp_path):
    """The DeepSpeed config each deepspeed.mixed_precision gives (the launches above train the bfloat16 default):
    torch autocast over float32 weights for bfloat16 unless the engine is asked for, by the setting or by a
    config_file that enables bf16 / fp16; float16's default is the fp16 engine, and autocast float16 is refused."""
    from ot_dist.errors import ConfigError
    from ot_dist.parallel.deepspeed import deepspeed_config

    def ds(dtype: str, mode: str | None = None, **more) -> dict:
        raw = base_config(small_sd1, shapes_data, tmp_path / "out", strategy="zero2", train_dtype=dtype, **more,
                          **({"deepspeed.mixed_precision": mode} if mode else {}))
        config = deepspeed_config(validate(raw), 2, 2)
        return {k: config[k] for k in ("bf16", "fp16", "torch_autocast") if k in config}

    autocast = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    assert ds("bfloat16") == ds("bfloat16", "autocast") == autocast
    assert ds("bfloat16", "engine") == {"bf16": {"enabled": True}}
    assert ds("float16") == ds("float16", "engine") == {"fp16": {"enabled": True, "initial_scale_power": 16}}
    assert ds("float32", "autocast") == {}
    theirs = tmp_path / "ds.json"
    theirs.write_text(json.dumps({"bf16": {"enabled": True}}))
    assert ds("bfloat16", **{"deepspeed.config_file": str(theirs)}) == {"bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match="deepspeed.mixed_precision: autocast with train_dtype float16"):
        ds("float16", "autocast")


def test_engine_config_as_deepspeed_reads_it_and_fp16_refused_where_the_accelerator_lacks_it(small_sd1, shapes_data,
                                                                                          tmp_path):
    """What ot_dist hands DeepSpeed for its engine, read by DeepSpeed's own config reader: float16 with a dynamic loss
    scale from 2^16 (engine_reference.py's INITIAL_LOSS_SCALE), hysteresis 2 (the first overflow keeps the scale) and
    float32 masters and gradients; bfloat16 with float32 masters too; clipping as configured (DeepSpeed takes the
    scale out of the norm before clipping: the launch above checks that); autocast off. And the engine is refused,
    saying why, where DeepSpeed's accelerator does not report its dtype: DeepSpeed 0.19's CPU accelerator reports
    float16 only with oneDNN's native float16 (AVX512-FP16 / AMX-FP16; engine.py `_do_sanity_check` would stop with
    "Type fp16 is not supported on your device."). The launch above runs the fp16 engine on this CPU anyway, with
    the report forced (engine_reference.py `fp16_reported`): torch computes float16 on any CPU."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig

    from ot_dist.errors import ConfigError
    from ot_dist.parallel.deepspeed import deepspeed_config, refuse_engine_dtype_the_device_lacks

    def read(dtype: str) -> tuple[dict, DeepSpeedConfig]:
        raw = base_config(small_sd1, shapes_data, tmp_path / "out", strategy="zero2", clip_grad_norm=0.5,
                          **{"train_dtype": dtype, "deepspeed.mixed_precision": "engine"})
        generated = deepspeed_config(validate(raw), 2, 1)  # world size 1: DeepSpeed's reader, without a process group
        return generated, DeepSpeedConfig(generated)

    fp16, read_fp16 = read("float16")
    assert read_fp16.float16_config.enabled and not read_fp16.bfloat16_config.enabled
    assert (read_fp16.float16_config.loss_scale, read_fp16.float16_config.initial_scale_power,
            read_fp16.float16_config.hysteresis) == (0, 16, 2)
    assert not read_fp16.float16_config.fp16_master_weights_and_grads and read_fp16.gradient_clipping == 0.5
    bf16, read_bf16 = read("bfloat16")
    assert read_bf16.bfloat16_config.enabled and not read_bf16.bfloat16_config.bf16_master_weights_and_grads
    assert not read_bf16.float16_config.enabled and read_bf16.zero_optimization_stage == 2
    assert "torch_autocast" not in fp16 and "torch_autocast" not in bf16

    accelerator = get_accelerator()
    try:
        accelerator.is_fp16_supported = lambda: False  # this CPU's answer (torch.ops.mkldnn._is_mkldnn_fp16_supported)
        with pytest.raises(ConfigError, match="fp16 engine .* not supported on this cpu device.*AVX512-FP16"):
            refuse_engine_dtype_the_device_lacks(fp16)
        refuse_engine_dtype_the_device_lacks(bf16)
        accelerator.is_fp16_supported = lambda: True
        refuse_engine_dtype_the_device_lacks(fp16)
    finally:
        del accelerator.is_fp16_supported


def test_size_conditions_reach_the_denoiser_in_float32_from_bfloat16_latents():
    """Under DeepSpeed's bf16 engine (deepspeed.mixed_precision: engine) the latents and text come in bfloat16; SDXL's
    time ids and PixArt-α's size conditions stay float32 (their embeddings take float32 and cast their output), where
    bfloat16 would round an original size of 6000 px to 6016 and an aspect of 4:3 to 1.336."""
    bf16 = torch.bfloat16
    sizes = torch.tensor([[6000, 4500]])
    batch = {"original_size": sizes, "crop_top_left": torch.tensor([[3, 5]]), "target_size": sizes}
    conditioning = {"hidden": torch.zeros(1, 4, 8, dtype=bf16), "pooled": torch.zeros(1, 8, dtype=bf16)}
    time_ids = get_family("sdxl").unet_inputs(conditioning, batch)["added_cond_kwargs"]["time_ids"]
    assert time_ids.dtype == torch.float32 and time_ids[0, 0].item() == 6000

    seen = {}

    def transformer(noisy, **kwargs):
        seen.update(kwargs["added_cond_kwargs"])
        return (torch.zeros_like(noisy),)

    transformer.use_additional_conditions = True
    pixart = get_family("pixart_alpha")
    pixart.transformer_output(transformer, torch.zeros(1, 4, 96, 72, dtype=bf16), torch.tensor([500]),
                              {"hidden": conditioning["hidden"], "mask": torch.ones(1, 4)})
    assert seen["resolution"].dtype == seen["aspect_ratio"].dtype == torch.float32
    assert seen["aspect_ratio"].item() == pytest.approx(4 / 3) and seen["resolution"].tolist() == [[768, 576]]


def test_hybrid_shard_over_two_nodes_of_two_equals_one_process(small_sd1, shapes_data, tmp_path):
    """A real hybrid mesh: 2 "nodes" of 2 ranks each (the environment torchrun --nnodes 2 --nproc-per-node 2 gives
    its ranks: LOCAL_WORLD_SIZE 2, GROUP_RANK 0 / 1), so the weights are sharded within a node and replicated across
    nodes (mesh 2 x 2), batch 1 per rank, against one process with batch 4 (SGD: a
    gradient averaged over the wrong group is off by 2x). The checkpoint it saves resumes in one process."""
    from ot_dist.checkpoint.layout import checkpoints_dir, latest_checkpoint
    from ot_dist.checkpoint.training_state import read_trainer_state

    family, model = "sd1", small_sd1  # the 2-level UNet (conftest.py): 4 ranks, each paying per module
    reference_raw = base_config(model, shapes_data, tmp_path / "ref", family=family, method="full", batch_size=4,
                                **settings(family, "full"))
    Trainer(validate(reference_raw), log=lambda *_: None).train()
    reference = exported(tmp_path / "ref", family, "full")
    hybrid = base_config(model, shapes_data, tmp_path / "hybrid", family=family, method="full", batch_size=1,
                         strategy="fsdp", **{**settings(family, "full"), "fsdp.sharding": "hybrid_shard",
                                             "checkpoint.every_n_steps": STEPS})
    (tmp_path / "cases.json").write_text(json.dumps({"hybrid": hybrid}))
    done = run_ranks(str(REPO / "tests" / "helpers" / "family_cases.py"), str(tmp_path / "cases.json"), nproc=2,
                     nnodes=2, env=ENV, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    got = exported(tmp_path / "hybrid", family, "full")
    diff = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert diff <= TOLERANCE, f"hybrid 2x2: max abs diff {diff:.3g}"
    folder = latest_checkpoint(checkpoints_dir(tmp_path / "hybrid"))
    state = read_trainer_state(folder)
    sizes = [f.stat().st_size for f in sorted(folder.glob("rank-*.safetensors"))]
    # the first replica group (ranks 0, 1) saves the sharded weights; the other only its random state
    assert state["world_size"] == 4 and len(sizes) == 4 and max(sizes[2:]) < 0.01 * min(sizes[:2])
    resumed_raw = {**hybrid, "strategy": "single", "batch_size": 4, "max_steps": STEPS + 1}
    resumed_raw["fsdp"] = {}
    result = Trainer(validate(resumed_raw), log=lambda *_: None, resume="auto").train()
    assert result.first_step == STEPS and result.steps == STEPS + 1
