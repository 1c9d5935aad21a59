"""`ot-dist k8s CONFIG --shard-parts N` (issue 25): the Indexed Job that builds a shard set in parts and its merge
Job validate like the training manifests (Kubernetes 1.32 schemas, strict; the pod security policy), run on the
training pods' volume and ConfigMap, and their exact commands, run as the kubelet would start them (merge first,
waiting), build the set where training on that volume looks for it, equal to a one-process build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from ot_dist.cli import main
from ot_dist.config.load import load_config
from ot_dist.data.shards import build_shard_set, is_current, read_manifest, source_fingerprint
from ot_dist.data.training_data import shard_dir_of
from tests.test_k8s import REPO, expand, pod_specs, render

DEMO = REPO / "configs" / "demo.yaml"


def render_shards(out: Path, parts: int, *extra: str) -> dict[str, dict]:
    return render(DEMO, out, 1, 1, "indexed-job", "--shard-parts", str(parts), "--shard-workers", "2",
                  "--name", "demo", *extra)  # fmt: skip


def test_the_shard_jobs_validate_and_share_the_training_pods_volume_and_config(tmp_path):
    rendered = render_shards(tmp_path / "shards", 3)  # render() validates every object and checks the policy
    assert sorted(rendered) == ["configmap.yaml", "kustomization.yaml", "shard-build-job.yaml", "shard-merge-job.yaml"]
    parts, merge = rendered["shard-build-job.yaml"], rendered["shard-merge-job.yaml"]
    assert parts["spec"]["completionMode"] == "Indexed"
    assert parts["spec"]["completions"] == parts["spec"]["parallelism"] == 3
    command = pod_specs(parts)[0]["containers"][0]["command"]
    assert command[:3] == ["ot-dist", "shard", "build"]
    assert command[command.index("--part") + 1] == "$(JOB_COMPLETION_INDEX)/3"
    assert pod_specs(merge)[0]["containers"][0]["command"][:6] == ["ot-dist", "shard", "merge",
                                                                    "/etc/ot-dist/train.yaml", "--parts", "3"]
    training = render(DEMO, tmp_path / "train", 2, 1, "indexed-job", "--name", "demo")
    assert rendered["configmap.yaml"] == training["configmap.yaml"]  # one config for building and training
    train_pod = pod_specs(training["job.yaml"])[0]
    for job in (parts, merge):
        pod = pod_specs(job)[0]
        container = pod["containers"][0]
        assert "nvidia.com/gpu" not in container["resources"]["requests"]
        assert container["workingDir"] == train_pod["containers"][0]["workingDir"] == "/workspace"
        volumes = {v["name"]: v for v in pod["volumes"]}
        train_volumes = {v["name"]: v for v in train_pod["volumes"]}
        for mount in container["volumeMounts"]:
            if mount["mountPath"] in ("/workspace", "/etc/ot-dist"):
                assert mount in train_pod["containers"][0]["volumeMounts"]
                assert volumes[mount["name"]] == train_volumes[mount["name"]]
        # not selected by the training job's headless Service
        assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] != "demo"
    assert pod_specs(parts)[0]["containers"][0]["resources"]["requests"]["cpu"] == "2"
    assert main(["k8s", str(DEMO), "--image", "x", "--shard-parts", "0"]) == 2


def test_no_image_folders_exits_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    raw = yaml.safe_load(DEMO.read_text())
    del raw["data"]["path"]
    raw["data"]["shards"] = "data_shards/x"
    config.write_text(yaml.safe_dump(raw))
    assert main(["k8s", str(config), "--image", "x", "--shard-parts", "2"]) == 2
    assert "--shard-parts" in capsys.readouterr().err


def pod_command(job: dict, index: int, volumes: dict[str, Path]) -> tuple[list[str], dict, Path]:
    """The pod's command, environment and working folder as the kubelet would start it, mounts mapped to folders."""
    container = pod_specs(job)[0]["containers"][0]
    provided = {"metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index)}
    env = {}
    for entry in container["env"]:
        env[entry["name"]] = (expand(entry["value"], env) if "value" in entry
                              else provided[entry["valueFrom"]["fieldRef"]["fieldPath"]])

    def local(text: str) -> str:
        for mount, folder in volumes.items():
            text = text.replace(mount, str(folder))
        return text

    command = [local(expand(part, env)) for part in container["command"]]
    assert command[0] == "ot-dist" and "$(" not in " ".join(command), command
    return ([sys.executable, "-m", "ot_dist", *command[1:]],
            {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), **{k: local(v) for k, v in env.items()}},
            Path(local(container["workingDir"])))


def test_the_pods_commands_build_the_set_training_reads(shapes_data, tmp_path, monkeypatch):
    rendered = render_shards(tmp_path / "manifests", 2)
    workspace = tmp_path / "workspace"
    shutil.copytree(shapes_data, workspace / "demo_out" / "shapes")
    config_dir = tmp_path / "configmap"
    config_dir.mkdir()
    for file, text in rendered["configmap.yaml"]["data"].items():
        (config_dir / file).write_text(text)
    volumes = {"/workspace": workspace, "/etc/ot-dist": config_dir, "/home/ot-dist": tmp_path / "home"}
    # the merge pod may start first: it waits for the parts
    command, env, cwd = pod_command(rendered["shard-merge-job.yaml"], 0, volumes)
    merge = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parts = []
    try:
        for index in (0, 1):  # the two part pods run side by side
            command, env, cwd = pod_command(rendered["shard-build-job.yaml"], index, volumes)
            parts.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        for index, part in enumerate(parts):
            out = part.communicate(timeout=240)[0]
            assert part.returncode == 0 and f"shard part {index}/2" in out, out
        output = merge.communicate(timeout=240)[0]
    finally:
        for process in [merge, *parts]:
            process.kill()
    assert merge.returncode == 0, output
    # training from the workspace (the pods' working folder) finds the set, current, in 2 parts' shards
    monkeypatch.chdir(workspace)
    config = load_config(str(config_dir / "train.yaml"), [])
    shards = shard_dir_of(config)
    assert is_current(shards, source_fingerprint(config))
    manifest = read_manifest(shards)
    assert {s["file"].split("/")[0] for s in manifest["shards"]} == {"part-00000-of-00002", "part-00001-of-00002"}
    whole = build_shard_set(config, tmp_path / "whole", log=lambda *_: None)
    assert [{k: s[k] for k in ("key", "bucket", "concept")} for s in manifest["samples"]] == \
        [{k: s[k] for k in ("key", "bucket", "concept")} for s in whole["samples"]]
