"""Shared fixtures: tiny models of each family and the demo dataset, built once per test session."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
# Launched ranks inherit it: a rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack,
# so the failure names the code it happened in.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# One intra-op thread per test process, as torchrun gives each rank: the suite runs 2 xdist workers (plus their
# ranks) on 2 cores, and torch's default of one OpenMP thread per core oversubscribes them; OpenMP threads then
# spin waiting for descheduled peers. Measured side by side on the 2-core machine: test_methods.py took 58 s of
# wall and 60 s of CPU with the default, 12.9 s / 12.8 s with one thread; test_optimizers.py 79 s -> 34 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable alone would come too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Bytecode is cached (in the checkout's git-ignored __pycache__ folders) even where the environment says
# PYTHONDONTWRITEBYTECODE (this machine's does): otherwise every xdist worker compiles and assertion-rewrites all test
# modules again at collection, and every launched process (forked ranks importing what the fork server did not,
# `ot-dist launch`, torchrun's ranks) compiles ot_dist's modules again. Measured on the 2-core machine: a worker's
# collection 18.5 -> 12 CPU s, a fresh `python -m ot_dist train`'s imports 3.9 -> 3.5 CPU s. This file is read by
# the controller before xdist starts its workers, so they and every process they start inherit the setting.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> path of a tiny diffusers folder (sd1, sd2, sdxl)."""
    from ot_dist.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_model(root / family, family) for family in ("sd1", "sd2", "sdxl")}


@pytest.fixture(scope="session")
def small_sd1(tmp_path_factory):
    """An SD 1.x model like tiny_models["sd1"] (same VAE, text encoder, tokenizer, scheduler) whose UNet has 2 levels
    instead of 4: 4 attention blocks instead of 10, still a cross-attention block down, in the middle and up, and a
    down- and an upsampler (every sharding unit kind). For multi-rank launches of many cases whose cost grows with
    the module count (ZeRO-3 hooks and gathers every module, DeepSpeed broadcasts every parameter, FSDP units) and
    whose assertions do not depend on the depth: SD 1.x's strategy equivalence on the hybrid 2 x 2 mesh (its float32,
    bfloat16 and float16 launches are on one_level_sd1), the LoRA variants on 2 ranks, the step guard (its
    single-process cases; its 2-rank launches are on one_level_sd1), the sharding variants and launchers of test_strategies.py, sharded Prodigy and EMA,
    the concepts' 2-rank launch, the Kubernetes pods, the 2-rank data-shard and masked runs, the checkpoint
    tests' stop / resume runs of one process and fsdp (ZeRO's are on one_level_sd1) and the killed rank's restart, the signals to launches in
    test_run_safety.py, every optimizer's two one-process steps and the fused back pass in test_optimizers.py
    (docs/development.md).
    Measured: the matrix's 19 ZeRO-3 cases took 146 CPU s on the 4-level UNet, 67 s on this one (the matrix has
    since moved to one_level_sd1)."""
    import torch
    from diffusers import UNet2DConditionModel

    from ot_dist.file_modes import share_with_umask
    from ot_dist.models.tiny import TEXT_HIDDEN, build_tiny_pipeline

    pipe = build_tiny_pipeline("sd1")
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64), cross_attention_dim=TEXT_HIDDEN, attention_head_dim=4)
    folder = tmp_path_factory.mktemp("small_sd1") / "sd1"
    pipe.save_pretrained(folder, safe_serialization=True)
    share_with_umask(folder)  # as make_tiny_model: diffusers writes its safetensors 0600
    return folder


@pytest.fixture(scope="session")
def one_level_sd1(small_sd1, tmp_path_factory):
    """small_sd1 (same VAE, text encoder, tokenizer, scheduler) with a 1-level UNet and no middle block: three
    transformer blocks (a cross-attention block down and two up, each with self- and cross-attention) and three
    resnets, 122 parameters instead of 208, no down- or upsampler. For launches of many cases whose assertions are
    on the optimizer's steps over each strategy's parameters (DTensor shards, flat ZeRO partitions), not on the UNet's
    depth or its sharding units: the optimizer x strategy matrix (tests/test_optimizers_distributed.py, its LoRA on
    to_q / to_v of every attention) and the step guard's 2-rank launches (test_step_guard.py two_ranks and zero_ranks:
    host syncs per step, NaN steps skipped on every rank, signals and time-based saves agreed), and SD 1.x's strategy
    equivalences in float32, bfloat16 and float16 (test_family_strategies.py: tolerances of TOLERANCE or multiples
    of the low-precision noise each run measures; its block casts' LoRA still shares q / k / v and k / v groups in each
    of the 3 transformer blocks), and the 2-rank tracking run with the one-process run it is compared with
    (test_tracking.py: losses and gradient norms within rel 1e-4, measured 1.1e-7), and the checkpoint tests' ZeRO-2 /
    ZeRO-3 stop / resume runs (test_checkpoint.py: bit for bit). ZeRO-3 gathers and DeepSpeed
    broadcasts every parameter of the UNet, frozen ones too, and FSDP gathers each unit, so a case's cost follows the
    parameter count. Measured per rank: the matrix's launch 40 -> 25 CPU s (ZeRO-3's 22 cases 37 -> 19 s), the
    step guard's 13 ZeRO cases 12.5 -> 8.3 CPU s; the strategy equivalences' float32 launch 27.9 -> 21.7 s, their
    bfloat16 / float16 launch 34.0 -> 20.0 s (wall, back to back)."""
    import shutil

    import torch
    from diffusers import UNet2DConditionModel

    from ot_dist.file_modes import share_with_umask
    from ot_dist.models.tiny import TEXT_HIDDEN

    folder = tmp_path_factory.mktemp("one_level_sd1") / "sd1"
    shutil.copytree(small_sd1, folder, ignore=lambda root, names: ["unet"] if root == str(small_sd1) else [])
    torch.manual_seed(0)
    UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",), mid_block_type=None, up_block_types=("CrossAttnUpBlock2D",),
        block_out_channels=(32,), cross_attention_dim=TEXT_HIDDEN, attention_head_dim=4,
    ).save_pretrained(folder / "unet", safe_serialization=True)
    share_with_umask(folder)  # as make_tiny_model: diffusers writes its safetensors 0600
    return folder


class _LazyModels(dict):
    """family name -> tiny diffusers folder, built on first use (so a test of one family builds only that one)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family):
        from ot_dist.models.tiny import make_tiny_model

        self[family] = make_tiny_model(self.root / family, family)
        return self[family]


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A default process group a test leaves initialised in this worker (a trainer it built for fsdp / ZeRO in one
    process and never shut down) is ended after it: a later test that starts its own group (one_rank_group, a
    caller-made group) would otherwise fail with "trying to initialize the default process group twice" depending on
    which tests ran before it in the same worker. What ot_dist itself must end is asserted by its own tests
    (test_runtime_groups.py, test_zero3_collectives.py)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group(monkeypatch):
    """A 1-rank gloo process group in the test's own process (FSDP2, DTensor and DeepSpeed need one), destroyed after
    it. LOCAL_RANK as torchrun sets it: DeepSpeed's engine refuses to start without it (engine.py
    `_do_args_sanity_check`)."""
    import torch.distributed as dist

    from ot_dist.ports import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family -> path of a tiny diffusers folder of any registered family, built when first asked for."""
    return _LazyModels(tmp_path_factory.mktemp("family_models"))


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory):
    from ot_dist.demo import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("data") / "shapes", count=16)


def base_config(model_path, data_path, output_dir, family="sd1", method="full", **overrides) -> dict:
    """A small, fast training config as a raw dict (validated by the caller)."""
    raw = {
        "model": {"family": family, "path": str(model_path)},
        "method": method,
        "output_dir": str(output_dir),
        "data": {"path": str(data_path), "shards": f"{output_dir}-shards"},  # not the working folder's data_shards/
        "resolution": 64,
        "batch_size": 4,
        "epochs": 1,
        "learning_rate": 3e-4,
        "log_every_steps": 1000,
        "seed": 1,
        # Tracking costs seconds per run (MLflow's import, a new store); tests/test_tracking.py turns it on.
        "mlflow": {"enabled": False},
    }
    for key, value in overrides.items():
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return raw


def with_reference_images(raw: dict, optional_too: bool = False) -> dict:
    """`raw` (base_config's) with a reference image for each of its images where the family needs them (an edit
    model, flux_kontext), or, with `optional_too`, takes them (FLUX.2): the demo drawn again with another seed, beside
    the data folder, paired by file name."""
    from pathlib import Path

    from ot_dist.models.families.registry import get_family

    family = get_family(raw["model"]["family"])
    if not (family.reference_images or (optional_too and family.takes_reference_images)):
        return raw
    from ot_dist.demo import make_demo_dataset

    images = Path(raw["data"]["path"])
    references = images.with_name(f"{images.name}-references")
    if not references.is_dir():  # made once per data folder (a session fixture's)
        make_demo_dataset(references, count=len(list(images.glob("*.png"))), seed=7)
        for caption in references.glob("*.txt"):
            caption.unlink()
    data = {k: v for k, v in raw["data"].items() if k != "path"}
    return {**raw, "data": {**data, "concepts": [{"path": str(images), "reference_path": str(references)}]}}


def small_edit_reference_areas(monkeypatch, area: int = 128 * 128) -> None:
    """The Qwen-Image-Edit pipelines scale a sample's reference to 1024^2 pixels for the VAE (Edit:
    calculate_dimensions(1024 * 1024, ...) in __call__, for its vision tower too; 2509: VAE_IMAGE_SIZE) and 2509 to
    384^2 for its vision tower: `area` instead, for ot_dist's sample (which runs the pipeline) and a pipeline a test
    runs alike. The same code runs on fewer pixels: encoding the reference at 1024^2 was nearly all of a tiny edit
    sample's cost (~10 CPU s per family; under test_float8_dtype.py's op watch 3-4 s more)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    scaled = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda _area, ratio: scaled(area, ratio))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", area)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", area)


def in_aligned_memory(pipeline):
    """A pipeline diffusers loaded, its CPU weights copied out of the memory-mapped files into aligned memory, as
    ot_dist places every model it trains (memory/placement.py: into_aligned_memory): CPU kernels round unaligned
    operands differently, so a bit-for-bit comparison must not depend on where a tensor sits in its file."""
    import torch

    from ot_dist.memory.placement import into_aligned_memory

    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            into_aligned_memory(component)
    return pipeline


# With `-n 2 --dist loadfile --no-loadscope-reorder` (README's test command) xdist hands whole files to the two
# workers in collection order. The files below cost the most (15 s to 2 minutes of CPU each, mostly multi-rank
# launches serving many assertions); started first, they run side by side with the many short files filling the gaps,
# instead of one of them starting last and running alone at the end (costliest first; measured with
# tests/cpu_cost_plugin.py over the whole suite, November 2026).
SLOWEST_FIRST = (
    "test_family_strategies.py", "test_optimizers_distributed.py", "test_checkpoint.py", "test_checkpoint_safety.py",
    "test_strategies.py", "test_tracking.py", "test_run_safety.py", "test_step_guard.py", "test_k8s.py",
    "test_optimizers.py", "test_lora_variants.py", "test_cli.py", "test_concepts.py", "test_lora_tools.py",
    "test_sharded_prodigy_ema.py", "test_sampling.py", "test_float8_dtype.py", "test_early_checks.py", "test_data_shards.py",
    "test_bench.py", "test_load_dtype.py",
)


_XDIST_CONTROLLER = False  # this process only hands tests to xdist workers, which report failures themselves


def pytest_configure(config):
    global _XDIST_CONTROLLER
    _XDIST_CONTROLLER = not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def pytest_runtest_logreport(report):
    """OT_DIST_FAILURES=FILE: each failure's reason is appended to FILE as it happens. A GPU lease's time cap can end
    pytest before its summary prints the reasons; launch/gpu_lease.sh brings this file back instead."""
    path = os.environ.get("OT_DIST_FAILURES")
    if path and report.failed and not _XDIST_CONTROLLER:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-8000:]}\n\n")


def pytest_collection_modifyitems(session, config, items):
    order = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep their order


# The garbage collector in the test process (an xdist worker runs ~1200 tests in one interpreter). ot_dist freezes
# what exists when a process builds its first trainer (ot_dist/memory/heap.py), once: what later tests leave alive
# (libraries imported later, session fixtures, test modules' state: ~230 k objects) was walked again by every full
# collection, and the tests' own allocations (models, graphs) trigger one every few seconds. So what is alive after
# collection and after each test file's last test (its module fixtures torn down, its garbage collected first) is
# frozen: a full collection walks what the current file made. Measured on 244 tests of 6 files (one worker, process
# CPU): the collections' share 22.9 -> 12.9 CPU s of 208 (full collections 18.5 -> 8.4 s), the same peak RSS. A file's
# own objects are never frozen while the file runs, so its tests see the collector as before (gc.collect() frees
# what they drop); only cycles left by something alive across files and dropped later are no longer collected.
def pytest_collection_finish(session):
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if nextitem is None or nextitem.path != item.path:  # after the file's module fixtures are torn down
        import gc

        gc.collect()
        gc.freeze()
