"""Issue 19 (items 6, 9, 10, 11): exports load the way the docs show, bad input is found before anything
expensive, the core install can train, and small things a user sees (LoRA bytes, path errors, the progress bar)
behave. DeepSpeed's op build on a zero launch is checked on tests/test_run_safety.py's zero launch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config
from safetensors import safe_open
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def quiet(*_args, **_kwargs):
    pass


def doc_blocks(page: str, section: str) -> list[str]:
    """The ```python blocks of one section of a docs/ page, as a user copies them."""
    text = (REPO / "docs" / page).read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


# -- 6. an exported embedding loads with the plain call --------------------------------------------------
# The loader rules this file is written for (read from the source, November 2026):
# - diffusers 0.42 loaders/textual_inversion.py `_retrieve_tokens_and_embeddings`: a state dict of ONE key is
#   `{token: tensor}` and registers that key as the token; a dict with `string_to_param` is A1111's .pt layout
#   (token = state_dict["name"]); anything else (two keys) is refused, so SDXL's clip_l / clip_g need one call per
#   encoder with `token=`. A [n, dim] tensor with n > 1 registers token, token_1, ... token_{n-1}.
# - A1111 modules/textual_inversion/textual_inversion.py `create_embedding_from_data`: `string_to_param`
#   (.pt only: safetensors holds no nested dicts), `clip_g` + `clip_l` (SDXL), else a dict of one tensor
#   ("diffuser concepts"); the prompt word is the file name.
# - ComfyUI comfy/sd1_clip.py `load_embed`: `string_to_param`, `clip_l` / `clip_g` by the encoder's key, else the
#   first (only) tensor.
# - OneTrainer modules/modelSetup/Base*Setup.py `_setup_embeddings`: SD 1.x / 2.x `emp_params(_out)` only, SDXL / SD3
#   `clip_l` / `clip_g` (`t5` optional), Flux `clip_l`, Würstchen / Stable Cascade `clip_g` (each `_out` first).


def run_embedding(family: str, model: Path, data: Path, out: Path, **extra):
    raw = base_config(model, data, out, family=family, method="embedding", max_steps=2, learning_rate=5e-2,
                      **{"embedding.token": "<shape>", **extra})
    Trainer(validate(raw), log=quiet).train()
    return out / "embedding.safetensors"


def pipeline(model: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True, safety_checker=None,
                                             requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_states(pipe, prompt: str) -> torch.Tensor:
    ids = pipe.tokenizer(pipe.maybe_convert_prompt(prompt, pipe.tokenizer), padding="max_length",
                         max_length=pipe.tokenizer.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        return pipe.text_encoder(ids)[0]


def image(pipe, prompt: str):
    return pipe(prompt, num_inference_steps=2, width=64, height=64, output_type="np",
                generator=torch.Generator().manual_seed(0)).images[0]


def test_sd_embedding_loads_with_the_plain_call_in_the_docs(tiny_models, shapes_data, tmp_path):
    exported = run_embedding("sd1", tiny_models["sd1"], shapes_data, tmp_path / "out", **{"embedding.vectors": 2})
    saved = load_file(exported)
    assert list(saved) == ["<shape>"] and saved["<shape>"].shape[0] == 2  # one tensor named after the token
    with safe_open(exported, "pt") as f:
        assert f.metadata()["token"] == "<shape>"
    (block,) = doc_blocks("checkpoints.md", "Loading an exported embedding")[:1]
    pipe = pipeline(tiny_models["sd1"])
    prompt = "a photo of <shape>"
    before_states, before_image = prompt_states(pipe, prompt), image(pipe, prompt)
    exec(block.replace("OUT/", f"{tmp_path / 'out'}/"), {"pipe": pipe})  # the line exactly as documented
    ids = pipe.tokenizer.convert_tokens_to_ids(["<shape>", "<shape>_1"])
    assert pipe.tokenizer.unk_token_id not in ids
    rows = pipe.text_encoder.get_input_embeddings().weight[ids].detach()
    torch.testing.assert_close(rows, saved["<shape>"].to(rows.dtype))
    assert not torch.allclose(prompt_states(pipe, prompt), before_states)  # the trained token reaches the prompt
    assert abs(image(pipe, prompt) - before_image).max() > 1e-3  # ... and the image
    # OneTrainer's SD setups read `emp_params` (or `emp_params_out`) and nothing else: the documented copy has it
    exec(doc_blocks("checkpoints.md", "Loading an exported embedding")[3].replace("OUT/", f"{tmp_path / 'out'}/"), {})
    copy = load_file(tmp_path / "out" / "embedding-onetrainer.safetensors")
    assert torch.equal(copy.get("emp_params_out", copy.get("emp_params")), saved["<shape>"])


def test_sdxl_embedding_loads_with_the_documented_calls(tiny_models, shapes_data, tmp_path):
    exported = run_embedding("sdxl", tiny_models["sdxl"], shapes_data, tmp_path / "out")
    saved = load_file(exported)
    assert sorted(saved) == ["clip_g", "clip_l"]
    block = doc_blocks("checkpoints.md", "Loading an exported embedding")[1]
    pipe = pipeline(tiny_models["sdxl"])
    exec(block.replace("OUT/", f"{tmp_path / 'out'}/").replace('"TOKEN"', '"<shape>"'), {"pipe": pipe})
    for tokenizer, encoder, key in ((pipe.tokenizer, pipe.text_encoder, "clip_l"),
                                    (pipe.tokenizer_2, pipe.text_encoder_2, "clip_g")):
        (token_id,) = tokenizer.convert_tokens_to_ids(["<shape>"])
        row = encoder.get_input_embeddings().weight[token_id].detach()
        torch.testing.assert_close(row, saved[key][0].to(row.dtype))


# -- 10. the core install trains; every import is declared -----------------------------------------------


def declared_dependencies() -> tuple[set[str], dict[str, set[str]]]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


def imported_modules() -> dict[str, set[str]]:
    """Top-level third-party module -> 'module' (imported when the module loads) and/or 'lazy' (in a function),
    over every import in ot_dist, plus the optimizer classes the registry imports by name."""
    import ast
    import sys

    from ot_dist.optim.registry import SPECS

    found: dict[str, set[str]] = {}

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.setdefault(alias.name.split(".")[0], set()).add("lazy" if lazy else "module")
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.setdefault(child.module.split(".")[0], set()).add("lazy" if lazy else "module")
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for path in (REPO / "ot_dist").rglob("*.py"):
        visit(ast.parse(path.read_text()), False)
    for spec in SPECS.values():
        found.setdefault(spec.target.partition(":")[0].split(".")[0], set()).add("lazy")
    return {m: how for m, how in found.items() if m not in sys.stdlib_module_names and m not in ("ot_dist", "__future__")}


def test_every_import_is_a_declared_dependency_and_optional_ones_name_their_extra():
    from importlib.metadata import packages_distributions

    from ot_dist.extras import EXTRAS

    core, extras = declared_dependencies()
    distributions = packages_distributions()
    # pydantic pins pydantic-core exactly: declaring pydantic declares it.
    provided_by = {"pydantic_core": "pydantic"}
    for module, how in sorted(imported_modules().items()):
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        dists = {provided_by[module]} if module in provided_by else dists
        assert dists, f"{module}: imported by ot_dist but not installed"
        if module in EXTRAS:
            assert dists & extras[EXTRAS[module]], f"{module}: not in the extra {EXTRAS[module]!r} of pyproject.toml"
            assert how == {"lazy"}, f"{module}: optional, so it may only be imported inside the function that needs it"
        else:
            assert dists & core, f"{module}: imported by ot_dist (as {sorted(how)}) but not a core dependency"


def blocking(tmp_path: Path, modules: list[str]) -> dict:
    """An environment in which `modules` cannot be imported, as in an install without the extras."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}


def test_the_core_install_trains_and_a_missing_extra_is_named_in_one_line(small_sd1, shapes_data, tmp_path):
    import subprocess
    import sys

    import yaml

    from ot_dist.extras import EXTRAS

    env = blocking(tmp_path, sorted(EXTRAS))
    raw = base_config(small_sd1, shapes_data, tmp_path / "out", max_steps=1, **{"mlflow.enabled": True})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    # One process with the extras blocked (a fresh interpreter: the blocking is its sitecustomize): `ot-dist train`
    # as `python -m ot_dist train` runs it, then both `ot-dist config check` calls, each one's exit code and stderr.
    checks = (("strategy=zero2", "strategy: zero2 needs the deepspeed package: pip install 'ot_dist[dist]'"),
              ("optimizer.name=ADAMW_8BIT", "optimizer.name: ADAMW_8BIT needs the bitsandbytes package: "
                                            "pip install 'ot_dist[optim]'"),
              ("weight_dtype=nf4", "weight_dtype: nf4 needs the bitsandbytes package: pip install 'ot_dist[optim]'"))
    script = ("import contextlib, io, json, runpy, sys\n"
              "config, overrides = sys.argv[1], sys.argv[2:]\n"
              "sys.argv = ['ot-dist', 'train', config]\n"
              "try:\n"
              "    runpy.run_module('ot_dist', run_name='__main__', alter_sys=True)\n"
              "except SystemExit as exit:\n"
              "    results = [exit.code]\n"
              "from ot_dist.cli import main\n"
              "for override in overrides:\n"
              "    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err):\n"
              "        try:\n"
              "            code = main(['config', 'check', config, '--set', override])\n"
              "        except SystemExit as exit:\n"
              "            code = exit.code\n"
              "    results.append([code, err.getvalue()])\n"
              "print(json.dumps(results))\n")
    done = subprocess.run([sys.executable, "-c", script, str(config), *(override for override, _ in checks)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    trained, *checked = json.loads(done.stdout.splitlines()[-1])
    assert trained == 0, done.stderr[-3000:]
    assert "MLflow is not installed" in done.stdout and "pip install 'ot_dist[tracking]'" in done.stdout
    assert (tmp_path / "out" / "model").is_dir()
    for (code, stderr), (_, line) in zip(checked, checks, strict=True):
        assert code == 2 and line in stderr and "Traceback" not in stderr, stderr


# -- 9. checks that come early ---------------------------------------------------------------------------


def config_check(config: Path, cwd: Path, *overrides: str):
    sets = [arg for o in overrides for arg in ("--set", o)]
    return run_ranks("-m", "ot_dist", "config", "check", config, *sets, nproc=1, cwd=cwd, timeout=120)


def test_config_check_names_missing_model_and_data_paths_resolved(tiny_models, shapes_data, tmp_path):
    import yaml

    config = tmp_path / "config.yaml"
    # Relative paths are read from the working folder: the message shows where that led.
    config.write_text(yaml.safe_dump(base_config("models/sd1", shapes_data, "out")))
    done = config_check(config, tmp_path)
    assert done.returncode == 3, done.stderr
    assert f"model.path: {tmp_path.resolve() / 'models' / 'sd1'} does not exist" in done.stderr
    config.write_text(yaml.safe_dump(base_config(tiny_models["sd1"], "pictures", "out")))
    done = config_check(config, tmp_path)
    assert done.returncode == 3 and f"data.path: {tmp_path.resolve() / 'pictures'} is not a folder" in done.stderr
    config.write_text(yaml.safe_dump(base_config(tiny_models["sd1"], shapes_data, "out")))
    done = config_check(config, tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    done = config_check(config, tmp_path, "strategy=fsdp")  # one process: sharding shards nothing
    assert done.returncode == 0 and "warning: strategy: fsdp on one process shards nothing" in done.stderr


def test_a_file_where_the_shards_go_is_named_before_any_image_is_read(tiny_models, shapes_data, tmp_path, capsys):
    """data.shards / data.cache_dir / `shard build --out` under a file were a NotADirectoryError traceback once the
    build started writing."""
    from ot_dist.cli import main
    from ot_dist.early_checks import check_input_paths
    from ot_dist.errors import InputFileError

    (tmp_path / "taken").write_text("a file")
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out")
    raw["data"]["shards"] = str(tmp_path / "taken" / "shards")
    with pytest.raises(InputFileError, match=f"data.shards: {tmp_path / 'taken' / 'shards'} cannot be created: "
                                             f"{tmp_path / 'taken'} is not a folder"):
        check_input_paths(validate(raw))
    raw["data"].pop("shards")
    raw["data"]["cache_dir"] = str(tmp_path / "taken")
    with pytest.raises(InputFileError, match=f"data.cache_dir: {tmp_path / 'taken'} is not a folder"):
        check_input_paths(validate(raw))
    raw["data"].pop("cache_dir")
    check_input_paths(validate(raw))
    (tmp_path / "config.yaml").write_text(json.dumps(raw))
    assert main(["shard", "build", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "taken" / "s")]) == 3
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'taken' / 's'} cannot be created" in err and "Traceback" not in err


def test_a_missing_model_is_named_before_shards_are_built(shapes_data, tmp_path):
    from ot_dist.errors import InputFileError

    raw = base_config(tmp_path / "no-model", shapes_data, tmp_path / "out")
    with pytest.raises(InputFileError, match=f"model.path: {re.escape(str(tmp_path / 'no-model'))} does not exist"):
        Trainer(validate(raw), log=quiet)
    assert not Path(raw["data"]["shards"]).exists()  # nothing built for a run that cannot start


def test_a_single_file_without_model_config_names_the_config_key(tiny_models, tmp_path):
    from diffusers import DiffusionPipeline

    from ot_dist.errors import UserError
    from ot_dist.models.families.sd_single_file import export_single_file
    from ot_dist.models.loading import load_model

    pipe = DiffusionPipeline.from_pretrained(tiny_models["sd1"])
    path = export_single_file(pipe.components, "sd1", tmp_path / "sd1.safetensors")
    raw = base_config(path, tmp_path, tmp_path / "out")
    with pytest.raises(UserError, match="model.config") as info:
        load_model(validate(raw).model)
    assert "config_source" not in str(info.value)


@pytest.mark.parametrize("resolution, step", [(8, 64), (72, 64), (40, 16)])
def test_a_resolution_off_the_bucket_grid_is_refused(resolution, step, tmp_path):
    from ot_dist.errors import ConfigError

    raw = base_config("m", "d", "o", resolution=resolution, **{"data.bucket_step": step})
    with pytest.raises(ConfigError, match=f"resolution: {resolution} is not a multiple of data.bucket_step {step}"):
        validate(raw)
    validate(base_config("m", "d", "o", resolution=2 * step, **{"data.bucket_step": step}))


def test_a_mask_of_another_size_is_scaled_with_a_warning_and_of_another_shape_refused(tmp_path):
    from PIL import Image

    from ot_dist.data.shards import build_shard_set
    from ot_dist.errors import InputFileError

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64), "red").save(images / "a.png")
    (images / "a.txt").write_text("a red square")
    Image.new("L", (32, 32), 255).save(images / "a-masklabel.png")  # half size, same shape: scaled
    config = validate(base_config("m", images, tmp_path / "out", **{"data.bucket_step": 64}))
    lines = []
    build_shard_set(config, tmp_path / "shards", log=lines.append)
    assert any(f"mask {images / 'a-masklabel.png'} is 32x32, its image {images / 'a.png'} is 64x64; the mask is "
               "scaled" in line for line in lines), lines
    Image.new("L", (64, 32), 255).save(images / "a-masklabel.png")  # another shape: it would not lie on the image
    with pytest.raises(InputFileError, match=f"mask {re.escape(str(images / 'a-masklabel.png'))} is 64x32, its image "
                                              f".* is 64x64: another shape"):
        build_shard_set(config, tmp_path / "shards2", log=lines.append)


# -- 11. smaller things a user sees ----------------------------------------------------------------------


def test_the_progress_bar_shows_on_a_terminal_that_reports_zero_columns():
    """A real process on a pseudo-terminal whose size is 0 x 0 (as some container ttys report)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    script = ("from ot_dist.tracking.progress import Progress\n"
              "p = Progress(7, 1)\n"
              "for step in range(1, 8): p.step(step)\n"
              "p.window(7, 0, 0.25, {'lr/unet': 1e-4}, 3.0)\n"
              "p.close()\n")
    for columns, rows in ((0, 0), (120, 40)):
        controller, terminal = pty.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        child = subprocess.Popen([sys.executable, "-c", script], stdout=terminal, stderr=terminal,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        os.close(terminal)
        output = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
        os.close(controller)
        assert child.wait(timeout=60) == 0
        text = output.decode(errors="replace")
        assert "7/7" in text and "loss 0.2500" in text, (columns, text)


def header(path: Path) -> dict:
    """The JSON header of a .safetensors file as written (in its order; safe_open's metadata() is a hash map)."""
    import json
    import struct

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def test_ot_dist_export_writes_the_lora_file_training_wrote_bit_for_bit(small_sd1, shapes_data, tmp_path):
    """docs/checkpoints.md: `ot-dist export` of a checkpoint writes the files training wrote, bit for bit, in the kohya
    and the diffusers layout. The exports run in another process (its own hash seed: set and dict orders must not
    leak into the file), one process for both layouts."""
    import os
    import subprocess
    import sys

    pairs = []
    for layout in ("kohya", "diffusers"):
        out = tmp_path / layout / "out"
        raw = base_config(small_sd1, shapes_data, out, method="lora", max_steps=1,
                          **{"lora.rank": 4, "lora.alpha": 8, "text_encoder.train": True, "lora.file_layout": layout})
        Trainer(validate(raw), log=quiet).train()
        pairs.append((str(out), str(tmp_path / layout / "again")))
    script = ("import sys\nfrom ot_dist.cli import main\n"
              f"sys.exit(max(main(['export', out, '--out', again]) for out, again in {pairs!r}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "7"})
    assert done.returncode == 0, done.stderr[-3000:]
    for out, again in pairs:
        trained, exported = header(Path(out) / "lora.safetensors"), header(Path(again) / "lora.safetensors")
        assert list(trained["__metadata__"].items()) == list(exported["__metadata__"].items())  # same keys and order
        assert list(trained.items()) == list(exported.items())
        assert (Path(out) / "lora.safetensors").read_bytes() == (Path(again) / "lora.safetensors").read_bytes()


# DeepSpeed's shared-memory op not being compiled by a zero launch on the CPU (item 11) is asserted on the SIGINT launch
# of tests/test_run_safety.py (test_sigint_to_a_zero_launch_saves_and_exits_0_in_one_line_and_builds_no_shm_op): one
# `ot-dist launch --strategy zero2` in an empty torch extensions folder serves both (~20 CPU s of start-up each).
