"""Latent / text caches at the scale of large finetunes (issue 25): fixed chunks of samples that an interrupted run
resumes on any world size, a compact memory-mapped index, batched encoding."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from forked_ranks import run_ranks
from PIL import Image
from safetensors.torch import load

from ot_dist.config.load import validate
from ot_dist.data.cache_index import CacheIndex
from ot_dist.data.caches import (LatentEncoder, TextEncoder, attach_latent_cache, attach_text_cache,
                                 expected_record, read_cache_manifest)
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import build_shard_set
from ot_dist.errors import InputFileError
from ot_dist.models.loading import load_model

CHUNK = 5  # 22 samples: chunks of 5, 5, 5, 5 and 2


@pytest.fixture(scope="module")
def built(tiny_models, shapes_data, tmp_path_factory):
    """A shard set of 16 squares and 6 wide (1:2) images at 64 and 128 px, its config and the tiny SD 1.x model."""
    from conftest import base_config

    root = tmp_path_factory.mktemp("caches")
    data = root / "data"
    shutil.copytree(shapes_data, data)
    for i in range(6):
        Image.open(data / f"{i:04d}.png").resize((128, 64)).save(data / f"wide{i}.png")
        (data / f"wide{i}.txt").write_text(f"{(data / f'{i:04d}.txt').read_text()}\nanother line {i}")
    raw = base_config(tiny_models["sd1"], data, root / "out", resolution="64,128")
    raw["data"]["shards"] = str(root / "set")
    cfg = validate(raw)
    build_shard_set(cfg, root / "set", log=lambda *_: None)
    return root / "set", raw, load_model(cfg.model)


def fresh(built, folder: Path) -> ShardDataset:
    """A copy of the built set (no cache yet) at `folder`."""
    shutil.copytree(built[0], folder)
    return ShardDataset(folder, validate(built[1]))


def counting(dataset: ShardDataset, fail_after: int | None = None) -> list[int]:
    """The sample ids whose pixels the caching loads (one per resolution); with `fail_after`, the load after that
    many raises, as an interruption would stop the run."""
    calls, load = [], dataset.load

    def counted(i, *args, use_cache=True, **kw):
        if not use_cache:
            if fail_after is not None and len(calls) >= fail_after:
                raise RuntimeError("interrupted")
            calls.append(i)
        return load(i, *args, use_cache=use_cache, **kw)
    dataset.load = counted
    return calls


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cache_of(dataset: ShardDataset, kind: str) -> Path:
    (folder,) = dataset.dir.glob(f"{kind}-*")
    return folder


def test_an_interrupted_cache_resumes_computing_only_its_missing_chunks(built, tmp_path):
    from ot_dist.parallel.runtime import Runtime

    vae = built[2].vae
    interrupted = fresh(built, tmp_path / "a")
    calls = counting(interrupted, fail_after=2 * (CHUNK + CHUNK) + 3)  # 2 resolutions: chunks 0, 1 and 3 loads
    with pytest.raises(RuntimeError, match="interrupted"):
        attach_latent_cache(interrupted, vae, Runtime(), log=print, chunk_size=CHUNK)
    cache = cache_of(interrupted, "latents")
    assert sorted(p.name for p in cache.iterdir()) == ["chunk-000000.npy", "chunk-000000.tar", "chunk-000001.npy",
                                                        "chunk-000001.tar", "progress.json"]
    (cache / "chunk-000002.tar.tmp").write_bytes(b"half")  # what a killed process leaves (no exception ran)
    (cache / "chunk-000003.tmp.npy").write_bytes(b"half")
    resumed, lines = ShardDataset(interrupted.dir, validate(built[1])), []
    calls = counting(resumed)
    attach_latent_cache(resumed, vae, Runtime(), log=lines.append, chunk_size=CHUNK)
    assert sorted(calls) == sorted(list(range(10, 22)) * 2)  # chunks 2-4 only, at both resolutions
    assert "3 of 5 chunks of 5 samples to compute (2 done earlier)" in lines[0]

    whole = fresh(built, tmp_path / "b")
    attach_latent_cache(whole, vae, Runtime(), log=print, chunk_size=CHUNK)
    assert files(cache) == files(cache_of(whole, "latents"))  # byte for byte: chunks, tables, index, manifest
    for i in (0, 12, 21):
        assert torch.equal(resumed.load(i, 0)["latent_mean"], whole.load(i, 0)["latent_mean"])

    again = ShardDataset(interrupted.dir, validate(built[1]))
    calls, lines = counting(again), []
    attach_latent_cache(again, vae, Runtime(), log=lines.append, chunk_size=CHUNK)
    assert calls == [] and lines == []  # complete: read as it is

    # Chunks of another cache (here: another chunk size) are not resumed from: all is computed again.
    other = fresh(built, tmp_path / "c")
    counting(other, fail_after=2 * CHUNK)
    with pytest.raises(RuntimeError, match="interrupted"):
        attach_latent_cache(other, vae, Runtime(), log=print, chunk_size=CHUNK)
    other = ShardDataset(other.dir, validate(built[1]))
    calls = counting(other)
    attach_latent_cache(other, vae, Runtime(), log=print, chunk_size=11)
    assert sorted(calls) == sorted(list(range(22)) * 2)


def test_the_index_is_compact_mapped_shared_and_refused_by_file_name_when_missing_or_short(built, tmp_path):
    from ot_dist.parallel.runtime import Runtime

    dataset = fresh(built, tmp_path / "set")
    attach_latent_cache(dataset, built[2].vae, Runtime(), log=print)
    attach_text_cache(dataset, built[2], Runtime(), log=print)
    latents, text = dataset.caches["latents"], dataset.caches["text"]
    per_sample = (latents.nbytes() + text.nbytes()) / len(dataset)  # 2 resolutions + text: 3 member kinds
    assert per_sample == 36 and per_sample <= 64
    column = latents.column("128.latent.safetensors", "offset")
    assert isinstance(column, np.memmap) and not column.flags.writeable  # page-cache pages, shared on the node
    assert len(pickle.dumps(latents)) < 1000  # a spawned loader worker gets the folder, not the arrays
    assert len(pickle.loads(pickle.dumps(latents)).column("64.latent.safetensors", "size")) == len(dataset)
    batch = dataset.load(3, 0)
    assert batch["latent_mean"].shape[0] == 4 and "text_hidden" in batch

    manifest = json.loads((latents.dir / "manifest.json").read_text())
    earlier = tmp_path / "earlier"  # a cache of format 1: one JSON entry per sample, no format field
    earlier.mkdir()
    (earlier / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "format"}))
    with pytest.raises(InputFileError, match=r"data.cache_text: the cache .*earlier was written by an earlier ot_dist "
                                             r"\(format ot_dist.cache/1\), this one reads ot_dist.cache/2; delete"):
        read_cache_manifest(earlier, expected_record(dataset, "k"), "text")
    path = latents.dir / "index" / "128.latent.offset.npy"
    path.write_bytes(path.read_bytes()[:-40])  # cut short
    with pytest.raises(InputFileError, match=r"data.cache_latents: the cache index .*128.latent.offset.npy"):
        CacheIndex(latents.dir, manifest, "data.cache_latents")
    path.unlink()
    with pytest.raises(InputFileError, match=r"the cache index .*128.latent.offset.npy is missing"):
        attach_latent_cache(ShardDataset(dataset.dir, validate(built[1])), built[2].vae, Runtime(), log=print)


def decoded(members: list[dict[str, bytes]]) -> list[dict[str, dict[str, torch.Tensor]]]:
    return [{name: load(data) for name, data in sample.items()} for sample in members]


def encoded(encoder, ids: range) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """sample id -> member -> tensors, through the encoder's batches as a chunk is written."""
    batches = encoder.batches(ids)
    return {i: members for batch, inputs in zip(batches, encoder.inputs(batches))
            for i, members in zip(batch, decoded(encoder.encode(batch, inputs)))}


def test_batched_encoding_equals_one_sample_at_a_time(built, tmp_path):
    dataset = fresh(built, tmp_path / "set")
    model = built[2]
    for batched, single in ((LatentEncoder(dataset, model.vae), LatentEncoder(dataset, model.vae, batch_pixels=1)),
                            (TextEncoder(dataset, model), TextEncoder(dataset, model, batch_samples=1))):
        batches = batched.batches(range(22))
        assert sorted(i for b in batches for i in b) == list(range(22)) and max(map(len, batches)) > 1
        assert max(map(len, single.batches(range(22)))) == 1
        together, alone = encoded(batched, range(22)), encoded(single, range(22))
        assert together.keys() == alone.keys() == set(range(22))
        for i in range(22):
            assert alone[i].keys() == together[i].keys()
            for member, tensors in alone[i].items():
                assert tensors.keys() == together[i][member].keys()
                for name, value in tensors.items():
                    torch.testing.assert_close(together[i][member][name], value, rtol=1e-5, atol=1e-5)
    # the latent batches hold one bucket each (one size), in bucket then id order
    latent_batches = LatentEncoder(dataset, model.vae).batches(range(22))
    buckets = [{int(dataset.index.bucket[i]) for i in b} for b in latent_batches]
    assert all(len(b) == 1 for b in buckets) and len(buckets) >= 2
    # images read by a loader process while the VAE encodes: the same latents, bit for bit
    in_process, in_worker = encoded(LatentEncoder(dataset, model.vae), range(22)), encoded(
        LatentEncoder(dataset, model.vae, workers=1), range(22))
    assert all(torch.equal(in_process[i][m][t], in_worker[i][m][t]) for i in in_process for m in in_process[i]
               for t in in_process[i][m])


def test_two_ranks_resume_what_one_process_started_and_cache_like_one_process(built, tiny_models, tmp_path):
    """Also on a set of existing webdataset tars indexed as they are (`shard index`), read with the centre crop, and
    with cached variations (2 augmented versions of each image, 2 shuffled versions of each caption)."""
    from test_external_tars import write_tars

    from ot_dist.cli import main
    from ot_dist.parallel.runtime import Runtime

    external = tmp_path / "external"
    assert main(["shard", "index", str(write_tars(tmp_path / "tars") / "wds-*.tar"), "--out", str(external),
                 "--resolution", "16", "--bucket-step", "8", "--max-bad-fraction", "0.05"]) == 0
    ext_raw = {"model": {"family": "sd1", "path": str(tiny_models["sd1"])}, "method": "full", "output_dir": "o",
               "data": {"shards": str(external), "bucket_step": 8, "max_bad_fraction": 0.05, "crop": "center"},
               "resolution": 16, "batch_size": 2, "seed": 3}
    model = built[2]
    varied_raw = {**built[1], "data": {**built[1]["data"], "path": None, "concepts": [
        {"path": built[1]["data"]["path"], "flip_probability": 0.5, "brightness": 0.4, "image_variations": 2,
         "tag_shuffling": True, "keep_tags_count": 0, "text_variations": 2}]}}
    shutil.copytree(built[0], tmp_path / "varied")
    shutil.copytree(built[0], tmp_path / "varied-one")
    sets = {"own": (fresh(built, tmp_path / "own"), built[1]), "external": (None, ext_raw),
            "varied": (ShardDataset(tmp_path / "varied", validate(varied_raw)), varied_raw)}
    reference = {"own": fresh(built, tmp_path / "own-one"), "external": None,
                 "varied": ShardDataset(tmp_path / "varied-one", validate(varied_raw))}
    shutil.copytree(external, tmp_path / "external-one")
    sets["external"] = (ShardDataset(external, validate(ext_raw)), ext_raw)
    reference["external"] = ShardDataset(tmp_path / "external-one", validate(ext_raw))
    per = {"own": 2, "external": 1, "varied": 4}  # pixel loads a sample: resolutions x versions
    # one process starts, and is interrupted in the second chunk of latents (before any text)
    for name, (dataset, _) in sets.items():
        counting(dataset, fail_after=per[name] * CHUNK + 1)
        with pytest.raises(RuntimeError, match="interrupted"):
            attach_latent_cache(dataset, model.vae, Runtime(), log=print, chunk_size=CHUNK)
    args = [a for name, (dataset, raw) in sets.items() for a in (str(dataset.dir), json.dumps(raw))]
    done = run_ranks(str(Path(__file__).parent / "helpers" / "cache_ranks.py"), str(tmp_path), str(CHUNK), *args)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, (dataset, _) in sets.items():
        n = len(dataset)
        chunks = [set(range(c * CHUNK, min(n, (c + 1) * CHUNK))) for c in range(-(-n // CHUNK))]
        for rank, counted in enumerate(ranks):
            mine = set().union(*chunks[rank::2])
            # latents: chunk 0 was committed before the interruption; text: every chunk of the rank's
            assert sorted(counted[str(dataset.dir)]["latents"]) == sorted(list(mine - chunks[0]) * per[name])
            assert set(counted[str(dataset.dir)]["text"]) == mine
        one = reference[name]
        attach_latent_cache(one, model.vae, Runtime(), log=print, chunk_size=CHUNK)
        attach_text_cache(one, model, Runtime(), log=print, chunk_size=CHUNK)
        for kind in ("latents", "text"):
            assert files(cache_of(dataset, kind)) == files(cache_of(one, kind)), (name, kind)
    for kind, member in (("latents", "128.latent.v1.safetensors"), ("text", "text.v1.safetensors")):
        assert member in json.loads((cache_of(sets["varied"][0], kind) / "manifest.json").read_text())["members"]
    # the external set's cached latents are the centre crops' posteriors, as the images would train
    one = reference["external"]
    with torch.no_grad():
        for i in range(0, len(one), 7):
            pixels = one.load(i, 0, use_cache=False)["pixels"]
            posterior = model.vae.encode(pixels[None]).latent_dist
            cached = one.load(i, 0)
            torch.testing.assert_close(cached["latent_mean"], posterior.mean[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cached["crop_top_left"], one.load(i, 0, use_cache=False)["crop_top_left"])


def test_a_rank_done_with_its_chunks_waits_for_a_slower_one_past_the_default_timeout(built, tmp_path):
    """On a large set one rank (a slower node) may encode its chunks long after the others: they wait for it, and
    for the main process's index, in a group of their own, not in the default group whose timeout
    (distributed.timeout_minutes, here 3 s) is for collectives that follow one another closely."""
    dataset = fresh(built, tmp_path / "own")
    done = run_ranks(str(Path(__file__).parent / "helpers" / "cache_ranks.py"), str(tmp_path), str(CHUNK),
                     str(dataset.dir), json.dumps(built[1]),
                     env={"CACHE_TIMEOUT_MINUTES": "0.05", "SLOW_RANK_SECONDS": "8"}, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (cache_of(dataset, "latents") / "manifest.json").is_file()
    assert (cache_of(dataset, "text") / "manifest.json").is_file()
