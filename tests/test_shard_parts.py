"""Shard sets built in parts (`ot-dist shard build --part i/n`, issue 25) and merged (`ot-dist shard merge`): the
merged set equals a one-process build (samples, keys, bytes, bucket report, epoch plan), no tar is rewritten by the
merge, a finished part is skipped, an interrupted or stale one is built again, and a missing part stops the merge
naming it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from ot_dist.cli import main
from ot_dist.data import shard_parts
from ot_dist.data.plan import plan_epoch
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shard_parts import PART_FILE, build_part, merge_parts, part_dir
from ot_dist.data.shards import MANIFEST, build_shard_set, is_current, read_manifest, source_fingerprint
from ot_dist.errors import InputFileError
from tests.test_data_shards import MIXED, config, make_images

QUIET = {"log": lambda *_: None}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two concepts (one with masks, three aspects; one square), and a one-process build of them."""
    root = tmp_path_factory.mktemp("parts")
    first = make_images(root / "first", MIXED, masks=True)
    second = make_images(root / "second", [(64, 64)] * 5 + [(128, 64)] * 2, seed=4)
    cfg = config({"concepts": [{"path": str(first)}, {"path": str(second), "balancing": 2}], "bucket_step": 16,
                  "shard_size_mb": 0.02}, resolution="48,64")
    build_shard_set(cfg, root / "whole", **QUIET)
    return root, cfg


def sample_bytes(folder, cfg) -> list[tuple[str, dict[str, bytes]]]:
    """Every sample's key and members' bytes, in manifest order."""
    dataset = ShardDataset(folder, cfg)
    found = []
    for sample in dataset.samples:
        path = folder / dataset.manifest["shards"][sample["shard"]]["file"]
        found.append((sample["key"], {suffix: dataset.member_bytes(path, sample["key"], suffix, *where)
                                      for suffix, where in sample["members"].items()}))
    return found


def without_placement(manifest: dict) -> dict:
    """The manifest less where the samples sit (shard files, offsets): what a merge must reproduce."""
    kept = {k: v for k, v in manifest.items() if k != "shards"}
    kept["samples"] = [{k: v for k, v in s.items() if k not in ("shard", "members")} for s in manifest["samples"]]
    return kept


def plans(folder, cfg) -> list:
    table = ShardDataset(folder, cfg).table(cfg.data)
    return [plan_epoch(table, 4, cfg.resolutions(), cfg.seed, epoch) for epoch in range(2)]


def test_a_two_part_build_merged_equals_a_one_part_build(source, tmp_path, capsys):
    root, cfg = source
    whole = root / "whole"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "set"
    # each part on its own "machine" (here: two commands), the second over two encoder processes
    assert main(["shard", "build", str(path), "--out", str(out), "--part", "0/2"]) == 0
    assert not (out / MANIFEST).exists()  # a part alone is not a set
    assert main(["shard", "build", str(path), "--out", str(out), "--part", "1/2", "--workers", "2"]) == 0
    tars = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(out.glob("part-*/shard-*.tar"))}
    parts = [json.loads((part_dir(out, i, 2) / PART_FILE).read_text()) for i in range(2)]
    assert all(p["key"] for p in parts) and not set(parts[0]["key"]) & set(parts[1]["key"])  # disjoint, both used
    capsys.readouterr()
    assert main(["shard", "merge", str(path), "--out", str(out), "--world-size", "2"]) == 0
    merged_report = capsys.readouterr().out.split("bucket report", 1)[1]
    # no tar rewritten or moved: the manifest points into the part folders
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(out.glob("part-*/shard-*.tar"))} == tars
    merged, one = read_manifest(out), read_manifest(whole)
    assert {s["file"].split("/")[0] for s in merged["shards"]} == {"part-00000-of-00002", "part-00001-of-00002"}
    # the same samples (keys, buckets, concepts, masks) in the same order, the same buckets, concepts, report
    one["built_from"]["config"] = merged["built_from"]["config"]
    assert without_placement(merged) == without_placement(one)
    assert len(merged["samples"]) == len(MIXED) + 7 and is_current(out, source_fingerprint(cfg))
    assert sample_bytes(out, cfg) == sample_bytes(whole, cfg)
    capsys.readouterr()
    assert main(["shard", "build", str(path), "--out", str(tmp_path / "again"), "--world-size", "2"]) == 0
    assert merged_report == capsys.readouterr().out.split("bucket report", 1)[1]  # after the builds' summary lines
    # the same epoch plans for the same seed, and the same pixels loaded
    assert plans(out, cfg) == plans(whole, cfg)
    a, b = ShardDataset(out, cfg), ShardDataset(whole, cfg)
    for i in (0, 13, len(a) - 1):
        assert torch.equal(a.load(i, epoch=1)["pixels"], b.load(i, epoch=1)["pixels"])


def mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


def test_parts_resume_a_finished_part_is_skipped_an_interrupted_or_stale_one_rebuilt(source, tmp_path):
    root, cfg = source
    out = tmp_path / "set"
    lines = []
    build_part(cfg, out, (0, 3), log=lines.append)
    build_part(cfg, out, (2, 3), **QUIET)
    done = mtimes(part_dir(out, 0, 3))
    # a missing part stops the merge (exit 3 from the CLI), naming it; --wait waits, then says the same
    with pytest.raises(InputFileError, match=r"1 of 3 parts are not ready: part 1/3 .*part-00001-of-00003"):
        merge_parts(cfg, out, 3, wait=0.3, **QUIET)
    # an interrupted part: shards written, no part.json (here: one truncated tar and a stray file)
    build_part(cfg, out, (1, 3), **QUIET)
    interrupted = part_dir(out, 1, 3)
    (interrupted / PART_FILE).unlink()
    tar = sorted(interrupted.glob("shard-*.tar"))[0]
    tar.write_bytes(tar.read_bytes()[:700])
    (interrupted / "shard-999999.tar").write_bytes(b"junk")
    with pytest.raises(InputFileError, match="part 1/3 .* not built or not finished"):
        merge_parts(cfg, out, 3, **QUIET)
    lines.clear()
    build_part(cfg, out, (0, 3), log=lines.append)  # finished: skipped, nothing rewritten
    assert "skipped" in lines[0] and mtimes(part_dir(out, 0, 3)) == done
    build_part(cfg, out, (1, 3), **QUIET)  # rebuilt from nothing
    assert not (interrupted / "shard-999999.tar").exists()
    merge_parts(cfg, out, **QUIET)  # the number of parts from the folders
    assert sample_bytes(out, cfg) == sample_bytes(root / "whole", cfg)
    # sources changed: the merged set and every finished part are stale; building a part again clears the manifest
    caption = cfg.data.concept_list()[1][1].path + "/0002.txt"
    original = open(caption).read()
    try:
        with open(caption, "w") as f:
            f.write("another caption\n")
        assert not is_current(out, source_fingerprint(cfg))
        with pytest.raises(InputFileError, match="part 0/3 .* other sources"):
            merge_parts(cfg, out, 3, **QUIET)
        build_part(cfg, out, (0, 3), **QUIET)
        assert not (out / MANIFEST).exists() and mtimes(part_dir(out, 0, 3)) != done
    finally:
        with open(caption, "w") as f:
            f.write(original)


def test_a_whole_build_clears_the_parts_and_parts_of_another_count(source, tmp_path):
    root, cfg = source
    out = tmp_path / "set"
    build_part(cfg, out, (0, 2), **QUIET)
    build_part(cfg, out, (1, 3), **QUIET)  # another split: the 2-part folders go
    assert [p.name for p in sorted(out.iterdir())] == ["part-00001-of-00003"]
    build_shard_set(cfg, out, **QUIET)
    assert not list(out.glob("part-*")) and is_current(out, source_fingerprint(cfg))


@pytest.mark.parametrize("part", ["2/2", "1", "-1/2", "a/b", "0/0"])
def test_a_bad_part_exits_2_naming_it(source, tmp_path, capsys, part):
    _, cfg = source
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["shard", "build", str(path), "--out", str(tmp_path / "s"), f"--part={part}"]) == 2
    assert f"--part {part!r}" in capsys.readouterr().err


def test_merge_without_parts_exits_naming_the_folder(source, tmp_path, capsys):
    _, cfg = source
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["shard", "merge", str(path), "--out", str(tmp_path / "empty")]) == 2
    assert "no part folders" in capsys.readouterr().err
    assert shard_parts.parse_part(" 3 / 4 ") == (3, 4)


def test_unreadable_images_found_over_workers_and_limited_over_all_parts(tmp_path):
    folder = make_images(tmp_path / "imgs", [(64, 64)] * 6)
    (folder / "0004.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    loose = config({"path": str(folder), "bucket_step": 16, "max_bad_fraction": 0.2})
    one = build_shard_set(loose, tmp_path / "one", **QUIET, workers=2)
    assert [b["file"] for b in one["unreadable_images"]] == [str(folder / "0004.png")]
    for part in range(2):
        build_part(loose, tmp_path / "parts", (part, 2), workers=2, **QUIET)
    merged = merge_parts(loose, tmp_path / "parts", **QUIET)
    assert merged["unreadable_images"] == one["unreadable_images"]
    assert [s["key"] for s in merged["samples"]] == [s["key"] for s in one["samples"]]
    # 1 of 6 is over a limit of 10 %: the part holding it builds (1 of its 3), the merge stops as a whole build does
    strict = config({"path": str(folder), "bucket_step": 16, "max_bad_fraction": 0.1})
    with pytest.raises(InputFileError, match=r"0004.png.*1 of 6 images unreadable"):
        build_shard_set(strict, tmp_path / "strict-one", **QUIET)
    for part in range(2):
        build_part(strict, tmp_path / "strict", (part, 2), **QUIET)
    with pytest.raises(InputFileError, match=r"0004.png.*1 of 6 images unreadable"):
        merge_parts(strict, tmp_path / "strict", **QUIET)


def test_train_start_waits_for_parts_and_merges_them_instead_of_building_over_them(tmp_path):
    import threading

    from ot_dist.data.training_data import ensure_shards
    from ot_dist.parallel.runtime import Runtime

    folder = make_images(tmp_path / "imgs", [(64, 64)] * 4 + [(128, 64)] * 2)
    cfg = config({"path": str(folder), "shards": str(tmp_path / "set"), "bucket_step": 16})
    build_part(cfg, tmp_path / "set", (0, 2), **QUIET)
    finished = part_dir(tmp_path / "set", 0, 2) / PART_FILE
    built = finished.stat().st_mtime_ns
    later = threading.Timer(1.0, lambda: build_part(cfg, tmp_path / "set", (1, 2), **QUIET))
    later.start()  # part 1 finishes while training waits
    logged = []
    try:
        ensure_shards(cfg, Runtime(), logged.append)
    finally:
        later.join()
    assert "built in parts; waiting" in logged[0] and not any("building it" in line for line in logged)
    assert finished.stat().st_mtime_ns == built and is_current(tmp_path / "set", source_fingerprint(cfg))
    assert len(read_manifest(tmp_path / "set")["samples"]) == 6
    # parts from other sources: named, not waited for, not built over
    (folder / "0001.txt").write_text("a new caption\n")
    with pytest.raises(InputFileError, match="part 0/2 .* other sources"):
        ensure_shards(cfg, Runtime(), logged.append)
    assert finished.stat().st_mtime_ns == built
