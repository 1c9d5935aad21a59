"""`embedding.init_from`: continuing a textual-inversion embedding from a file, ot_dist's own or another tool's.

The foreign files are written here by the documented key rules of each tool: ComfyUI's sd1_clip.load_embed and
A1111 / Forge's create_embedding_from_data (`string_to_param` {'*': tensor}, SDXL `clip_l` / `clip_g`, a single
tensor = diffusers' concept), OneTrainer's (`emp_params` for SD 1.x/2.x), diffusers' load_textual_inversion
({token: tensor}). No process launch: the model is loaded and the method prepared in this process."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors.torch import save_file

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.methods.embedding import EmbeddingMethod
from ot_dist.methods.embedding_file import read_embedding_file
from ot_dist.models.loading import load_model
from ot_dist.models.tiny import TEXT_HIDDEN


def prepared(tmp_path, model_path, family="sd1", **embedding):
    config = validate(base_config(model_path, tmp_path, tmp_path / "out", family=family, method="embedding",
                                  **{f"embedding.{k}": v for k, v in embedding.items()}))
    method, model = EmbeddingMethod(config), load_model(config.model)
    (group,) = method.prepare(model)
    return method, model, group


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_an_exported_embedding_continues_from_exactly_its_vectors(tiny_models, tmp_path, family):
    method, model, group = prepared(tmp_path, tiny_models[family], family, vectors=3, token="<tok>")
    with torch.no_grad():
        for p in group.params:
            p.copy_(torch.randn_like(p))  # "trained" vectors, not the init_text rows
    trained = [p.detach().clone() for p in group.params]
    (file,) = method.export(model, tmp_path, suffix="_saved")

    # vectors left out: the file's count (3) is taken
    again, _, continued = prepared(tmp_path, tiny_models[family], family, token="<tok>", init_from=str(file))
    assert again.token_strings() == ["<tok>", "<tok>_1", "<tok>_2"]
    for before, after in zip(trained, continued.params, strict=True):
        assert torch.equal(after.detach(), before)


def test_foreign_sd_layouts_load(tiny_models, tmp_path):
    vectors = torch.randn(2, TEXT_HIDDEN)
    layouts = {
        "a1111": {"string_to_param.*": vectors},  # A1111's {'string_to_param': {'*': t}} as safetensors holds it
        "onetrainer": {"emp_params": vectors},
        "comfyui": {"clip_l": vectors},
        "diffusers": {"<cat-toy>": vectors},
    }
    for name, tensors in layouts.items():
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.half() if name == "diffusers" else v for k, v in tensors.items()}, path)
        _, _, group = prepared(tmp_path, tiny_models["sd1"], token="<x>", init_from=str(path))
        (extra,) = group.params
        tolerance = {"atol": 1e-2, "rtol": 0} if name == "diffusers" else {}  # that file is float16
        torch.testing.assert_close(extra.detach(), vectors, **tolerance)

    one = tmp_path / "one.safetensors"
    save_file({"emb": vectors[0]}, one)  # a 1-D tensor is one vector (A1111 / Forge unsqueeze it)
    _, _, group = prepared(tmp_path, tiny_models["sd1"], token="<x>", init_from=str(one))
    assert torch.equal(group.params[0].detach(), vectors[:1])


def test_sdxl_layout_with_onetrainer_t5_key(tiny_models, tmp_path):
    model = load_model(validate(base_config(tiny_models["sdxl"], tmp_path, tmp_path / "o", family="sdxl")).model)
    widths = [model.text_encoders[n].get_input_embeddings().embedding_dim for n in ("text_encoder", "text_encoder_2")]
    clip_l, clip_g = torch.randn(2, widths[0]), torch.randn(2, widths[1])
    path = tmp_path / "ot.safetensors"
    save_file({"clip_l": clip_l, "clip_g": clip_g, "t5": torch.randn(2, 7)}, path)
    _, _, group = prepared(tmp_path, tiny_models["sdxl"], "sdxl", token="<x>", init_from=str(path))
    assert [torch.equal(a.detach(), b) for a, b in zip(group.params, (clip_l, clip_g))] == [True, True]


def test_refusals(tiny_models, tmp_path):
    sd1 = tiny_models["sd1"]
    pickle = tmp_path / "old.pt"
    torch.save({"string_to_param": {"*": torch.randn(1, TEXT_HIDDEN)}}, pickle)
    with pytest.raises(ConfigError, match=r"old\.pt is not a \.safetensors file.*pickle"):
        validate(base_config(sd1, tmp_path, tmp_path / "o", method="embedding",  # by the config: before any load
                             **{"embedding.init_from": str(pickle)}))
    with pytest.raises(ConfigError, match=r"old\.pt is not a \.safetensors file.*pickle"):
        read_embedding_file(pickle, {"text_encoder": "{token}"})  # and by the reader itself

    three = tmp_path / "three.safetensors"
    save_file({"emp_params": torch.randn(3, TEXT_HIDDEN)}, three)
    with pytest.raises(ConfigError, match=r"embedding.vectors: 2, but embedding.init_from .*three.safetensors holds 3"):
        prepared(tmp_path, sd1, vectors=2, token="<x>", init_from=str(three))
    with pytest.raises(ConfigError, match="must be lower case"):
        prepared(tmp_path, sd1, token="<X>", init_from=str(three))

    wide = tmp_path / "wide.safetensors"
    save_file({"emp_params": torch.randn(1, TEXT_HIDDEN + 1)}, wide)
    with pytest.raises(ConfigError, match=rf"wide.safetensors key 'emp_params' has shape \[1, {TEXT_HIDDEN + 1}\]"):
        prepared(tmp_path, sd1, init_from=str(wide))

    sd_only = tmp_path / "sd_only.safetensors"
    save_file({"clip_l": torch.randn(1, 8)}, sd_only)
    with pytest.raises(ConfigError, match=r"sd_only.safetensors has no 'clip_g' tensor"):
        prepared(tmp_path, tiny_models["sdxl"], "sdxl", init_from=str(sd_only))

    ambiguous = tmp_path / "two.safetensors"
    save_file({"a": torch.randn(1, TEXT_HIDDEN), "b": torch.randn(1, TEXT_HIDDEN)}, ambiguous)
    with pytest.raises(ConfigError, match=r"two.safetensors has \['a', 'b'\]"):
        prepared(tmp_path, sd1, init_from=str(ambiguous))


def test_a_missing_file_is_named_before_the_run_starts(tiny_models, tmp_path):
    from ot_dist.early_checks import check_input_paths
    from ot_dist.errors import InputFileError

    raw = base_config(tiny_models["sd1"], tmp_path, tmp_path / "out", method="embedding",
                      **{"embedding.init_from": str(tmp_path / "gone.safetensors")})
    with pytest.raises(InputFileError, match=r"embedding.init_from: .*gone.safetensors is not a file"):
        check_input_paths(validate(raw))
