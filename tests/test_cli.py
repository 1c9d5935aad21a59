"""The command line as a user meets it: the demo from a clean folder, and bad input that names the
culprit with a non-zero exit and no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import base_config
from forked_ranks import run_ranks

from ot_dist.cli import main

REPO = Path(__file__).resolve().parents[1]


def write_config(tmp_path, raw) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def train_cli(config_path, capsys, *overrides) -> tuple[int, str]:
    args = ["train", str(config_path)]
    for o in overrides:
        args += ["--set", o]
    code = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_demo_runs_from_a_clean_folder(tmp_path):
    """The README's main job through the installed entry point, in an empty folder: `ot-dist demo
    prepare`, then `ot-dist launch configs/demo.yaml --nproc-per-node 2` (2 processes, FSDP2), and the
    same config in one process with `ot-dist train` (capped to a few steps here). `demo prepare` and the one-process
    train run forked from the preloaded test server (tests/forked_ranks.py), the launch as a user starts it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ot_dist"]
    demo = str(REPO / "configs" / "demo.yaml")
    prepared = run_ranks("-m", "ot_dist", "demo", "prepare", nproc=1, cwd=tmp_path, env=env, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    launched = subprocess.run(
        cmd + ["launch", demo, "--nproc-per-node", "2", "--set", "max_steps=2", "--set", "log_every_steps=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "strategy fsdp, global batch 4 (batch_size 2 x accumulation 1 x 2 processes)" in launched.stdout
    assert "step 2/2" in launched.stdout
    run_dir = tmp_path / "demo_out" / "run"
    assert (run_dir / "model" / "model_index.json").is_file()
    assert (run_dir / "model.safetensors").is_file()
    single = run_ranks("-m", "ot_dist", "train", demo, "--set", "max_steps=2", "--set", "output_dir=demo_out/single",
                       nproc=1, cwd=tmp_path, env=env, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "x 1 processes" in single.stdout and (tmp_path / "demo_out" / "single" / "model.safetensors").is_file()


def test_unknown_key_exits_2_naming_it(tiny_models, shapes_data, tmp_path, capsys):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "o")
    raw["optimizer"] = {"name": "ADAMW", "betas1": 0.9}
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 2
    assert "optimizer.betas1: unknown key" in err and "beta1" in err


def test_wrong_type_exits_2_naming_it(tiny_models, shapes_data, tmp_path, capsys):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "o")
    code, err = train_cli(write_config(tmp_path, raw), capsys, "learning_rate=fast")
    assert code == 2 and "learning_rate:" in err and "'fast'" in err


def test_missing_model_path(shapes_data, tmp_path, capsys):
    raw = base_config(tmp_path / "no-such-model", shapes_data, tmp_path / "o")
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and "model.path" in err and "no-such-model" in err


def test_corrupt_single_file_checkpoint(tiny_models, shapes_data, tmp_path, capsys):
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(os.urandom(4096))
    raw = base_config(broken, shapes_data, tmp_path / "o")
    raw["model"]["config"] = str(tiny_models["sd1"])
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and str(broken) in err and "safetensors" in err


def test_corrupt_weights_in_a_diffusers_folder(tiny_models, shapes_data, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["sd1"], folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    raw = base_config(folder, shapes_data, tmp_path / "o")
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and "model.path" in err and str(folder) in err


def test_family_mismatch(tiny_models, shapes_data, tmp_path, capsys):
    raw = base_config(tiny_models["sdxl"], shapes_data, tmp_path / "o", family="sd1")
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and "StableDiffusionXLPipeline" in err and "model.family sd1" in err


def test_image_that_does_not_decode(tiny_models, shapes_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(shapes_data, data)
    (data / "0003.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    raw = base_config(tiny_models["sd1"], data, tmp_path / "o")
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and "0003.png" in err and "could not be decoded" in err


def test_image_without_caption(tiny_models, shapes_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(shapes_data, data)
    (data / "0005.txt").unlink()
    raw = base_config(tiny_models["sd1"], data, tmp_path / "o")
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and "0005.png" in err and "caption" in err


@pytest.mark.parametrize("count", [0, 3])
def test_too_little_data(tiny_models, shapes_data, tmp_path, capsys, count):
    data = tmp_path / "data"
    data.mkdir()
    for png in sorted(shapes_data.glob("*.png"))[:count]:
        shutil.copy(png, data)
        shutil.copy(png.with_suffix(".txt"), data)
    raw = base_config(tiny_models["sd1"], data, tmp_path / "o")
    code, err = train_cli(write_config(tmp_path, raw), capsys)
    assert code == 3 and ("data.path: no images" in err if count == 0 else "make no optimizer step" in err)


def test_a_write_the_storage_refuses_is_exit_3_and_a_defect_keeps_its_traceback(monkeypatch, capsys):
    """An export at the end of training on a full disk: safetensors raises a SafetensorError carrying the OS error in
    its text, which ended in a traceback and exit 1 (tests/test_checkpoint_background.py has the real error)."""
    import ot_dist.cli
    from safetensors import SafetensorError

    def full(_args):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ot_dist.cli, "run", full)
    assert main(["config", "reference"]) == 3
    err = capsys.readouterr().err
    assert "ot-dist: error: a write failed: [Errno 28] No space left on device" in err and "Traceback" not in err

    def defect(_args):
        raise SafetensorError("Error while serializing: invalid tensor")

    monkeypatch.setattr(ot_dist.cli, "run", defect)
    with pytest.raises(SafetensorError):
        main(["config", "reference"])
