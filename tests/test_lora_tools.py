"""`ot-dist lora merge | resize | extract` (issue 22) and LoRA files from other trainers (issue 24), on the tiny models.

The reference for a merge is diffusers' own: `load_lora_weights` + `fuse_lora(lora_scale=w)` of the same file on
the same base. A LoRA "made by another trainer" is written here by kohya's naming rules (sd-scripts
networks/lora.py: `lora_unet_` / `lora_te_` + the module path with "_" for ".", the text encoder named with
transformers 4's `text_model.` level; `.lora_down.weight` / `.lora_up.weight` and an `.alpha` per module), with
alpha != rank and a 3x3 conv (LoCon) module, so a tool that ignores alpha or conv shapes fails.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks
from diffusers import DiffusionPipeline
from safetensors.torch import load_file, save_file

from ot_dist.config.load import validate
from ot_dist.lora_tools.files import Pair, read_lora_file
from ot_dist.lora_tools.lowrank import low_rank_pair
from ot_dist.methods.lora import LoraMethod
from ot_dist.models.loading import load_model

RANK, ALPHA = 4, 2.0
MODELS = {"sd1": "tiny_models", "sd2": "tiny_models", "sdxl": "tiny_models", "flux": "family_models",
          "sd3": "family_models", "chroma": "family_models", "pixart_sigma": "family_models",
          "stable_cascade": "family_models", "qwen_image": "family_models", "z_image": "family_models",
          "flux2": "family_models"}
# The CLIP text encoders diffusers' load_lora_weights takes, per family (SD3: CLIP-L and CLIP-G; Chroma has none)
SETTINGS = {"stable_cascade": {"resolution": 128}}  # whole EfficientNet latents: sides of 128 px
CLIP_PARTS = {"sd1": ("text_encoder",), "sd2": ("text_encoder",), "sdxl": ("text_encoder",),
              "flux": ("text_encoder",), "sd3": ("text_encoder", "text_encoder_2")}


def model_dir(request, family) -> Path:
    return request.getfixturevalue(MODELS[family])[family]


def random_lora_file(request, family, shapes_data, out: Path, layout="auto", seed=0) -> Path:
    """ot_dist's exported LoRA (denoiser + text encoders where the family has them) with random up matrices
    standing in for training."""
    return random_lora(request, family, shapes_data, out, layout, seed)[1]


def random_lora(request, family, shapes_data, out: Path, layout="auto", seed=0, text_parts=None):
    """(the in-memory model with its random adapters, the exported file); `text_parts`: the text encoders that get
    adapters (default: CLIP_PARTS)."""
    text = {f"{part}.train": True for part in (CLIP_PARTS.get(family, ()) if text_parts is None else text_parts)}
    config = validate(base_config(model_dir(request, family), shapes_data, out, family=family, method="lora",
                                  **{"lora.rank": RANK, "lora.alpha": ALPHA, "lora.file_layout": layout}, **text,
                                  **SETTINGS.get(family, {})))
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    with_random_up_matrices(model, seed)
    path = LoraMethod(config).export(model, out)[0]  # lora.safetensors; a family may write files beside it
    return model, path


def with_random_up_matrices(model, seed: int) -> None:
    """Random LoRA up matrices (zero as prepared) standing in for training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for part in model.parts().values():
            for name, p in part.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def diffusers_fused(base: Path, lora: Path, scale: float) -> DiffusionPipeline:
    pipe = DiffusionPipeline.from_pretrained(base)
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora(lora_scale=scale, components=list(pipe._lora_loadable_modules))
    pipe.unload_lora_weights()
    return pipe


def assert_same_weights(ours: DiffusionPipeline, reference: DiffusionPipeline, base: DiffusionPipeline):
    changed = 0
    for name in ("unet", "transformer", "text_encoder", "text_encoder_2"):
        if getattr(reference, name, None) is None:
            continue
        mine, theirs, before = (getattr(p, name).state_dict() for p in (ours, reference, base))
        for key, value in theirs.items():
            torch.testing.assert_close(mine[key].float(), value.float(), rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")
            changed += not torch.equal(value, before[key])
    assert changed > 0  # the LoRA changed something: the comparison is not base == base


def run_cli(*args) -> subprocess.CompletedProcess:
    """`ot-dist ARGS` in this process (the tools' own cost is small; a new interpreter's imports are not)."""
    import contextlib
    import io

    from ot_dist.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_process(*args) -> subprocess.CompletedProcess:
    """`python -m ot_dist ARGS` as its own process (its exit code and stderr as a user sees them: an uncaught error
    prints its traceback there), forked from the preloaded test server (tests/forked_ranks.py): 1 CPU s instead of a
    new interpreter's ~5."""
    return run_ranks("-m", "ot_dist", *args, nproc=1, timeout=300)


@pytest.mark.parametrize("family,layout", [("sd1", "kohya"), ("sd1", "diffusers"), ("sd2", "kohya"),
                                           ("sdxl", "kohya"), ("flux", "diffusers"), ("sd3", "diffusers"),
                                           ("chroma", "diffusers"), ("qwen_image", "diffusers"),
                                           ("z_image", "diffusers"), ("flux2", "diffusers")])
def test_merge_equals_diffusers_fuse(request, shapes_data, tmp_path, family, layout):
    lora = random_lora_file(request, family, shapes_data, tmp_path / "o", layout)
    base = model_dir(request, family)
    done = run_cli("lora", "merge", base, lora, "--family", family, "--weight", 0.7, "--out", tmp_path / "merged",
                   "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout, done.stdout  # every module of the file was found
    assert_same_weights(DiffusionPipeline.from_pretrained(tmp_path / "merged"), diffusers_fused(base, lora, 0.7),
                        DiffusionPipeline.from_pretrained(base))


def kohya_file_from_another_trainer(unet, text_encoder, path: Path) -> dict[str, Pair]:
    """Module path -> Pair, written under kohya's names with alpha != rank, incl. a 3x3 conv (LoCon)."""
    generator = torch.Generator().manual_seed(3)
    modules = {"unet": [n for n, m in unet.named_modules() if n.endswith("attn1.to_q") or n.endswith("attn2.to_v")]
               + ["down_blocks.0.resnets.0.conv1"],
               # (with out_proj: diffusers recognises a kohya text-encoder LoRA only when some out_proj is in it)
               "text_encoder": [n for n, m in text_encoder.named_modules() if n.endswith(("q_proj", "out_proj"))]}
    tensors, pairs = {}, {}
    for part, paths in modules.items():
        owner = unet if part == "unet" else text_encoder
        for module_path in paths:
            weight = owner.get_submodule(module_path).weight
            down = torch.randn(2, *weight.shape[1:], generator=generator) * 0.1
            up = torch.randn(weight.shape[0], 2, *([1, 1] if weight.dim() == 4 else []), generator=generator) * 0.1
            name = ("lora_unet_" + module_path if part == "unet" else "lora_te_text_model_" + module_path).replace(".", "_")
            tensors |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                        f"{name}.alpha": torch.tensor(1.5)}
            pairs[(part, module_path)] = Pair(down, up, 1.5)
    save_file(tensors, str(path), metadata={"ss_network_module": "networks.lora"})
    return pairs


def test_a_kohya_lora_from_another_trainer_merges_like_diffusers(tiny_models, tmp_path):
    base = tiny_models["sd1"]
    pipe = DiffusionPipeline.from_pretrained(base)
    lora = tmp_path / "other_trainer.safetensors"
    kohya_file_from_another_trainer(pipe.unet, pipe.text_encoder, lora)
    done = run_cli("lora", "merge", base, lora, "--family", "sd1", "--out", tmp_path / "merged", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert_same_weights(DiffusionPipeline.from_pretrained(tmp_path / "merged"), diffusers_fused(base, lora, 1.0), pipe)


@pytest.mark.parametrize("unet_names", ["original", "diffusers"])
def test_a_kohya_sdxl_lora_merges_like_diffusers_with_either_unet_names(request, shapes_data, tmp_path, unet_names):
    """kohya sd-scripts names SDXL's UNet modules by their original (SGM) paths (networks/lora.py over
    library/sdxl_original_unet.py: `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`), as ot_dist writes
    them; ot_dist's earlier files and diffusers-based scripts use the diffusers paths
    (`lora_unet_down_blocks_1_attentions_0_...`). ComfyUI, A1111 / Forge and diffusers read both; merge applies
    either as diffusers does, without a warning. The original names are the ones ot_dist's single-file export gives
    the same weights."""
    from ot_dist.models.families.registry import get_family

    base = model_dir(request, "sdxl")
    ours = random_lora_file(request, "sdxl", shapes_data, tmp_path / "o")
    pipe = DiffusionPipeline.from_pretrained(base)
    components = {name: pipe.components[name] for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    get_family("sdxl").export_single_file(components, {n: m.state_dict() for n, m in components.items()},
                                          tmp_path / "sdxl.safetensors", torch.float32)
    prefix = "model.diffusion_model."
    original_of = {value.numpy().tobytes(): key[len(prefix):-len(".weight")]
                   for key, value in load_file(tmp_path / "sdxl.safetensors").items()
                   if key.startswith(prefix) and key.endswith(".weight") and value.dim() > 1}
    names = {"lora_unet_" + original_of[module.weight.detach().numpy().tobytes()].replace(".", "_"): path
             for path, module in pipe.unet.named_modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))}
    tensors = load_file(ours)
    assert {key.split(".")[0] for key in tensors if key.startswith("lora_unet_")} <= set(names)  # written as kohya's
    if unet_names == "diffusers":
        tensors = {"lora_unet_" + names[name].replace(".", "_") + "." + suffix if name in names else key: value
                   for key, value in tensors.items() for name, suffix in [key.split(".", 1)]}
        assert any(key.startswith("lora_unet_down_blocks_") for key in tensors)
    lora = tmp_path / "kohya_sdxl.safetensors"
    save_file(tensors, str(lora))
    done = run_cli("lora", "merge", base, lora, "--family", "sdxl", "--out", tmp_path / "merged", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout, done.stdout
    assert_same_weights(DiffusionPipeline.from_pretrained(tmp_path / "merged"), diffusers_fused(base, lora, 1.0), pipe)


def test_a_lora_file_starts_training_where_it_left_off(tiny_models, shapes_data, tmp_path):
    """lora.init_from: the adapters start as the file's (kohya file of another trainer, rank 2, alpha 1.5): the
    model before the first step computes what the merged model computes."""
    base = tiny_models["sd1"]
    pipe = DiffusionPipeline.from_pretrained(base)
    lora = tmp_path / "other_trainer.safetensors"
    pairs = kohya_file_from_another_trainer(pipe.unet, pipe.text_encoder, lora)
    targets = sorted({p.rsplit(".", 1)[-1] for _, p in pairs if "conv" not in p} | {"conv1"})
    config = validate(base_config(base, shapes_data, tmp_path / "o", method="lora",
                                  **{"lora.rank": 2, "lora.alpha": 4.0, "lora.init_from": str(lora),
                                     "lora.unet_targets": targets, "lora.text_encoder_targets": ["q_proj", "out_proj"],
                                     "text_encoder.train": True}))
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    for (part, path), pair in pairs.items():
        layer = model.part(part).get_submodule(path)
        expected = (pair.up.flatten(1) @ pair.down.flatten(1)).reshape(layer.base_layer.weight.shape) * 1.5 / 2
        torch.testing.assert_close(layer.get_delta_weight("default"), expected, rtol=1e-5, atol=1e-7)
    untouched = [n for n, layer in model.denoiser.named_modules() if hasattr(layer, "lora_B") and
                 ("unet", n) not in pairs]
    assert untouched  # modules the file does not have start at zero change, as a fresh LoRA
    for n in untouched:
        assert model.denoiser.get_submodule(n).lora_B["default"].weight.abs().max() == 0


def test_init_from_refuses_a_rank_that_differs(tiny_models, shapes_data, tmp_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_models["sd1"])
    lora = tmp_path / "rank2.safetensors"
    kohya_file_from_another_trainer(pipe.unet, pipe.text_encoder, lora)
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "o", method="lora",
                                  **{"lora.rank": 8, "lora.init_from": str(lora)}))
    from ot_dist.errors import UserError

    model = load_model(config.model)
    with pytest.raises(UserError, match="lora.init_from.*rank 2.*lora.rank 8"):
        LoraMethod(config).prepare(model)


def test_resize_keeps_the_best_low_rank_change_in_the_same_layout(request, shapes_data, tmp_path):
    lora = random_lora_file(request, "sd1", shapes_data, tmp_path / "o")  # rank 4, kohya, alpha 2
    original = read_lora_file(lora)
    done = run_cli("lora", "resize", lora, "--rank", 2, "--out", tmp_path / "r2.safetensors")
    assert done.returncode == 0, done.stderr
    assert "energy kept" in done.stdout
    resized = read_lora_file(tmp_path / "r2.safetensors")
    assert resized.layout == "kohya" and set(resized.pairs) == set(original.pairs)
    assert resized.metadata["ss_network_dim"] == "2"
    for name, pair in original.pairs.items():
        assert resized.pairs[name].rank == 2
        u, s, vh = torch.linalg.svd(pair.delta().flatten(1))
        best = (u[:, :2] * s[:2]) @ vh[:2]  # Eckart-Young: the best rank-2 approximation
        torch.testing.assert_close(resized.pairs[name].delta().flatten(1), best, rtol=1e-4, atol=1e-6)
    # at the file's own rank the change is kept whole, and diffusers reads the result
    run_cli("lora", "resize", lora, "--rank", 4, "--out", tmp_path / "r4.safetensors")
    same = read_lora_file(tmp_path / "r4.safetensors")
    for name, pair in original.pairs.items():
        torch.testing.assert_close(same.pairs[name].delta(), pair.delta(), rtol=1e-4, atol=1e-6)
    base = tiny_models_path = request.getfixturevalue("tiny_models")["sd1"]
    assert_same_weights(diffusers_fused(base, tmp_path / "r4.safetensors", 1.0), diffusers_fused(base, lora, 1.0),
                        DiffusionPipeline.from_pretrained(tiny_models_path))


def test_a_resized_diffusers_layout_file_loads_in_diffusers_at_its_new_rank(request, shapes_data, tmp_path):
    """diffusers builds its adapters from a file's `lora_adapter_metadata` when there is one: the resized file must
    not keep the old rank's (it would not load), and diffusers' fuse of it equals ot_dist's merge."""
    base = model_dir(request, "flux")
    lora = random_lora_file(request, "flux", shapes_data, tmp_path / "o")
    assert "lora_adapter_metadata" in read_lora_file(lora).metadata
    done = run_cli("lora", "resize", lora, "--rank", 2, "--out", tmp_path / "r2.safetensors")
    assert done.returncode == 0, done.stderr
    done = run_cli("lora", "merge", base, tmp_path / "r2.safetensors", "--family", "flux", "--out", tmp_path / "m",
                   "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    reference = diffusers_fused(base, tmp_path / "r2.safetensors", 1.0)
    assert_same_weights(DiffusionPipeline.from_pretrained(tmp_path / "m"), reference,
                        DiffusionPipeline.from_pretrained(base))


@pytest.mark.parametrize("family", ["sd1", "flux"])
def test_extract_recovers_a_low_rank_finetune(request, shapes_data, tmp_path, family):
    """TUNED = BASE + a rank-3 change on some modules: extracting at rank 3 gives a file whose diffusers fuse is
    TUNED again; at rank 1 the kept energy is reported below 1."""
    base = model_dir(request, family)
    lora = random_lora_file(request, family, shapes_data, tmp_path / "o", seed=5)
    done = run_cli("lora", "merge", base, lora, "--family", family, "--out", tmp_path / "tuned", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    done = run_cli("lora", "extract", base, tmp_path / "tuned", "--family", family, "--rank", RANK,
                   "--out", tmp_path / "x.safetensors", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    extracted = read_lora_file(tmp_path / "x.safetensors")
    assert set(extracted.pairs) == set(read_lora_file(lora).pairs)  # the changed modules, under the family's names
    assert_same_weights(diffusers_fused(base, tmp_path / "x.safetensors", 1.0),
                        DiffusionPipeline.from_pretrained(tmp_path / "tuned"), DiffusionPipeline.from_pretrained(base))
    done = run_cli("lora", "extract", base, tmp_path / "tuned", "--family", family, "--rank", 1,
                   "--out", tmp_path / "x1.safetensors")
    assert done.returncode == 0, done.stderr
    kept = float(done.stdout.split("energy kept min ")[1].split(",")[0])
    assert 0 < kept < 1


def test_low_rank_pair_of_a_conv_change():
    delta = torch.randn(6, 3, 3, 3)
    pair, kept = low_rank_pair(delta, 27)
    assert kept == pytest.approx(1.0)
    torch.testing.assert_close(pair.delta(), delta, rtol=1e-4, atol=1e-5)


def test_bad_files_are_named(tiny_models, tmp_path):
    junk = tmp_path / "junk.safetensors"
    save_file({"model.diffusion_model.x.hada_w1_a": torch.zeros(2, 2)}, str(junk))
    done = run_process("lora", "resize", junk, "--rank", 2, "--out", tmp_path / "o.safetensors")
    assert done.returncode != 0 and "junk.safetensors" in done.stderr and "Traceback" not in done.stderr
    other = tmp_path / "other.safetensors"
    save_file({"lora_unet_not_a_module.lora_down.weight": torch.zeros(2, 4),
               "lora_unet_not_a_module.lora_up.weight": torch.zeros(4, 2)}, str(other))
    done = run_process("lora", "merge", tiny_models["sd1"], other, "--family", "sd1", "--out", tmp_path / "m")
    assert done.returncode != 0 and "none of its 1 modules" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "m").exists()


# ComfyUI comfy/lora.py model_lora_keys_clip (@ 41444b5236c613ee5ff7d09aa620f94b702f30eb): a diffusers-layout CLIP
# LoRA module is "text_encoder.text_model.encoder.layers.<b>.<c>" for c in LORA_CLIP_MAP's keys (clip_l).
COMFY_CLIP_MODULES = ("mlp.fc1", "mlp.fc2", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj",
                      "self_attn.out_proj")


def test_flux_clip_lora_is_named_as_comfyui_reads_it(request, shapes_data, tmp_path):
    lora = random_lora_file(request, "flux", shapes_data, tmp_path / "o")
    modules = {k.rsplit(".lora_", 1)[0] for k in load_file(lora) if k.startswith("text_encoder.")}
    comfy = {f"text_encoder.text_model.encoder.layers.{b}.{c}" for b in range(32) for c in COMFY_CLIP_MODULES}
    assert modules and modules <= comfy, sorted(modules - comfy)[:3]


def test_a_merged_single_file_keeps_the_v_pred_and_ztsnr_markers(tmp_path):
    """`ot-dist lora merge --format single-file` into a v-prediction, zero-terminal-SNR model: the merged file carries
    `v_pred` and `ztsnr` (what ComfyUI and Forge choose the sampling by; tests/test_single_file.py), as a training
    export of the same model does. One kohya-named module stands in for a LoRA."""
    import json

    from safetensors import safe_open

    from ot_dist.lora_tools.merge import merge_command
    from ot_dist.models.tiny import make_tiny_model

    base = make_tiny_model(tmp_path / "v", "sd1", prediction_type="v_prediction")
    scheduler_file = base / "scheduler" / "scheduler_config.json"
    scheduler_file.write_text(json.dumps({**json.loads(scheduler_file.read_text()), "rescale_betas_zero_snr": True}))
    path = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    weight = DiffusionPipeline.from_pretrained(base).unet.get_submodule(path).weight
    name = "lora_unet_" + path.replace(".", "_")
    save_file({f"{name}.lora_down.weight": torch.full((2, weight.shape[1]), 0.1),
               f"{name}.lora_up.weight": torch.full((weight.shape[0], 2), 0.1), f"{name}.alpha": torch.tensor(2.0)},
              str(tmp_path / "lora.safetensors"))
    out = merge_command(str(base), "sd1", [str(tmp_path / "lora.safetensors")], [1.0], str(tmp_path / "m.safetensors"),
                        "single-file", None, "float32", log=lambda *_: None)
    with safe_open(str(out), framework="pt") as fh:
        assert {"v_pred", "ztsnr"} <= set(fh.keys())


@pytest.mark.parametrize("command", [["merge", "--family", "sd1", "BASE", "LORA"], ["resize", "LORA", "--rank", "2"],
                                     ["extract", "--family", "sd1", "--rank", "2", "BASE", "TUNED"]])
def test_an_out_that_cannot_be_written_is_named_before_any_model_loads(tmp_path, capsys, command):
    """A file where --out's folder should be was a traceback after the merge / SVD; the inputs named here do not
    even exist, so the answer comes before anything is read."""
    from ot_dist.cli import main

    (tmp_path / "taken").write_text("a file")
    out = str(tmp_path / "taken" / "merged.safetensors")
    assert main(["lora", *command, "--out", out]) == 3
    err = capsys.readouterr().err
    assert f"--out {out}: its folder {tmp_path / 'taken'} is not a folder" in err and "Traceback" not in err


def test_extract_skips_what_a_half_precision_save_only_rounded_and_ranks_convolutions_apart(tiny_models, tmp_path):
    """A finetune saved in float16 beside a float32 base (SD 1.5's, the usual case) differs from it in every module
    by the rounding: only the modules training changed are extracted (before: all of them, text encoder included,
    where kohya's extract_lora_from_models.py finds the text encoder unchanged). `--conv-rank` is the rank of 3x3
    convolutions only (kohya's --conv_dim), a 1x1 one (SD 1.x's proj_in) gets --rank."""
    base = tiny_models["sd1"]
    pipe = DiffusionPipeline.from_pretrained(base)
    generator = torch.Generator().manual_seed(3)
    unet = pipe.unet
    changed = {"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q": unet.down_blocks[0].attentions[0]
               .transformer_blocks[0].attn1.to_q, "lora_unet_down_blocks_0_attentions_0_proj_in":
               unet.down_blocks[0].attentions[0].proj_in, "lora_unet_down_blocks_0_resnets_0_conv1":
               unet.down_blocks[0].resnets[0].conv1}
    with torch.no_grad():
        for module in changed.values():
            module.weight.add_(torch.randn(module.weight.shape, generator=generator) * 0.05)
    pipe.to(torch.float16).save_pretrained(tmp_path / "tuned")
    done = run_cli("lora", "extract", base, tmp_path / "tuned", "--family", "sd1", "--rank", 4, "--conv-rank", 2,
                   "--out", tmp_path / "x.safetensors")
    assert done.returncode == 0, done.stderr
    extracted = read_lora_file(tmp_path / "x.safetensors")
    assert {name: pair.rank for name, pair in extracted.pairs.items()} == {
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q": 4,
        "lora_unet_down_blocks_0_attentions_0_proj_in": 4, "lora_unet_down_blocks_0_resnets_0_conv1": 2}
