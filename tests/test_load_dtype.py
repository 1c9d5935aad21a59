"""Components are read in the narrowest dtype that holds their files exactly (ot_dist/models/load_dtype.py), and what
trains and what is stored is then exactly what reading them in float32 gave: for every family, training method and
storage, the prepared and stored model is compared bit for bit with a float32 load of the same 16-bit folder."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from conftest import base_config
from ot_dist.config.load import validate
from ot_dist.memory.placement import store_component
from ot_dist.methods.registry import build_method
from ot_dist.models import loading
from ot_dist.models.families.registry import FAMILY_NAMES
from ot_dist.models.load_dtype import FLOAT32, exact_dtype, folder_load_dtypes, reading_in_files_dtype
from ot_dist.models.tiny import make_tiny_model


def write_header_only(path, dtypes: dict[str, str]) -> None:
    """A safetensors file whose tensors (one element each) have the given dtype names."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8}
    header, offset = {}, 0
    for name, dtype in dtypes.items():
        header[name] = {"dtype": dtype, "shape": [1], "data_offsets": [offset, offset + sizes[dtype]]}
        offset += sizes[dtype]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


@pytest.mark.parametrize("dtypes, expected", [
    ({"a": "BF16", "b": "BF16"}, torch.bfloat16),
    ({"a": "F16", "steps": "I64"}, torch.float16),  # integer tensors do not count
    ({"a": "BF16", "b": "F8_E4M3"}, torch.bfloat16),  # a float8 cast's values are bfloat16 values
    ({"a": "F16", "b": "F8_E5M2"}, torch.float16),
    ({"a": "BF16", "b": "F16"}, FLOAT32),  # neither 16-bit dtype holds both
    ({"a": "BF16", "norm": "F32"}, FLOAT32),
    ({"steps": "I64"}, FLOAT32),  # nothing floating: the float32 load as before
])
def test_the_narrowest_exact_dtype_of_a_component(tmp_path, dtypes, expected):
    write_header_only(tmp_path / "model.safetensors", dtypes)
    assert exact_dtype([tmp_path / "model.safetensors"]) == expected


def test_every_file_of_a_component_counts_and_an_unreadable_one_means_float32(tmp_path):
    write_header_only(tmp_path / "a.safetensors", {"a": "BF16"})
    write_header_only(tmp_path / "b.safetensors", {"b": "F32"})
    assert exact_dtype([tmp_path / "a.safetensors", tmp_path / "b.safetensors"]) == FLOAT32
    (tmp_path / "c.safetensors").write_bytes(b"not safetensors")
    assert exact_dtype([tmp_path / "a.safetensors", tmp_path / "c.safetensors"]) == FLOAT32
    assert exact_dtype([]) == FLOAT32


def test_a_folders_components_and_their_variant_files(tmp_path):
    (tmp_path / "unet").mkdir()
    write_header_only(tmp_path / "unet" / "diffusion_pytorch_model.safetensors", {"w": "BF16"})
    # a variant is not what from_pretrained reads beside plain weights
    write_header_only(tmp_path / "unet" / "diffusion_pytorch_model.fp16.safetensors", {"w": "F16"})
    (tmp_path / "vae").mkdir()
    write_header_only(tmp_path / "vae" / "diffusion_pytorch_model.fp16.safetensors", {"w": "F16"})
    with reading_in_files_dtype():
        assert folder_load_dtypes(tmp_path, ["unet", "vae", "scheduler"]) == {"unet": torch.bfloat16,
                                                                                "vae": torch.float16}
    # what the tools that compute with the loaded weights get (a merge, an extraction): float32
    assert folder_load_dtypes(tmp_path, ["unet", "vae"]) == {"unet": FLOAT32, "vae": FLOAT32}


# ---------------------------------------------------------------------------------------------------------------------
# the prepared and stored model equals the float32 load's
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def half_models(tmp_path_factory):
    """(family, dtype name) -> a tiny diffusers folder whose weight files hold that dtype."""
    root = tmp_path_factory.mktemp("half_models")

    class Models(dict):
        def __missing__(self, key):
            family, dtype = key
            self[key] = make_tiny_model(root / f"{family}-{dtype}", family, dtype=getattr(torch, dtype))
            return self[key]

    return Models()


def prepared(raw: dict, float32_load: bool):
    """Load the model, let the method prepare it and store every component as the trainer does: (the state of every
    component, the dtypes the denoiser's weights were read in)."""
    config = validate(raw)
    model = loading.load_model(config.model, in_files_dtype=not float32_load)
    read_in = {p.dtype for p in model.denoiser.parameters()}
    torch.manual_seed(config.seed)  # the adapters' initial values, as the trainer seeds them
    groups = build_method(config).prepare(model)
    for name, module in model.named_components():
        store_component(module, name, config, denoiser=module is model.denoiser)
    state = {}
    for name, module in model.named_components():
        for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
            state[f"{name}.{key}"] = tensor.detach()
        for path, sub in module.named_modules():  # tensors kept as plain attributes (stored weights' scales)
            for attr, value in vars(sub).items():
                if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                    state[f"{name}.{path}.{attr}"] = value.detach()
        config_dict = getattr(getattr(module, "config", None), "to_dict", None)
        if config_dict is not None and not isinstance(module.config, dict):  # transformers' config: exports write it
            state[f"{name}.config"] = json.dumps(config_dict(), sort_keys=True, default=str)
    trained = [f"{g.name}:{tuple(p.shape)}:{p.dtype}" for g in groups for p in g.params]
    return state, trained, read_in


def assert_same(ours, theirs) -> None:
    state, trained, _ = ours
    reference, reference_trained, _ = theirs
    assert trained == reference_trained
    assert sorted(state) == sorted(reference)
    different = []
    for key, value in reference.items():
        mine = state[key]
        if isinstance(value, str):
            if mine != value:
                different.append(key)
        elif mine.dtype != value.dtype or mine.shape != value.shape or not torch.equal(
                mine.view(torch.uint8) if mine.dtype.itemsize == 1 else mine, value.view(torch.uint8)
                if value.dtype.itemsize == 1 else value):
            different.append(f"{key} ({mine.dtype} vs {value.dtype})")
    assert not different, f"{len(different)} differ from the float32 load: {different[:6]}"


def _config(half_models, shapes_data, tmp_path, family, dtype="bfloat16", **overrides):
    return base_config(half_models[family, dtype], shapes_data, tmp_path / "out", family=family,
                       resolution=128, **overrides)  # Stable Cascade's buckets are multiples of 128


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_lora_on_a_bfloat16_folder_is_the_float32_loads(half_models, shapes_data, tmp_path,
                                                                      family):
    raw = _config(half_models, shapes_data, tmp_path, family, method="lora", weight_dtype="bfloat16")
    ours = prepared(raw, float32_load=False)
    assert_same(ours, prepared(raw, float32_load=True))


@pytest.mark.parametrize("case", [
    dict(method="full"),  # float32 masters from bfloat16 values
    dict(method="full", trained_weight_dtype="bfloat16", train_dtype="bfloat16"),
    dict(method="lora", weight_dtype="float32"),  # a float32 storage of a bfloat16 model
    dict(method="lora", weight_dtype="float8"),
    dict(method="lora", weight_dtype="nf4"),
    dict(method="lora", weight_dtype="int8"),
    dict(method="lora", **{"lora.variant": "dora"}),
    dict(method="lora", **{"lora.variant": "loha"}),
    dict(method="lora", **{"lora.variant": "lokr"}),
    dict(method="lora", **{"lora.variant": "oft"}),
    dict(method="lora", **{"text_encoder.train": True}),
    dict(method="embedding", **{"embedding.token": "<sks>", "embedding.init_text": "red circle"}),
], ids=lambda case: "-".join(f"{k}={v}" for k, v in case.items()))
def test_methods_and_storages_on_a_bfloat16_sdxl_are_the_float32_loads(half_models, shapes_data, tmp_path,
                                                                         case):
    raw = _config(half_models, shapes_data, tmp_path, "sdxl", **case)
    ours = prepared(raw, float32_load=False)
    assert_same(ours, prepared(raw, float32_load=True))


@pytest.mark.parametrize("family, dtype", [("sdxl", "float16"), ("flux", "float16"), ("sana", "float16")])
def test_a_float16_folder_is_read_in_float16_and_is_the_float32_loads(half_models, shapes_data, tmp_path,
                                                                       family, dtype):
    raw = _config(half_models, shapes_data, tmp_path, family, dtype=dtype, method="lora", weight_dtype="bfloat16")
    ours = prepared(raw, float32_load=False)
    assert ours[2] <= {torch.float16, torch.float32}  # diffusers keeps a model's _keep_in_fp32_modules in float32
    assert torch.float16 in ours[2]
    assert_same(ours, prepared(raw, float32_load=True))


@pytest.mark.parametrize("family", ["sdxl", "flux", "sana", "anima", "wuerstchen_v2"])
def test_a_bfloat16_folder_is_read_in_bfloat16_and_a_float32_one_in_float32(half_models, family_models, shapes_data,
                                                                          tmp_path, family):
    """What the memory saving rests on: the denoiser's weights come in at the files' width."""
    raw = _config(half_models, shapes_data, tmp_path, family, method="lora")
    assert torch.bfloat16 in prepared(raw, float32_load=False)[2]
    raw = base_config(family_models[family], shapes_data, tmp_path / "out32", family=family, method="lora",
                      resolution=128)
    assert prepared(raw, float32_load=False)[2] == {FLOAT32}


@pytest.mark.parametrize("family", ["stable_cascade", "wuerstchen_v2"])
def test_the_decoder_stages_are_read_in_bfloat16_and_are_the_float32_loads(half_models, shapes_data, tmp_path, family):
    """Stable Cascade's and Würstchen's frozen decoder stages (model.decoder), which only sampling runs."""
    from ot_dist.models.families.stable_cascade import TINY_DECODER_FOLDER

    folder = half_models[family, "bfloat16"]
    raw = _config(half_models, shapes_data, tmp_path, family, method="lora", weight_dtype="bfloat16",
                  **{"model.decoder": str(folder / TINY_DECODER_FOLDER)})
    ours = prepared(raw, float32_load=False)
    model = loading.load_model(validate(raw).model, in_files_dtype=True)
    assert torch.bfloat16 in {p.dtype for m in model.sampling_modules() for p in m.parameters()}
    assert_same(ours, prepared(raw, float32_load=True))


def test_one_wan_22_expert_is_read_in_bfloat16_and_is_the_float32_loads(shapes_data, tmp_path):
    """Wan 2.2 A14B: the family reads the chosen expert itself (14 B parameters, 56 GB in float32)."""
    from ot_dist.models.families.registry import get_family

    folder = tmp_path / "a14b"
    pipe = get_family("wan").build_tiny(seed=0, a14b=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.to(torch.bfloat16)
    pipe.save_pretrained(folder)
    raw = base_config(folder, shapes_data, tmp_path / "out", family="wan", method="lora", resolution=128,
                      weight_dtype="bfloat16", **{"model.wan_expert": "low_noise"})
    ours = prepared(raw, float32_load=False)
    assert ours[2] <= {torch.bfloat16, torch.float32} and torch.bfloat16 in ours[2]  # _keep_in_fp32_modules
    assert_same(ours, prepared(raw, float32_load=True))


# ---------------------------------------------------------------------------------------------------------------------
# single files
# ---------------------------------------------------------------------------------------------------------------------


def single_file(folder, family_name: str, target, with_text_encoders: bool = False):
    """The folder's model as the family's single file (its original layout, the folder's dtype)."""
    from ot_dist.config.schema import ModelConfig

    model = loading.load_model(ModelConfig(family=family_name, path=str(folder)), in_files_dtype=True)
    components = dict(model.named_components())
    states = {name: module.state_dict() for name, module in components.items()}
    dtype = next(model.denoiser.parameters()).dtype
    model.family.export_single_file(components, states, target, dtype, with_text_encoders=with_text_encoders)
    return target


@pytest.mark.parametrize("family, with_text_encoders", [("flux", False), ("sd3", True)])
def test_a_bfloat16_single_file_is_read_in_bfloat16_and_is_the_float32_loads(half_models, shapes_data, tmp_path,
                                                                            family, with_text_encoders):
    """The transformer from its file, the other components from the folder (sd3: the file's own text encoders and
    VAE replace the folder's)."""
    folder = half_models[family, "bfloat16"]
    path = single_file(folder, family, tmp_path / "model.safetensors", with_text_encoders)
    raw = base_config(path, shapes_data, tmp_path / "out", family=family, method="lora", resolution=128,
                      **{"model.config": str(folder)})
    ours = prepared(raw, float32_load=False)
    assert ours[2] == {torch.bfloat16}
    assert_same(ours, prepared(raw, float32_load=True))


@pytest.mark.parametrize("family, dtype", [("sdxl", "float16"), ("sd1", "bfloat16")])
def test_a_16_bit_checkpoint_file_is_read_in_its_dtype_and_is_the_float32_loads(half_models, shapes_data, tmp_path,
                                                                               family, dtype):
    """An A1111 / ComfyUI checkpoint (UNet, VAE and text encoders in one original-layout file), as most SD 1.x and
    SDXL models are shared: fp16."""
    from diffusers import DiffusionPipeline

    from ot_dist.models.families.sd_single_file import export_single_file

    folder = half_models[family, dtype]
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=getattr(torch, dtype))
    path = export_single_file(pipe.components, family, tmp_path / "model.safetensors")
    raw = base_config(path, shapes_data, tmp_path / "out", family=family, method="lora", resolution=128,
                      weight_dtype="bfloat16", **{"model.config": str(folder)})
    ours = prepared(raw, float32_load=False)
    assert getattr(torch, dtype) in ours[2]
    assert_same(ours, prepared(raw, float32_load=True))


def test_components_from_comfyui_files_are_read_in_their_dtype_and_are_the_float32_loads(shapes_data, tmp_path):
    """Flux as ComfyUI users hold it: flux1-dev.safetensors, clip_l and ae in bfloat16, t5xxl_fp16 in float16, the
    folder with configs and tokenizers only."""
    from safetensors.torch import load_file
    from test_component_files import comfy_clip, comfy_t5, configs_only, ldm_vae, randomized, save, transformer_file

    from ot_dist.models.families.registry import get_family

    family = get_family("flux")
    pipe = family.build_tiny()
    for name in ("text_encoder", "text_encoder_2", "vae"):
        randomized(getattr(pipe, name))
    half = {k: v.to(torch.bfloat16) for k, v in pipe.transformer.state_dict().items()}
    pipe.transformer.load_state_dict(half)
    folder = configs_only(pipe, tmp_path / "config")
    files = {"text_encoder": save({k: v.to(torch.bfloat16) for k, v in comfy_clip(pipe.text_encoder).items()},
                                  tmp_path / "clip_l.safetensors"),
             "text_encoder_2": save({k: v.to(torch.float16) for k, v in comfy_t5(pipe.text_encoder_2).items()},
                                    tmp_path / "t5xxl_fp16.safetensors"),
             "vae": save({k: v.to(torch.bfloat16) for k, v in ldm_vae(pipe.vae).items()}, tmp_path / "ae.safetensors")}
    single = transformer_file(family, pipe, tmp_path / "flux1-dev.safetensors")
    save({k: v.to(torch.bfloat16) for k, v in load_file(single).items()}, single)
    raw = base_config(single, shapes_data, tmp_path / "out", family="flux", method="lora", resolution=128,
                      weight_dtype="bfloat16", **{"model.config": str(folder),
                                                  "model.component_files": {k: str(v) for k, v in files.items()}})
    config = validate(raw)
    loaded = loading.load_model(config.model, in_files_dtype=True)
    assert {p.dtype for p in loaded.pipeline.text_encoder_2.parameters()} == {torch.float16}
    assert {p.dtype for p in loaded.pipeline.text_encoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.vae.parameters()} == {torch.bfloat16}
    ours = prepared(raw, float32_load=False)
    assert_same(ours, prepared(raw, float32_load=True))


# ---------------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, overrides", [
    ("sdxl", {"weight_dtype": "bfloat16", "train_dtype": "bfloat16", "data.cache_latents": True,
              "sampling.prompts": [{"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}]}),
    ("flux", {"weight_dtype": "float8", "offload_frozen_components": True}),
])
def test_a_lora_run_on_a_bfloat16_model_is_the_float32_loads(half_models, shapes_data, tmp_path, monkeypatch, family,
                                                            overrides):
    """End to end, the trainer reading the model in its files' dtype: the same losses, LoRA file and samples."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from ot_dist.train import trainer as trainer_module

    runs = {}
    for name, in_files_dtype in (("ours", True), ("float32", False)):
        load = loading.load_model
        monkeypatch.setattr(trainer_module, "load_model", lambda config, **kwargs: load(config, **{
            **kwargs, "in_files_dtype": in_files_dtype}))
        run = base_config(half_models[family, "bfloat16"], shapes_data, tmp_path / name, family=family, method="lora",
                          resolution=128, max_steps=2, **overrides)
        result = trainer_module.Trainer(validate(run), log=lambda *_: None).train()
        samples = sorted((tmp_path / name / "samples").rglob("*.png"))
        runs[name] = (result.losses, load_file(tmp_path / name / "lora.safetensors"),
                      [np.asarray(Image.open(p)) for p in samples])  # the files' headers hold their run's dates
    ours, reference = runs["ours"], runs["float32"]
    assert ours[0] == reference[0]
    assert ours[1].keys() == reference[1].keys() and all(torch.equal(v, reference[1][k]) for k, v in ours[1].items())
    assert len(ours[2]) == len(reference[2]) == len(overrides.get("sampling.prompts", []))
    assert all(np.array_equal(a, b) for a, b in zip(ours[2], reference[2]))


# ---------------------------------------------------------------------------------------------------------------------
# ot-dist lora merge
# ---------------------------------------------------------------------------------------------------------------------


def random_loras(base, shapes_data, tmp_path, seeds=(0, 1)) -> list[str]:
    """LoRA files of the UNet and the text encoder with random up matrices, one per seed."""
    from test_lora_tools import with_random_up_matrices

    from ot_dist.methods.lora import LoraMethod

    loras = []
    for seed in seeds:
        config = validate(base_config(base, shapes_data, tmp_path / f"lora{seed}", method="lora",
                                      **{"lora.rank": 4, "text_encoder.train": True}))
        model = loading.load_model(config.model)
        LoraMethod(config).prepare(model)
        with_random_up_matrices(model, seed)
        loras.append(str(LoraMethod(config).export(model, tmp_path / f"lora{seed}")[0]))
    return loras


@pytest.mark.parametrize("fmt, dtype_name", [("diffusers", "float32"), ("single_file", "bfloat16")])
def test_merging_into_a_bfloat16_base_writes_what_the_float32_load_writes(half_models, shapes_data, tmp_path,
                                                                         monkeypatch, fmt, dtype_name):
    """Two LoRAs (UNet and text encoder) merged one after the other into a base read in its files' bfloat16: each
    merged weight stays float32 until the export casts it once, as from the float32 load."""
    from safetensors.torch import load_file

    from ot_dist.lora_tools import merge

    base = half_models["sd1", "bfloat16"]
    loras = random_loras(base, shapes_data, tmp_path)
    written = {}
    reads = []
    load = loading.load_model
    for name, in_files_dtype in (("ours", True), ("float32", False)):
        monkeypatch.setattr(loading, "load_model", lambda config, **kwargs: reads.append(kwargs) or load(config, **{
            **kwargs, "in_files_dtype": in_files_dtype}))
        out = merge.merge_command(str(base), "sd1", loras, [0.7, 0.5], str(tmp_path / name / "merged"), fmt, None,
                                  dtype_name, log=lambda *_: None)
        files = sorted(out.rglob("*.safetensors")) if out.is_dir() else [out]
        written[name] = [{k: v for k, v in load_file(f).items()} for f in files]
    assert reads[0] == {"in_files_dtype": True}  # what merge_command asks for
    ours, reference = written["ours"], written["float32"]
    assert len(ours) == len(reference) > 0
    for a, b in zip(ours, reference):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the merge changed the weights (the comparison is not of two copies of the base)
    source = load_file(base / "unet" / "diffusion_pytorch_model.safetensors")
    if fmt == "diffusers":
        unet = load_file(tmp_path / "ours" / "merged" / "unet" / "diffusion_pytorch_model.safetensors")
        assert any(not torch.equal(unet[k], v.float()) for k, v in source.items())


def test_extracting_from_bfloat16_models_writes_what_the_float32_loads_write(half_models, shapes_data, tmp_path,
                                                                           monkeypatch):
    """`lora extract` reads both models in their files' dtype (it subtracts them in float32): the same file."""
    from safetensors.torch import load_file

    from ot_dist.lora_tools import extract, merge

    base = half_models["sd1", "bfloat16"]
    tuned = merge.merge_command(str(base), "sd1", random_loras(base, shapes_data, tmp_path, seeds=(3,)), [1.0],
                                str(tmp_path / "tuned"), "diffusers", None, "bfloat16", log=lambda *_: None)
    written, reads = {}, []
    load = loading.load_model
    for name, in_files_dtype in (("ours", True), ("float32", False)):
        monkeypatch.setattr(loading, "load_model", lambda config, **kwargs: reads.append(kwargs) or load(config, **{
            **kwargs, "in_files_dtype": in_files_dtype}))
        out = tmp_path / f"{name}.safetensors"
        kept = extract.extract_command(str(base), str(tuned), "sd1", 4, str(out), 0.0, "float32", log=lambda *_: None)
        written[name] = (load_file(out), kept)
    assert reads[0] == {"in_files_dtype": True}
    (ours, ours_kept), (reference, reference_kept) = written["ours"], written["float32"]
    assert ours and ours.keys() == reference.keys() and ours_kept == reference_kept
    assert all(torch.equal(ours[k], reference[k]) for k in ours)


@pytest.mark.parametrize("weight_dtype", ["float8", "nf4", "int8"])
def test_a_quantized_storage_never_holds_the_frozen_weights_in_float32_at_once(half_models, shapes_data, tmp_path,
                                                                               monkeypatch, weight_dtype):
    """A base stored in float8 / nf4 / int8 is quantized from the weights as loaded (bfloat16 here), each layer's
    float32 values made as it is quantized: the component is not cast whole to float32 first (a Flux.1 transformer:
    ~48 GB of RAM before any weight was quantized). What is stored is the float32 load's (the test above)."""
    from ot_dist.memory import placement

    quantize = placement.QUANTIZERS[weight_dtype]
    float32_at_entry = {}

    def counted(component, *args):
        float32_at_entry[type(component).__name__] = sum(
            p.nbytes for p in component.parameters() if not p.requires_grad and p.dtype == torch.float32)
        return quantize(component, *args)

    monkeypatch.setitem(placement.QUANTIZERS, weight_dtype, counted)
    raw = _config(half_models, shapes_data, tmp_path, "sdxl", method="lora", weight_dtype=weight_dtype)
    prepared(raw, float32_load=False)
    assert float32_at_entry and set(float32_at_entry.values()) == {0}, float32_at_entry
