"""`ot-dist k8s`: Kubernetes manifests that train a config on N nodes x G GPUs.

Every pod runs the `ot-dist launch` command a user would type on that node
(`launcher.node_launch_command`); what differs between pods is filled in by Kubernetes from the
pod's environment (`$(VAR)` references in the command). Two flavors:

- `pytorchjob`: a Kubeflow training-operator PyTorchJob with an elastic policy. The operator puts the
  policy into each pod's environment (PET_RDZV_ENDPOINT: worker 0's service, PET_MAX_RESTARTS), and
  torchrun's c10d rendezvous there assigns the node ranks; failed workers restart up to the budget.
- `indexed-job`: no operator. A batch/v1 Indexed Job plus a headless Service: the node rank is the
  pod's completion index (JOB_COMPLETION_INDEX), the rendezvous is static at the index-0 pod's DNS
  name `NAME-0.NAME`; the Job's backoffLimit is the restart budget.

Both mount one PersistentVolumeClaim at /workspace (the pods' working directory, so a config's
relative paths `data_shards/...`, `models/...`, `outputs/...` mean the same as in a checkout), the
config from a ConfigMap, a memory-backed /dev/shm, and writable emptyDirs for /tmp and HOME under a
read-only root filesystem. MLflow's tracking URI and credentials come from a Secret reference.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path, PurePosixPath

import yaml

from ot_dist.config.load import apply_override, read_yaml, validate
from ot_dist.config.schema import TrainConfig
from ot_dist.errors import ConfigError
from ot_dist.launcher import node_launch_command, render_accelerate_config

WORKSPACE = "/workspace"  # the PVC with data_shards/, models and outputs; the pods' working directory
CONFIG_DIR = "/etc/ot-dist"  # the ConfigMap with the training YAML
CONFIG_FILE = "train.yaml"
HOME = "/home/ot-dist"
RDZV_PORT = 29400
RUN_AS = 1000  # the image's non-root user (k8s/Dockerfile)
WORKSPACE_CLAIM = "ot-dist-workspace"  # k8s/storage
MLFLOW_SECRET = "ot-dist-mlflow"  # keys tracking_uri, username, password; all optional
# the object store's credentials, every key an environment variable (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...):
# what s3fs / gcsfs read for tars named by URL (docs/kubernetes.md); optional, so a job without one starts
STORAGE_SECRET = "ot-dist-storage"
RESTART_BUDGET = 3
CONTAINER = "pytorch"  # the training operator looks for a container of this name
FLAVORS = ("pytorchjob", "indexed-job")
# Config keys that name files; relative ones resolve under WORKSPACE in the pods.
PATH_KEYS = ("model.path", "model.config", "data.path", "data.shards", "data.cache_dir", "output_dir",
             "deepspeed.config_file")


# How long Kubernetes waits after SIGTERM before it kills a training pod (its default is 30 s). On SIGTERM the ranks
# finish the step under way, write a checkpoint and commit it (docs/checkpoints.md): a full finetune's state is
# tens to hundreds of GB on the shared volume, minutes of writing. A pod that is done sooner ends sooner; a cloud's
# spot preemption notice (30 s to 2 min) is not lengthened by it.
GRACE_SECONDS = 900


def render_manifests(
    raw: dict, config: TrainConfig, name: str, nodes: int, gpus_per_node: int, image: str, flavor: str,
    grace_seconds: int = GRACE_SECONDS,
) -> dict[str, dict]:
    """file name -> manifest, plus `kustomization.yaml` listing them (so the folder is `kubectl apply -k`-able)."""
    check_shape(config, name, nodes, gpus_per_node, flavor)
    if grace_seconds < 1:
        raise ConfigError(f"--grace-seconds must be >= 1 (got {grace_seconds})")
    manifests = {"configmap.yaml": config_map(name, raw)}
    if flavor == "pytorchjob":
        manifests["pytorchjob.yaml"] = pytorch_job(name, nodes, gpus_per_node, image, grace_seconds)
    else:
        manifests["service.yaml"] = headless_service(name)
        manifests["job.yaml"] = indexed_job(name, nodes, gpus_per_node, image, grace_seconds)
    manifests["kustomization.yaml"] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(manifests),
    }
    return manifests


def check_shape(config: TrainConfig, name: str, nodes: int, gpus_per_node: int, flavor: str) -> None:
    if flavor not in FLAVORS:
        raise ConfigError(f"--flavor {flavor!r}: expected one of {', '.join(FLAVORS)}")
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes and --gpus-per-node must be >= 1 (got {nodes} and {gpus_per_node})")
    # The launcher's own checks (e.g. strategy single with more than one process), before any manifest exists.
    render_accelerate_config(config, gpus_per_node, nodes, 0, f"{name}-0:{RDZV_PORT}", "c10d")
    # Pod host names are NAME-worker-I (PyTorchJob) or NAME-I (Indexed Job): DNS labels of <= 63 characters.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise ConfigError(f"--name {name!r}: use lowercase letters, digits and '-', starting and ending alphanumeric")
    longest = f"{name}-worker-{nodes - 1}"
    if len(longest) > 63:
        raise ConfigError(f"--name {name!r}: too long for pod host names ({longest!r} is {len(longest)} > 63 characters)")


def default_name(config_path: str | Path) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", Path(config_path).stem.lower()).strip("-")
    return f"ot-dist-{stem}"[:40].rstrip("-")


def labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "ot-dist", "app.kubernetes.io/instance": name}


def api_object(api_version: str, kind: str, name: str, job: str, **body) -> dict:
    """An object named `name` that belongs to job `job` (its labels)."""
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "labels": labels(job)}, **body}


def config_map(name: str, raw: dict) -> dict:
    return api_object("v1", "ConfigMap", f"{name}-config", name, data={CONFIG_FILE: yaml.safe_dump(raw, sort_keys=False)})


def headless_service(name: str) -> dict:
    """Gives the Indexed Job's pods DNS names NAME-I.NAME (the pods set subdomain NAME)."""
    spec = {
        "clusterIP": "None",
        "selector": labels(name),
        # Resolvable before the pods are ready: the other nodes connect during start-up.
        "publishNotReadyAddresses": True,
        "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
    }
    return api_object("v1", "Service", name, name, spec=spec)


def pod_command(node_rank: str, rdzv_endpoint: str, rdzv_backend: str, max_restarts: str) -> list[str]:
    """`ot-dist launch` on one node; `$(VAR)`s are filled in from the pod's environment by Kubernetes."""
    return node_launch_command(
        f"{CONFIG_DIR}/{CONFIG_FILE}", "$(NPROC_PER_NODE)", "$(NNODES)", node_rank, rdzv_endpoint, rdzv_backend,
        max_restarts,
    )  # fmt: skip


def pytorch_job(name: str, nodes: int, gpus_per_node: int, image: str, grace_seconds: int = GRACE_SECONDS) -> dict:
    command = pod_command("$(NODE_RANK)", "$(PET_RDZV_ENDPOINT)", "c10d", "$(PET_MAX_RESTARTS)")
    # c10d assigns ranks itself; the replica index only names this node's launch files.
    rank = {"name": "NODE_RANK", "valueFrom": field_ref("metadata.labels['training.kubeflow.org/replica-index']")}
    pod = pod_template(name, nodes, gpus_per_node, image, command, [rank], port_name="pytorchjob-port",
                       grace_seconds=grace_seconds)
    spec = {
        "elasticPolicy": {
            "rdzvBackend": "c10d",
            "rdzvPort": RDZV_PORT,
            # A fixed node count: the global batch (and so the schedule) depends on the world size.
            "minReplicas": nodes,
            "maxReplicas": nodes,
            "maxRestarts": RESTART_BUDGET,
        },
        "nprocPerNode": str(gpus_per_node),
        "runPolicy": {"backoffLimit": RESTART_BUDGET, "cleanPodPolicy": "Running", "ttlSecondsAfterFinished": 604800},
        "pytorchReplicaSpecs": {
            # ExitCode: 1-127 (ot-dist's config / input errors are 2 and 3) fail the job, signals restart the pod.
            "Worker": {"replicas": nodes, "restartPolicy": "ExitCode", "template": pod},
        },
    }
    return api_object("kubeflow.org/v1", "PyTorchJob", name, name, spec=spec)


def indexed_job(name: str, nodes: int, gpus_per_node: int, image: str, grace_seconds: int = GRACE_SECONDS) -> dict:
    command = pod_command("$(JOB_COMPLETION_INDEX)", "$(RDZV_ENDPOINT)", "static", "0")
    env = [
        # What the Job controller also injects; declared so the command's reference is defined here.
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": field_ref("metadata.annotations['batch.kubernetes.io/job-completion-index']")},
        {"name": "RDZV_ENDPOINT", "value": f"{name}-0.{name}:{RDZV_PORT}"},
    ]  # fmt: skip
    pod = pod_template(name, nodes, gpus_per_node, image, command, env, port_name="rdzv", grace_seconds=grace_seconds)
    pod["spec"] |= {"restartPolicy": "Never", "subdomain": name}
    spec = {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": RESTART_BUDGET,
        "podFailurePolicy": {
            "rules": [
                # A bad config or input file (exit 2 / 3) fails the same way on every retry.
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [2, 3]}},
                # A node drained or preempted is not the job's fault: not counted against the budget.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "ttlSecondsAfterFinished": 604800,
        "template": pod,
    }
    return api_object("batch/v1", "Job", name, name, spec=spec)


def field_ref(path: str) -> dict:
    return {"fieldRef": {"fieldPath": path}}


def secret_env(variable: str, key: str) -> dict:
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": MLFLOW_SECRET, "key": key, "optional": True}}}


def pod_template(
    name: str, nodes: int, gpus_per_node: int, image: str, command: list[str], env: list[dict], port_name: str,
    grace_seconds: int = GRACE_SECONDS,
) -> dict:
    env = [
        {"name": "NNODES", "value": str(nodes)},
        {"name": "NPROC_PER_NODE", "value": str(gpus_per_node)},
        *env,
        {"name": "HOME", "value": HOME},
        {"name": "XDG_CACHE_HOME", "value": f"{HOME}/.cache"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        secret_env("MLFLOW_TRACKING_URI", "tracking_uri"),
        secret_env("MLFLOW_TRACKING_USERNAME", "username"),
        secret_env("MLFLOW_TRACKING_PASSWORD", "password"),
        {"name": "MLFLOW_EXPERIMENT_NAME", "value": name},
    ]
    gpus = str(gpus_per_node)
    memory = f"{48 * gpus_per_node}Gi"
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKSPACE,
        "command": command,
        "env": env,
        "envFrom": [{"secretRef": {"name": STORAGE_SECRET, "optional": True}}],
        "ports": [{"name": port_name, "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": str(6 * gpus_per_node), "memory": memory, "nvidia.com/gpu": gpus},
            "limits": {"memory": memory, "nvidia.com/gpu": gpus},
        },
        "volumeMounts": [
            {"name": "workspace", "mountPath": WORKSPACE},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": HOME},
        ],
        "securityContext": container_security(),
    }
    return {
        "metadata": {"labels": labels(name)},
        "spec": {
            "securityContext": pod_security(),
            "terminationGracePeriodSeconds": grace_seconds,  # the checkpoint written on SIGTERM
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [container],
            "volumes": [
                {"name": "workspace", "persistentVolumeClaim": {"claimName": WORKSPACE_CLAIM}},
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                # NCCL and data-loader workers share memory through /dev/shm; a container's default is 64 MiB.
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{8 * gpus_per_node}Gi"}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "home", "emptyDir": {}},
            ],
        },
    }


def pod_security() -> dict:
    """The pod-level security context of every pod ot_dist renders (training and shard building)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def paths_outside_workspace(config: TrainConfig) -> list[str]:
    """Config keys holding absolute paths that are not on the workspace volume (the pods would not see them)."""
    outside, values = [], config.model_dump()
    for key in PATH_KEYS:
        value = values
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value and PurePosixPath(value).is_absolute() and not PurePosixPath(value).is_relative_to(WORKSPACE):
            outside.append(f"{key}: {value}")
    return outside


class _BlockStrings(yaml.SafeDumper):
    """Multi-line strings (the embedded training YAML) as literal blocks, so the ConfigMap stays readable."""


_BlockStrings.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def dump(manifest: dict) -> str:
    return yaml.dump(manifest, Dumper=_BlockStrings, sort_keys=False)


def run_k8s(args, log=print) -> int:
    raw = read_yaml(args.config)
    for override in args.overrides:
        apply_override(raw, override)
    config = validate(raw, source=args.config)
    name = args.name or default_name(args.config)
    if args.shard_parts is not None:  # the shard set's build instead of training (kube_shards.py)
        from ot_dist.kube_shards import render_shard_manifests

        manifests = render_shard_manifests(raw, config, name, args.shard_parts, args.shard_workers, args.image)
    else:
        manifests = render_manifests(raw, config, name, args.nodes, args.gpus_per_node, args.image, args.flavor,
                                     GRACE_SECONDS if args.grace_seconds is None else args.grace_seconds)
    for entry in paths_outside_workspace(config):
        print(f"ot-dist k8s: warning: {entry} is outside {WORKSPACE} (the workspace volume), so the pods see "
              "it only if the image contains it; use a path relative to the workspace", file=sys.stderr)  # fmt: skip
    if args.out is None:
        log("---\n".join(dump(m) for file, m in manifests.items() if file != "kustomization.yaml"), end="")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for file, manifest in manifests.items():
        (out / file).write_text(dump(manifest))
    log(f"wrote {', '.join(manifests)} to {out} (apply with: kubectl apply -k {out})")
    return 0
