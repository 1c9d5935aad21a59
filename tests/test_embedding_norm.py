"""preserve_embedding_norm (OneTrainer's option; ot_dist/train/embedding_norm.py): after every optimizer step each
trained input vector has the median row norm of its encoder's token table, and an output embedding's vectors keep the
mean per-row standard deviation they started with. One run of method embedding (3 input vectors) with an additional
output embedding beside it, on one_level_sd1 with a large learning rate (so that the rescale decides where the run
ends); the same run without the option (which must end elsewhere); the same run on 2 ranks under ddp, fsdp, zero2
and zero3, where the vectors' rows are cut between the ranks (FSDP's row shards, ZeRO's flat partitions cut inside a row),
against the one-process run; a step skipped on the device leaves the vectors as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda *_: None  # noqa: E731
STEPS = 3
TOLERANCE = 1e-5


def norm_config(model, data, out, preserve=True, **extra) -> dict:
    raw = base_config(model, None, out, method="embedding", **{
        "batch_size": 4, "max_steps": STEPS, "learning_rate": 5e-2, "preserve_embedding_norm": preserve,
        "embedding": {"token": "<tok>", "vectors": 3, "init_text": "a cat"},
        # the output vectors' rows have a std near 1 (the input rows' norms are near 1 too): a larger step for them
        "additional_embeddings": [{"token": "<add>", "vectors": 3, "output_embedding": True,
                                   "learning_rate": 0.3}], **extra})
    raw["data"] = {"concepts": [{"path": str(data), "caption_prefix": "<add>"}], "shards": f"{out}-shards"}
    return raw


def table_median(model_path) -> torch.Tensor:
    """OneTrainer's orig_median_norm: torch.norm(token table, dim=1).median(), from the model as stored."""
    state = load_file(Path(model_path) / "text_encoder" / "model.safetensors")
    (table,) = [v for k, v in state.items() if k.endswith("token_embedding.weight")]
    return torch.norm(table.float(), dim=1).median()


def mean_row_std(vectors: torch.Tensor) -> torch.Tensor:
    return vectors.float().std(dim=1).mean()


def trained(out: Path) -> dict[str, torch.Tensor]:
    return {"input": load_file(out / "embedding.safetensors")["<tok>"],
            "output": load_file(out / "embeddings" / "add.safetensors")["emp_params_out"]}


def train_one_process(model, data, out, preserve) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The exported vectors, and the output embedding's starting values."""
    trainer = Trainer(validate(norm_config(model, data, out, preserve)), log=QUIET)
    start = trainer.model.text_encoders["text_encoder"].get_input_embeddings().outputs.additional["0"].detach().clone()
    trainer.train()
    return trained(out), start


@pytest.fixture(scope="module")
def one_process(one_level_sd1, shapes_data, tmp_path_factory):
    return {preserve: train_one_process(one_level_sd1, shapes_data, tmp_path_factory.mktemp(f"norm-{preserve}"),
                                        preserve)
            for preserve in (True, False)}


def test_vectors_keep_onetrainers_norms(one_process, one_level_sd1):
    median = table_median(one_level_sd1)
    (vectors, start), (plain, plain_start) = one_process[True], one_process[False]
    assert torch.allclose(torch.norm(vectors["input"], dim=1), median.expand(3), rtol=1e-5)
    assert vectors["output"].shape == (3, 32)
    assert torch.allclose(mean_row_std(vectors["output"]), mean_row_std(start), rtol=1e-5)
    # without the option the large steps take them elsewhere
    assert (torch.norm(plain["input"], dim=1) - median).abs().min() > 0.05 * median
    assert (mean_row_std(plain["output"]) - mean_row_std(plain_start)).abs() > 0.05 * mean_row_std(plain_start)
    assert torch.equal(start, plain_start)  # the same start: the option changes where it ends
    for key in vectors:
        assert (vectors[key] - plain[key]).abs().max() > 1000 * TOLERANCE, key


def test_two_ranks_equal_one_process(one_process, one_level_sd1, shapes_data, tmp_path):
    """ddp, fsdp, zero2 and zero3, batch 2 on each of 2 ranks, against one process with batch 4. The 3 input rows and the
    3 output vectors (3 x 32 elements each) are cut inside row 1 by ZeRO's partitions (48 elements each) and held
    2 + 1 by FSDP (the output vectors' mean row std spans both ranks)."""
    cases = {}
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        raw = norm_config(one_level_sd1, shapes_data, tmp_path / strategy, batch_size=2, strategy=strategy)
        cases[strategy] = raw
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = run_ranks(REPO / "tests" / "helpers" / "family_cases.py", tmp_path / "cases.json", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference, _ = one_process[True]
    diffs = {f"{strategy} {key}": float((value - reference[key]).abs().max())
             for strategy in cases for key, value in trained(tmp_path / strategy).items()}
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_a_step_skipped_on_the_device_leaves_the_vectors():
    """The lagged step guard's skipped step (optimizer.found_inf = 1): the optimizer changed nothing and neither does
    the rescale; with found_inf = 0 it rescales."""
    from ot_dist.parallel.ownership import Ownership, whole
    from ot_dist.train.embedding_norm import EmbeddingNorms, Vectors

    rows, outputs = torch.nn.Parameter(torch.randn(3, 8)), torch.nn.Parameter(torch.randn(2, 8))
    named = {"te.rows": rows, "te.outputs": outputs}
    vectors = [Vectors("te.rows", True, 2.0, "a", rows), Vectors("te.outputs", False, 0.5, "b", outputs)]
    norms = EmbeddingNorms(vectors, Ownership([whole(p, n) for n, p in named.items()],
                                              {n: p.shape for n, p in named.items()}))
    optimizer = torch.optim.SGD([{"params": [rows], "name": "a"}, {"params": [outputs], "name": "b"}], lr=1.0)
    before = [rows.detach().clone(), outputs.detach().clone()]
    optimizer.found_inf = torch.ones(())
    norms.after_step(optimizer)
    assert torch.equal(rows, before[0]) and torch.equal(outputs, before[1])
    optimizer.found_inf = torch.zeros(())
    norms.after_step(optimizer)
    assert torch.allclose(torch.norm(rows, dim=1), torch.full((3,), 2.0))
    assert torch.allclose(mean_row_std(outputs), torch.tensor(0.5))
    # OneTrainer's rules on an already rescaled tensor change it only at float rounding
    again = [rows.detach().clone(), outputs.detach().clone()]
    norms.after_step(optimizer)
    assert torch.allclose(rows, again[0], rtol=1e-6) and torch.allclose(outputs, again[1], rtol=1e-6)
    # vectors that stopped training (an additional embedding's stop_training_after: single / ddp) are left alone
    rows.requires_grad_(False)
    with torch.no_grad():
        rows.mul_(3.0)
    stopped = rows.detach().clone()
    norms.after_step(optimizer)
    assert torch.equal(rows, stopped)


def test_refused_without_trained_vectors(small_sd1, shapes_data, tmp_path):
    raw = base_config(small_sd1, shapes_data, tmp_path, method="lora", preserve_embedding_norm=True)
    with pytest.raises(ConfigError, match="preserve_embedding_norm: method lora trains no embedding vectors"):
        validate(raw)


def test_refused_where_zero3_splits_a_parameter_group(one_level_sd1, shapes_data, tmp_path):
    """ZeRO-3 steps a parameter group's sub-groups one at a time: the rescale, run when the group steps, would run
    before the vectors' sub-group had stepped. Refused after the engine is built, naming the option (1-rank group)."""
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"zero_optimization": {"sub_group_size": 1000}}))
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "run", method="lora", strategy="zero3", batch_size=2,
                      max_steps=1, preserve_embedding_norm=True, deepspeed={"config_file": str(split)},
                      additional_embeddings=[{"token": "<add>"}])
    raw["data"] = {"concepts": [{"path": str(shapes_data), "caption_prefix": "<add>"}], "shards": f"{tmp_path}-shards"}
    with pytest.raises(ConfigError, match="preserve_embedding_norm: deepspeed.config_file's zero_optimization"):
        Trainer(validate(raw), log=QUIET)


def test_the_fused_back_pass_rescales_too(one_level_sd1, shapes_data, tmp_path):
    """optimizer.fused_back_pass steps each parameter inside backward (optimizer.step is a no-op there): the rescale
    runs at each of those steps."""
    raw = norm_config(one_level_sd1, shapes_data, tmp_path, clip_grad_norm=None,
                      **{"optimizer.fused_back_pass": True})
    trainer = Trainer(validate(raw), log=QUIET)
    start = trainer.model.text_encoders["text_encoder"].get_input_embeddings().outputs.additional["0"].detach().clone()
    trainer.train()
    vectors = trained(tmp_path)
    assert torch.allclose(torch.norm(vectors["input"], dim=1), table_median(one_level_sd1).expand(3), rtol=1e-5)
    assert torch.allclose(mean_row_std(vectors["output"]), mean_row_std(start), rtol=1e-5)
