"""Kubernetes: the manifests in k8s/ and those `ot-dist k8s` renders are valid API objects (offline
schemas), compose under kustomize into exactly what the renderer writes, keep the pod security
policy, and the command a rendered pod runs, started as two nodes on 127.0.0.1, trains the demo (the PyTorchJob's;
the Indexed Job's pods run the same training command after a static rendezvous, which they are shown to meet in)."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from ot_dist.cli import main
from ot_dist.ports import free_port

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
KUBERNETES_VERSION = "1.32.0"
# overlay -> (nodes, GPUs per node) it patches the base to
OVERLAYS = {"lora-1gpu": (1, 1), "full-zero2-8gpu": (1, 8), "full-fsdp-multinode": (4, 8)}
FLAVORS = ("pytorchjob", "indexed-job")
KUBECTL = shutil.which("kubectl")
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import mini_kustomize  # noqa: E402  (kustomize's subset used in k8s/, for machines without kubectl)


# --------------------------------------------------------------------------------------------------
# Helpers: rendering, kustomize, schema validation, the security policy
# --------------------------------------------------------------------------------------------------


def render(config: Path, out: Path, nodes: int, gpus: int, flavor: str, *extra: str) -> dict[str, dict]:
    """`ot-dist k8s ... --out DIR`, read back: file name -> manifest."""
    args = ["k8s", str(config), "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--image", "ot-dist:latest",
            "--flavor", flavor, "--out", str(out), *extra]  # fmt: skip
    assert main(args) == 0
    rendered = {path.name: yaml.safe_load(path.read_text()) for path in sorted(out.glob("*.yaml"))}
    for file, doc in rendered.items():  # every rendered output is a valid object that keeps the policy
        if file != "kustomization.yaml":
            validate_manifest(doc)
            assert policy_violations(doc) == [], file
    return rendered


def kubectl_kustomize(folder: Path) -> list[dict]:
    built = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def kustomize(folder: Path) -> list[dict]:
    """`kubectl kustomize FOLDER` where kubectl is installed, else the same subset in tests/helpers/mini_kustomize.py
    (checked equal to kubectl's output by test_mini_kustomize_equals_kubectl wherever kubectl exists)."""
    return kubectl_kustomize(folder) if KUBECTL else mini_kustomize.build(folder)


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml")
                  if yaml.safe_load(p.read_text()).get("kind") != "Component")


def static_manifests() -> dict[str, dict]:
    """Every Kubernetes object written as a file under k8s/: not kustomize's own files, the training
    configs, or the overlays' partial patches (the overlays are checked as kustomize composes them)."""
    found = {}
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "train.yaml") or "overlays" in path.relative_to(K8S).parts:
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            found[f"{path.relative_to(K8S)}#{i}"] = doc
    return found


@functools.cache
def pytorchjob_validator() -> jsonschema.Validator:
    """The PyTorchJob CRD schema (tests/data, see its header), its pod template checked against the
    strict core schema of the same Kubernetes version that validates the other kinds."""
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    definitions = schema_contents(f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/_definitions.json",
                                  KUBERNETES_VERSION)  # fmt: skip
    schema = yaml.safe_load((REPO / "tests" / "data" / "pytorchjob-v1-schema.yaml").read_text())
    registry = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_manifest(doc: dict) -> None:
    """Raises on an object the API server (with strict field validation) would reject."""
    if doc["kind"] == "PyTorchJob":
        pytorchjob_validator().validate(doc)
    else:
        import kubernetes_validate

        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "PyTorchJob":
        return [replica["template"]["spec"] for replica in spec["pytorchReplicaSpecs"].values()]
    if "template" in spec:  # Job, Deployment, StatefulSet, ...
        return [spec["template"]["spec"]]
    if doc["kind"] == "Pod":
        return [spec]
    return []


SECRET_LIKE = re.compile(r"PASSWORD|TOKEN|SECRET|CREDENTIAL|USERNAME|API_KEY|ACCESS_KEY|TRACKING_URI")


def policy_violations(doc: dict) -> list[str]:
    """The pod security rules of the Kubernetes issue, for every container of every pod in `doc`."""
    found = []
    if doc["kind"] == "Secret":
        found.append("a Secret with literal data is part of the manifests")
    for pod in pod_specs(doc):
        pod_security = pod.get("securityContext", {})
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(flag):
                found.append(f"{flag}: true")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        found += [f"volume {name} is a hostPath" for name, v in volumes.items() if "hostPath" in v]
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"container {container['name']}"
            security = container.get("securityContext", {})
            if not security.get("runAsNonRoot", pod_security.get("runAsNonRoot")):
                found.append(f"{where}: runAsNonRoot is not true")
            if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
                found.append(f"{where}: runs as user 0")
            if security.get("allowPrivilegeEscalation") is not False:
                found.append(f"{where}: allowPrivilegeEscalation is not false")
            if security.get("privileged"):
                found.append(f"{where}: privileged")
            if security.get("capabilities", {}).get("drop") != ["ALL"] or security.get("capabilities", {}).get("add"):
                found.append(f"{where}: capabilities are not drop [ALL] with nothing added")
            seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {}))
            if seccomp.get("type") != "RuntimeDefault":
                found.append(f"{where}: seccompProfile is not RuntimeDefault")
            if security.get("readOnlyRootFilesystem") is not True:
                found.append(f"{where}: the root filesystem is writable")
            mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts", [])}
            if "emptyDir" not in mounts.get("/tmp", {}):
                found.append(f"{where}: /tmp is not a writable emptyDir")
            home = next((e.get("value") for e in container.get("env", []) if e["name"] == "HOME"), None)
            if home is not None and not any(home.startswith(path) for path in mounts):
                found.append(f"{where}: HOME {home} is on the read-only root filesystem")
            if "/dev/shm" in mounts and mounts["/dev/shm"].get("emptyDir", {}).get("medium") != "Memory":
                found.append(f"{where}: /dev/shm is not a memory emptyDir")
            for entry in container.get("env", []):
                if SECRET_LIKE.search(entry["name"]) and "secretKeyRef" not in entry.get("valueFrom", {}):
                    found.append(f"{where}: {entry['name']} is not read from a Secret")
    return found


# --------------------------------------------------------------------------------------------------
# Schemas and composition
# --------------------------------------------------------------------------------------------------


def test_every_static_manifest_validates_and_keeps_the_policy():
    manifests = static_manifests()
    kinds = {doc["kind"] for doc in manifests.values()}
    assert {"PyTorchJob", "Job", "Service", "ConfigMap", "PersistentVolumeClaim", "Deployment"} <= kinds
    for where, doc in manifests.items():
        validate_manifest(doc)
        assert policy_violations(doc) == [], where


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_composes_into_what_the_renderer_writes(overlay, flavor, tmp_path):
    """`kubectl kustomize k8s/overlays/X/FLAVOR` (base + the overlay's config and patches) is valid,
    keeps the policy, and equals `ot-dist k8s` for the overlay's config and shape."""
    built = kustomize(K8S / "overlays" / overlay / flavor)
    for doc in built:
        validate_manifest(doc)
        assert policy_violations(doc) == [], doc["kind"]
    nodes, gpus = OVERLAYS[overlay]
    config = K8S / "overlays" / overlay / "config" / "train.yaml"
    rendered = render(config, tmp_path, nodes, gpus, flavor, "--name", "ot-dist")
    expected = {(d["kind"], d["metadata"]["name"]): d for f, d in rendered.items() if f != "kustomization.yaml"}
    composed = {(d["kind"], d["metadata"]["name"]): d for d in built}
    assert composed.keys() == expected.keys()
    for key, doc in composed.items():
        if key[0] == "ConfigMap":  # kustomize keeps the file's text (comments); the renderer dumps its YAML
            assert yaml.safe_load(doc["data"]["train.yaml"]) == yaml.safe_load(expected[key]["data"]["train.yaml"])
            assert yaml.safe_load(doc["data"]["train.yaml"]) == yaml.safe_load(config.read_text())
            continue
        assert doc == expected[key], f"{overlay}/{flavor}: {key} differs from the renderer's"
    workers = pod_specs(composed[("PyTorchJob" if flavor == "pytorchjob" else "Job", "ot-dist")])[0]["containers"][0]
    env = {e["name"]: e.get("value") for e in workers["env"]}
    assert (env["NNODES"], env["NPROC_PER_NODE"]) == (str(nodes), str(gpus))
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)


def test_the_base_is_the_renderers_output_and_the_other_kustomizations_build(tmp_path):
    """k8s/base/FLAVOR is `ot-dist k8s` output (regenerate it with the command in k8s/README.md)."""
    for flavor in FLAVORS:
        rendered = render(K8S / "overlays" / "lora-1gpu" / "config" / "train.yaml", tmp_path / flavor, 1, 1, flavor,
                          "--name", "ot-dist")  # fmt: skip
        base = {p.name: yaml.safe_load(p.read_text()) for p in sorted((K8S / "base" / flavor).glob("*.yaml"))}
        assert base == rendered, f"k8s/base/{flavor} is stale"
        for doc in kustomize(tmp_path / flavor):  # rendered output is a kustomization too
            validate_manifest(doc)
    for flavor in FLAVORS:  # the README's way to set the image reaches the pods of both flavors
        wrapper = tmp_path / f"image-{flavor}"
        wrapper.mkdir()
        overlay = os.path.relpath(K8S / "overlays" / "full-fsdp-multinode" / flavor, wrapper)
        (wrapper / "kustomization.yaml").write_text(yaml.safe_dump(
            {"resources": [overlay], "images": [{"name": "ot-dist", "newName": "registry.example/ot", "newTag": "v1"}]}))
        pods = [pod for doc in kustomize(wrapper) for pod in pod_specs(doc)]
        assert pods and all(c["image"] == "registry.example/ot:v1" for pod in pods for c in pod["containers"])
    for folder in ("storage", "mlflow"):
        for doc in kustomize(K8S / folder):
            validate_manifest(doc)
            assert policy_violations(doc) == []


@pytest.mark.skipif(KUBECTL is None, reason="the cross-check needs kubectl; the other tests use mini_kustomize")
def test_mini_kustomize_equals_kubectl():
    """The fallback renders every kustomization in k8s/ into exactly kubectl's objects."""
    key = lambda doc: (doc["kind"], doc["metadata"]["name"])  # noqa: E731
    folders = kustomizations()
    assert len(folders) >= 9
    for folder in folders:
        ours = sorted(mini_kustomize.build(folder), key=key)
        theirs = sorted(kubectl_kustomize(folder), key=key)
        for doc in ours + theirs:  # kustomize keeps the file's text; compare the parsed config
            if doc["kind"] == "ConfigMap":
                doc["data"] = {k: yaml.safe_load(v) for k, v in doc.get("data", {}).items()}
        assert ours == theirs, folder


def test_rendered_pods_mount_the_workspace_config_shm_and_read_mlflow_from_a_secret(tmp_path):
    rendered = render(REPO / "configs" / "demo.yaml", tmp_path, 2, 4, "indexed-job")
    job = rendered["job.yaml"]
    pod = pod_specs(job)[0]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert mounts["/workspace"]["persistentVolumeClaim"]["claimName"] == "ot-dist-workspace"
    assert container["workingDir"] == "/workspace"  # the config's relative paths live on the volume
    assert mounts["/etc/ot-dist"]["configMap"]["name"] == rendered["configmap.yaml"]["metadata"]["name"]
    assert yaml.safe_load(rendered["configmap.yaml"]["data"]["train.yaml"])["strategy"] == "fsdp"
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e for e in container["env"]}
    for variable, key in (("MLFLOW_TRACKING_URI", "tracking_uri"), ("MLFLOW_TRACKING_PASSWORD", "password")):
        assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": "ot-dist-mlflow", "key": key, "optional": True}
    # the object store's credentials (tars named by URL): every key of an optional Secret, as environment variables
    assert container["envFrom"] == [{"secretRef": {"name": "ot-dist-storage", "optional": True}}]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    assert pod["subdomain"] == rendered["service.yaml"]["metadata"]["name"] == job["metadata"]["name"]
    assert rendered["service.yaml"]["spec"]["clusterIP"] == "None"
    assert env["RDZV_ENDPOINT"]["value"] == "ot-dist-demo-0.ot-dist-demo:29400"  # the index-0 pod's DNS name
    assert "$(JOB_COMPLETION_INDEX)" in container["command"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    elastic = render(REPO / "configs" / "demo.yaml", tmp_path / "pj", 2, 4, "pytorchjob")["pytorchjob.yaml"]["spec"]
    assert elastic["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29400, "minReplicas": 2,
                                           "maxReplicas": 2, "maxRestarts": 3}  # fmt: skip
    assert elastic["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2


def test_pods_get_the_time_to_write_their_checkpoint_after_sigterm(tmp_path, capsys):
    """On SIGTERM the ranks finish the step, write a checkpoint and commit it; Kubernetes' default grace period (30
    s, the field unset) would kill a full finetune's pods in mid-write, losing what they trained since the last one."""
    for flavor, file in (("indexed-job", "job.yaml"), ("pytorchjob", "pytorchjob.yaml")):
        (pod,) = pod_specs(render(REPO / "configs" / "demo.yaml", tmp_path / flavor, 2, 4, flavor)[file])
        assert pod["terminationGracePeriodSeconds"] == 900
    longer = render(REPO / "configs" / "demo.yaml", tmp_path / "longer", 2, 4, "indexed-job", "--grace-seconds", "3600")
    assert pod_specs(longer["job.yaml"])[0]["terminationGracePeriodSeconds"] == 3600
    assert main(["k8s", str(REPO / "configs" / "demo.yaml"), "--image", "x", "--grace-seconds", "0"]) == 2
    assert "--grace-seconds must be >= 1" in capsys.readouterr().err


def test_validation_and_policy_reject_broken_manifests():
    """The checks above can fail: a misspelt field, a wrong type, and each security slip are caught."""
    job = yaml.safe_load((K8S / "base" / "pytorchjob" / "pytorchjob.yaml").read_text())
    for path, value in ((("spec", "elasticPolicy", "rdzvBackends"), "c10d"), (("spec", "nprocPerNode"), 8),
                        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containerz"), [])):  # fmt: skip
        broken = copy.deepcopy(job)
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate_manifest(broken)
    indexed = yaml.safe_load((K8S / "base" / "indexed-job" / "job.yaml").read_text())
    broken = copy.deepcopy(indexed)
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(broken)
    slips = {
        "hostNetwork": lambda pod, c: pod.update(hostNetwork=True),
        "hostPath": lambda pod, c: pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
        "allowPrivilegeEscalation": lambda pod, c: c["securityContext"].update(allowPrivilegeEscalation=True),
        "capabilities": lambda pod, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        "root filesystem": lambda pod, c: c["securityContext"].pop("readOnlyRootFilesystem"),
        "seccompProfile": lambda pod, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "runAsNonRoot": lambda pod, c: (c["securityContext"].pop("runAsNonRoot"), pod["securityContext"].pop("runAsNonRoot")),
        "MLFLOW_TRACKING_PASSWORD": lambda pod, c: c["env"].append({"name": "MLFLOW_TRACKING_PASSWORD", "value": "hunter2"}),
        "/tmp": lambda pod, c: c["volumeMounts"].remove({"name": "tmp", "mountPath": "/tmp"}),
    }  # fmt: skip
    for slip, apply in slips.items():
        broken = copy.deepcopy(indexed)
        pod = broken["spec"]["template"]["spec"]
        apply(pod, pod["containers"][0])
        assert any(slip in violation for violation in policy_violations(broken)), slip


def test_the_image_matches_what_the_pods_expect():
    """k8s/Dockerfile: the user, HOME and working directory the manifests assume, ot_dist installed."""
    from ot_dist.kube import HOME, RUN_AS, WORKSPACE

    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.search(rf"^USER {RUN_AS}:{RUN_AS}$", dockerfile, re.M)
    assert re.search(rf"useradd --uid {RUN_AS} .*--home-dir {HOME} ", dockerfile)
    assert re.search(rf"^WORKDIR {WORKSPACE}$", dockerfile, re.M)
    assert re.search(r'pip install "/src\[dist,[^"]*\]"', dockerfile)  # with DeepSpeed for zero1-3
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", dockerfile, re.M) and "ARG CUDA_IMAGE=nvidia/cuda:" in dockerfile


def test_bad_requests_exit_2_naming_the_problem(tmp_path, capsys):
    base = ["k8s", str(REPO / "configs" / "demo.yaml"), "--image", "x"]
    assert main(base + ["--nodes", "2", "--set", "strategy=single"]) == 2
    assert "strategy single runs one process" in capsys.readouterr().err
    assert main(base + ["--name", "Not_A_DNS_Name"]) == 2
    assert "--name 'Not_A_DNS_Name'" in capsys.readouterr().err
    assert main(base + ["--set", "learning_rate=fast"]) == 2
    assert "learning_rate" in capsys.readouterr().err
    assert main(["k8s", str(REPO / "configs" / "sd15_lora.yaml"), "--image", "x"]) == 0
    captured = capsys.readouterr()
    assert "model.path: /models/stable-diffusion-v1-5 is outside /workspace" in captured.err
    assert [d["kind"] for d in yaml.safe_load_all(captured.out)] == ["ConfigMap", "PyTorchJob"]


# --------------------------------------------------------------------------------------------------
# The pods' command, run as two nodes on this machine
# --------------------------------------------------------------------------------------------------


def operator_env(job: dict, replica_index: int) -> dict[str, str]:
    """What the training operator adds to a PyTorchJob worker's environment for an elastic policy
    (kubeflow/training-operator pkg/controller.v1/pytorch/elastic.go and envvar.go), plus the
    replica-index label our NODE_RANK reads."""
    policy = job["spec"]["elasticPolicy"]
    return {
        "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "PYTHONUNBUFFERED": "0",
        "metadata.labels['training.kubeflow.org/replica-index']": str(replica_index),
    }


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command (an undefined reference stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def pod_process(rendered: dict[str, dict], index: int, volumes: dict[str, Path], endpoint: str) -> tuple[list, dict, Path]:
    """The command, environment and working directory of the pod with index `index`, as the kubelet
    would start it, with the pod-provided values for this machine: volume mount paths map to local
    folders, the rendezvous host is 127.0.0.1:free port, the Secret does not exist (optional refs)."""
    job = rendered.get("pytorchjob.yaml") or rendered["job.yaml"]
    container = pod_specs(job)[0]["containers"][0]
    provided = {"metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index)}
    if job["kind"] == "PyTorchJob":
        provided |= operator_env(job, index)
        provided["PET_RDZV_ENDPOINT"] = endpoint
    env = {k: v for k, v in provided.items() if k.isidentifier()}
    for entry in container["env"]:
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif "fieldRef" in source:
            env[entry["name"]] = provided[source["fieldRef"]["fieldPath"]]
        else:
            assert source["secretKeyRef"]["optional"], entry  # no Secret here: an optional ref stays unset
    if "RDZV_ENDPOINT" in env:
        env["RDZV_ENDPOINT"] = endpoint

    mounts = re.compile("|".join(rf"(?<![\w/]){re.escape(m)}(?=/|$)" for m in sorted(volumes, key=len, reverse=True)))

    def local(text: str) -> str:  # one pass: a local folder may itself lie under /tmp
        return mounts.sub(lambda m: str(volumes[m.group(0)]), text)

    env = {name: local(value) for name, value in env.items()}
    command = [local(expand(part, env)) for part in container["command"]]
    assert command[0] == "ot-dist" and "$(" not in " ".join(command), command
    command = [sys.executable, "-m", "ot_dist", *command[1:]]  # the console script, from this checkout
    process_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return command, process_env, Path(local(container["workingDir"]))


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"node 0 never listened on {port} (exit code {process.poll()})")


@pytest.fixture(scope="module")
def demo_files(small_sd1, shapes_data, tmp_path_factory) -> Path:
    """The demo's model and data where configs/demo.yaml expects them (`ot-dist demo prepare`'s
    layout), from the session's 2-level SD 1.x model (small_sd1: 2 steps of the demo prove the pods' commands, not the
    model) and shapes data."""
    root = tmp_path_factory.mktemp("demo") / "demo_out"
    shutil.copytree(small_sd1, root / "tiny-sd1")
    shutil.copytree(shapes_data, root / "shapes")
    return root


def pods(flavor: str, demo_files: Path, tmp_path: Path) -> tuple[Path, int, list[tuple[list, dict, Path]]]:
    """`ot-dist k8s configs/demo.yaml --nodes 2 --gpus-per-node 1`; then each pod's exact command, environment and
    working directory from the rendered manifest, as node 0 and node 1 on 127.0.0.1 (CPU, gloo): (the workspace
    volume, the rendezvous port, [(command, env, cwd) of node 0, of node 1])."""
    rendered = render(REPO / "configs" / "demo.yaml", tmp_path / "manifests", 2, 1, flavor,
                      "--set", "max_steps=2", "--set", "log_every_steps=1")  # fmt: skip
    workspace = tmp_path / "workspace"
    shutil.copytree(demo_files, workspace / "demo_out")
    config_dir = tmp_path / "configmap"
    config_dir.mkdir()
    for file, text in rendered["configmap.yaml"]["data"].items():
        config_dir.joinpath(file).write_text(text)
    port = free_port()
    nodes = []
    for index in (0, 1):
        volumes = {"/workspace": workspace, "/etc/ot-dist": config_dir}
        for mount in ("/tmp", "/home/ot-dist"):
            volumes[mount] = tmp_path / f"node{index}{mount.replace('/', '-')}"
            volumes[mount].mkdir()
        command, env, cwd = pod_process(rendered, index, volumes, f"127.0.0.1:{port}")
        assert ("--node-rank", str(index)) == tuple(command[command.index("--node-rank"):][:2])
        nodes.append((command, env, cwd))
    return workspace, port, nodes


def run_nodes(nodes: list[tuple[list, dict, Path]], port: int, node_0_first: bool) -> list[str]:
    """Start node 0 and node 1 (`node_0_first`: node 1 once node 0 listens on the port) and wait for both to exit 0;
    their outputs."""
    started = []
    for command, env, cwd in nodes:
        started.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True))  # fmt: skip
        if node_0_first and len(started) == 1:
            wait_for_port(port, started[0])
    try:
        outputs = [node.communicate(timeout=240)[0] for node in started]
    finally:
        for node in started:
            node.kill()
    assert [node.returncode for node in started] == [0, 0], outputs[0][-3000:] + "\n-----\n" + outputs[1][-3000:]
    return outputs


def check_node_configs(run: Path, port: int, backend: str) -> None:
    """The accelerate config each node's `ot-dist launch` wrote (node 1's: the second of 2 machines, node 0's
    port, the flavor's rendezvous backend)."""
    launch_files = sorted(p.name for p in (run / "launch").iterdir())
    assert launch_files == ["accelerate_fsdp_node0.yaml", "accelerate_fsdp_node1.yaml"]
    node1 = yaml.safe_load((run / "launch" / "accelerate_fsdp_node1.yaml").read_text())
    assert (node1["num_machines"], node1["machine_rank"], node1["main_process_port"]) == (2, 1, port)
    assert node1["rdzv_backend"] == backend


def training_command(printed: str, tmp_path: Path) -> list[str]:
    """What the `accelerate launch` command a node's `ot-dist launch` printed runs in each worker: the pods' training
    command, the same in both flavors (the config: the ConfigMap's file, mounted)."""
    launched = shlex.split(next(line for line in printed.splitlines() if line.startswith("accelerate launch ")))
    worker = launched[launched.index("-m"):]
    assert worker == ["-m", "ot_dist", "train", str(tmp_path / "configmap" / "train.yaml"), "--resume", "auto"], launched
    return launched


def test_the_pytorchjobs_pods_rendezvous_as_two_nodes_and_train_the_demo(demo_files, tmp_path):
    """The PyTorchJob's pods, started as two nodes (torchrun's c10d rendezvous at worker 0's endpoint, the elastic
    policy's restart budget), train the demo. The Indexed Job's pods run the same training command after another
    rendezvous: test_the_indexed_jobs_pods_rendezvous_as_two_nodes."""
    workspace, port, nodes = pods("pytorchjob", demo_files, tmp_path)
    # c10d: on one machine both nodes match the endpoint's host; in the cluster only worker 0 does.
    outputs = run_nodes(nodes, port, node_0_first=True)
    assert "global batch 4 (batch_size 2 x accumulation 1 x 2 processes)" in outputs[0]
    assert "step 2/2" in outputs[0]
    run = workspace / "demo_out" / "run"
    assert (run / "model" / "model_index.json").is_file() and (run / "model.safetensors").is_file()
    check_node_configs(run, port, "c10d")
    for output in outputs:  # the elastic policy's restart budget reaches torchrun
        launched = training_command(output, tmp_path)
        assert launched[launched.index("--max_restarts") + 1] == "3", launched


def test_the_indexed_jobs_pods_rendezvous_as_two_nodes(demo_files, tmp_path):
    """The Indexed Job's pods: node rank from the completion index, a static rendezvous at index 0's pod, no restart
    budget (the Job restarts pods), and the PyTorchJob's training command, which the test above trains. Each pod's
    exact command with --dry-run writes its node's accelerate config and prints the `accelerate launch` command it
    runs; those commands, started as node 0 and node 1, meet in torchrun's static rendezvous with a script in
    place of the training command (tests/helpers/rendezvous_ranks.py): one process group of 2, node 0's rank 0
    and node 1's rank 1, started as ot_dist's runtime starts it. (A second two-node training cost ~28 s of CPU and
    proved again what the PyTorchJob's does.)"""
    workspace, port, nodes = pods("indexed-job", demo_files, tmp_path)
    printed = run_nodes([(command + ["--dry-run"], env, cwd) for command, env, cwd in nodes], port, node_0_first=False)
    run = workspace / "demo_out" / "run"
    check_node_configs(run, port, "static")
    met = tmp_path / "rendezvous.json"
    launches = []
    for index, ((_, env, cwd), output) in enumerate(zip(nodes, printed, strict=True)):
        launched = training_command(output, tmp_path)
        assert "--max_restarts" not in launched  # the Indexed Job leaves restarts to the Job
        assert launched[2] == "--config_file", launched
        assert (cwd / launched[3]).resolve() == (run / "launch" / f"accelerate_fsdp_node{index}.yaml").resolve()
        # the printed command as `ot-dist launch` runs it, up to the training command
        launches.append(([sys.executable, "-m", "accelerate.commands.launch", *launched[2:launched.index("-m")],
                          str(REPO / "tests" / "helpers" / "rendezvous_ranks.py"), str(met)], env, cwd))
    run_nodes(launches, port, node_0_first=False)
    ranks = json.loads(met.read_text())
    assert [(r["RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for r in ranks] == [("0", "0", "2"), ("1", "1", "2")]
