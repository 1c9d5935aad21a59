"""The shard cache folder (issue 18): default shard sets live under data.cache_dir / OT_DIST_CACHE / ot_dist-cache
beside output_dir, not in the working folder; `ot-dist shard list | prune` show and remove the stale ones."""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml
from test_data_shards import make_images

from ot_dist.cli import main
from ot_dist.config.load import validate
from ot_dist.data.shard_cache import BUILD_GRACE_SECONDS, LAST_USED, mark_used, scan_sets
from ot_dist.data.shards import build_shard_set
from ot_dist.data.training_data import shard_dir_of


def raw_config(folder, out, **data):
    return {"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": str(out),
            "data": {"path": str(folder), **data}, "resolution": 64, "batch_size": 2}


def test_where_the_default_shard_set_goes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OT_DIST_CACHE", raising=False)
    folder = make_images(tmp_path / "dogs", [(64, 64)] * 2)
    default = shard_dir_of(validate(raw_config(folder, "runs/a")))
    assert default.parent == Path("runs") / "ot_dist-cache" / "shards"  # beside output_dir runs/a
    assert default.name.startswith("dogs-")
    monkeypatch.setenv("OT_DIST_CACHE", str(tmp_path / "env-cache"))
    assert shard_dir_of(validate(raw_config(folder, "runs/a"))).parent == tmp_path / "env-cache" / "shards"
    assert shard_dir_of(validate(raw_config(folder, "runs/a", cache_dir=str(tmp_path / "c")))).parent == \
        tmp_path / "c" / "shards"
    # a set an earlier ot_dist built in ./data_shards/ is used where it is, not rebuilt
    legacy = tmp_path / "data_shards" / default.name
    build_shard_set(validate(raw_config(folder, "runs/a")), legacy, log=lambda *_: None)
    assert shard_dir_of(validate(raw_config(folder, "runs/a"))).resolve() == legacy


def test_list_and_prune(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OT_DIST_CACHE", raising=False)
    cache = tmp_path / "cache"
    quiet = lambda *_: None  # noqa: E731
    dogs, cats, gone = (make_images(tmp_path / n, [(64, 64)] * 3, seed=i) for i, n in enumerate(("dogs", "cats", "gone")))
    configs = {n: validate(raw_config(f, tmp_path / "out", cache_dir=str(cache))) for n, f in
               (("dogs", dogs), ("cats", cats), ("gone", gone))}
    sets = {n: shard_dir_of(c) for n, c in configs.items()}
    for name, config in configs.items():
        build_shard_set(config, sets[name], log=quiet)
    mark_used(sets["dogs"])
    (dogs / "0000.txt").write_text("an edited caption\n")  # dogs: sources changed since the build
    for path in gone.iterdir():
        path.unlink()
    gone.rmdir()  # gone: its folder is gone
    old, new = cache / "shards" / "old-build", cache / "shards" / "new-build"  # builds that left no manifest
    for folder in (old, new):
        folder.mkdir()
        (folder / "shard-000000.tar").write_bytes(b"x" * 1000)
    past = time.time() - 2 * BUILD_GRACE_SECONDS
    os.utime(old / "shard-000000.tar", (past, past))

    status = {info.path.name: info.status for info in scan_sets(cache)}
    assert status == {sets["dogs"].name: "sources changed", sets["cats"].name: "current",
                      sets["gone"].name: "sources missing", "old-build": "incomplete", "new-build": "incomplete"}
    config_file = tmp_path / "cats.yaml"
    config_file.write_text(yaml.safe_dump(raw_config(cats, tmp_path / "out", cache_dir=str(cache))))
    assert main(["shard", "list", str(config_file)]) == 0
    out = capsys.readouterr().out
    cats_line = next(line for line in out.splitlines() if sets["cats"].name in line)
    assert "current" in cats_line and "3 samples" in cats_line and "<- this config" in cats_line
    assert "sources changed" in out and "last used" in out and "ot-dist shard prune --cache" in out

    assert main(["shard", "prune", "--cache", str(cache), "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and sets["dogs"].is_dir()
    assert main(["shard", "prune", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"removed {sets['dogs']}" in out and f"removed {sets['gone']}" in out and "removed " + str(old) in out
    assert "freed" in out
    assert sorted(p.name for p in (cache / "shards").iterdir()) == sorted([sets["cats"].name, "new-build"])
    # unused for a day: removed only when asked, and never the set of the config given
    mark_used(sets["cats"])
    past = time.time() - 2 * 86400
    for f in sets["cats"].rglob("*"):
        os.utime(f, (past, past))
    assert (sets["cats"] / LAST_USED).is_file()
    assert main(["shard", "prune", str(config_file), "--unused-days", "1"]) == 0
    assert sets["cats"].is_dir()
    assert main(["shard", "prune", "--cache", str(cache), "--unused-days", "1"]) == 0
    assert not sets["cats"].exists() and "unused for 1 days" in capsys.readouterr().out
