"""The config surface: every shipped config validates, errors name the key, --set is typed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ot_dist.models.families.registry import FAMILY_NAMES
from ot_dist.cli import main
from ot_dist.config.load import apply_override, load_config, validate
from ot_dist.config.reference import render_reference
from ot_dist.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

MINIMAL = {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o", "data": {"path": "d"}}


def test_every_shipped_config_is_in_the_readme_table_and_every_named_config_exists():
    """A config nobody can find is dead weight, and a path the docs show must exist."""
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {m for doc in documents for m in re.findall(r"configs/([A-Za-z0-9_.-]+\.yaml)", doc.read_text())}
    table = set(re.findall(r"^\| `configs/([A-Za-z0-9_.-]+\.yaml)` \|", (REPO / "README.md").read_text(), re.M))
    shipped = {p.name for p in CONFIGS}
    assert "demo.yaml" in shipped
    assert shipped - table == set(), "configs missing from README's table of configs"
    assert named - shipped == set(), "configs named in README / docs that do not exist"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert config.model.family in FAMILY_NAMES


def test_reference_is_current():
    assert (REPO / "configs" / "REFERENCE.md").read_text().strip() == render_reference().strip(), (
        "configs/REFERENCE.md is stale: run `ot-dist config reference > configs/REFERENCE.md`"
    )


def test_public_contract_keys_exist():
    config = validate(MINIMAL)
    for key in (
        "model.family", "model.path", "method", "output_dir", "seed", "batch_size", "gradient_accumulation_steps",
        "epochs", "max_steps", "learning_rate", "train_dtype", "weight_dtype", "gradient_checkpointing",
        "optimizer.name", "scheduler.name", "strategy", "resolution",
    ):
        node = config
        for part in key.split("."):
            node = getattr(node, part)


def test_set_overrides_are_yaml_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {family: sd1, path: m}\nmethod: full\noutput_dir: o\ndata: {path: d}\n")
    config = load_config(
        path,
        ["learning_rate=1e-4", "lora.rank=8", "max_steps=null", "text_encoder.train=true", "data.crop=random",
         "lora.unet_targets=[to_q, to_v]"],
    )
    assert config.learning_rate == 1e-4 and config.lora.rank == 8 and config.max_steps is None
    assert config.text_encoder.train is True and config.data.crop == "random"
    assert config.lora.unet_targets == ["to_q", "to_v"]


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"lerning_rate": 1}, ["lerning_rate: unknown key", "did you mean 'learning_rate'"]),
        ({"model": {"family": "sd1", "path": "m", "famliy": "x"}}, ["model.famliy: unknown key", "family, guidance_scale, inpainting, path"]),
        ({"method": "dreambooth"}, ["method:", "'full', 'lora' or 'embedding'"]),
        ({"batch_size": "four"}, ["batch_size:", "integer"]),
        ({"batch_size": 0}, ["batch_size:", "greater than or equal to 1"]),
        ({"train_dtype": "fp8"}, ["train_dtype:", "'float32', 'bfloat16' or 'float16'"]),
        ({"strategy": "deepspeed"}, ["strategy:", "'single'"]),
        ({"text_encoder_2": {"train": True}}, ["text_encoder_2: model family sd1 has no text_encoder_2"]),
        ({"method": "embedding", "unet": {"train": True}}, ["unet.train: method embedding trains only"]),
        ({"method": "full", "unet": {"train": False}}, ["nothing to train"]),
        ({"resolution": 500}, ["resolution:", "multiple of 8"]),
        # OneTrainer's fixed size: not "Input should be a valid integer" twice, but what ot_dist takes instead
        ({"resolution": "1024x768"}, ["resolution: '1024x768' is a fixed width x height", "about 887 for 1024x768"]),
        ({"output_dir": None}, ["output_dir:"]),
    ],
)
def test_bad_config_names_the_key(change, expected):
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, **change})
    for text in expected:
        assert text in str(err.value)


def test_missing_required_key():
    raw = dict(MINIMAL)
    del raw["method"]
    with pytest.raises(ConfigError, match="method: required key is missing"):
        validate(raw)


def test_set_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="seed is a value, not a section"):
        apply_override({"seed": 1}, "seed.x=2")


def test_config_check_cli(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    (tmp_path / "m").mkdir(), (tmp_path / "d").mkdir()  # config check also checks that the paths exist
    path.write_text(f"model: {{family: sdxl, path: {tmp_path / 'm'}}}\nmethod: lora\noutput_dir: o\n"
                    f"data: {{path: {tmp_path / 'd'}}}\n")
    assert main(["config", "check", str(path), "--set", "lora.rank=4"]) == 0
    out = capsys.readouterr().out
    assert "rank: 4" in out and "family: sdxl" in out and "learning_rate:" in out


@pytest.mark.parametrize(
    "text,expected",
    [
        ("model: {family: sd1, path: m}\nmethod: lora\noutput_dir: o\ndata: {path: d}\nbogus: 1\n", "bogus: unknown key"),
        ("model: [\n", "not valid YAML"),
        ("- a\n- b\n", "top level must be a mapping"),
    ],
)
def test_config_errors_exit_2_without_traceback(tmp_path, capsys, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_a_key_written_twice_is_refused_naming_it_and_its_lines(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: a second `data:` section at the end would drop the first one's
    path without a word. Keys a merge (`<<:`) brings in may still be overridden."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {family: sd1, path: m}\nmethod: lora\noutput_dir: o\ndata:\n  path: d\n"
                    "seed: 1\ndata:\n  cache_latents: true\n")
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "key 'data' appears twice in one section (lines 4 and 7)" in err and "Traceback" not in err
    from ot_dist.config.load import read_yaml

    path.write_text("base: &b {seed: 1, epochs: 2}\nover:\n  <<: *b\n  seed: 3\n")
    assert read_yaml(path)["over"] == {"seed": 3, "epochs": 2}


def test_a_utf16_config_is_read_and_other_bytes_are_named(tmp_path, capsys):
    """Windows PowerShell 5's `>` writes UTF-16 with a byte order mark; Latin-1 bytes are no YAML text. Neither
    may end in a UnicodeDecodeError's traceback."""
    (tmp_path / "m").mkdir(), (tmp_path / "d").mkdir()
    text = f"model: {{family: sd1, path: {tmp_path / 'm'}}}\nmethod: lora\noutput_dir: o\ndata: {{path: {tmp_path / 'd'}}}\n"
    path = tmp_path / "c.yaml"
    path.write_bytes(text.encode("utf-16"))
    assert main(["config", "check", str(path)]) == 0
    assert "family: sd1" in capsys.readouterr().out
    path.write_bytes(text.encode() + "seed: caf\xe9\n".encode("latin-1"))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not UTF-8 text" in err and "Traceback" not in err


def test_missing_config_file(capsys):
    assert main(["config", "check", "/nonexistent/config.yaml"]) == 2
    assert "config file not found: /nonexistent/config.yaml" in capsys.readouterr().err


def test_a_path_under_the_home_folder_is_read_there_by_every_part(tmp_path, monkeypatch):
    """`~` in a YAML path is a literal character: the early checks expanded it (and passed), the shard build then
    looked for `./~/...` and training wrote its cache into a folder named `~` in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    raw = {"model": {"family": "sd1", "path": "~/m", "config": "~/c"}, "method": "lora", "output_dir": "~/out",
           "lora": {"init_from": "~/l.safetensors"},
           "data": {"path": "~/d", "shards": "~/s", "cache_dir": "~/cache"}}
    config = validate(raw)
    assert (config.model.path, config.model.config, config.output_dir, config.lora.init_from) == (
        f"{tmp_path}/m", f"{tmp_path}/c", f"{tmp_path}/out", f"{tmp_path}/l.safetensors")
    assert (config.data.shards, config.data.cache_dir) == (f"{tmp_path}/s", f"{tmp_path}/cache")
    assert [concept.path for _, concept in config.data.concept_list()] == [f"{tmp_path}/d"]
    raw["data"] = {"concepts": [{"path": "~/a"}]}
    assert validate(raw).data.concepts[0].path == f"{tmp_path}/a"
    raw.update(method="embedding", embedding={"token": "sks", "init_from": "~/e.safetensors"})
    raw.pop("lora")
    assert validate(raw).embedding.init_from == f"{tmp_path}/e.safetensors"
