"""`ot-dist k8s CONFIG --shard-parts N`: Kubernetes manifests that build a config's shard set in N parts.

- An Indexed Job `NAME-shards`, one pod per part (completionMode Indexed, N completions, all running at once):
  pod I runs `ot-dist shard build CONFIG --part I/N --workers W`, I being its completion index
  (JOB_COMPLETION_INDEX). A retried index resumes by part: a finished part is skipped, an interrupted one built
  again (shard_parts.py); each index has its own retry budget (backoffLimitPerIndex).
- A Job `NAME-shards-merge` running `ot-dist shard merge CONFIG --parts N --wait S`: it waits for the parts on
  the volume, then writes the set's manifest over their shards.

The pods mount the training pods' workspace PersistentVolumeClaim at /workspace (their working directory) and
the same ConfigMap (`NAME-config`, the training YAML), so the set lands where training looks for it (data.shards,
else the cache folder under the config's paths). No GPU; CPU and memory requests follow W.
"""

from __future__ import annotations

from ot_dist.config.schema import TrainConfig
from ot_dist.data.shard_parts import MERGE_WAIT_S
from ot_dist.errors import ConfigError
from ot_dist.kube import (CONFIG_DIR, CONFIG_FILE, HOME, WORKSPACE, WORKSPACE_CLAIM, api_object,
                          config_map, container_security, field_ref, labels, pod_security)

PART_RETRIES = 3
SHARD_CONTAINER = "ot-dist"


def render_shard_manifests(raw: dict, config: TrainConfig, name: str, parts: int, workers: int,
                           image: str) -> dict[str, dict]:
    """file name -> manifest, plus `kustomization.yaml` listing them."""
    if not config.data.concept_list():
        raise ConfigError("k8s --shard-parts: the config has no data.path or data.concepts (the image folders) to "
                          "build shards from")
    if parts < 1 or workers < 1:
        raise ConfigError(f"k8s: --shard-parts and --shard-workers must be >= 1 (got {parts} and {workers})")
    if parts > 99999:
        raise ConfigError(f"k8s: --shard-parts {parts}: at most 99999 parts")
    longest = f"{name}-shards-merge"
    if len(longest) > 63:
        raise ConfigError(f"--name {name!r}: too long for the shard jobs ({longest!r} is {len(longest)} > 63 "
                          "characters)")
    manifests = {
        "configmap.yaml": config_map(name, raw),
        "shard-build-job.yaml": part_job(name, parts, workers, image),
        "shard-merge-job.yaml": merge_job(name, parts, image),
    }
    manifests["kustomization.yaml"] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                       "resources": list(manifests)}
    return manifests


def part_job(name: str, parts: int, workers: int, image: str) -> dict:
    command = ["ot-dist", "shard", "build", f"{CONFIG_DIR}/{CONFIG_FILE}", "--part",
               f"$(JOB_COMPLETION_INDEX)/{parts}", "--workers", str(workers)]
    env = [{"name": "JOB_COMPLETION_INDEX",  # what the Job controller also injects; declared for the reference
            "valueFrom": field_ref("metadata.annotations['batch.kubernetes.io/job-completion-index']")}]
    job = f"{name}-shards"
    spec = {
        "completionMode": "Indexed",
        "completions": parts,
        "parallelism": parts,
        "backoffLimitPerIndex": PART_RETRIES,  # a failed part retries on its own; the others go on
        "podFailurePolicy": failure_policy("FailIndex"),
        "ttlSecondsAfterFinished": 604800,
        "template": pod(job, name, image, command, env, cpus=workers, memory_gib=2 * workers + 2),
    }
    return api_object("batch/v1", "Job", job, job, spec=spec)


def merge_job(name: str, parts: int, image: str) -> dict:
    command = ["ot-dist", "shard", "merge", f"{CONFIG_DIR}/{CONFIG_FILE}", "--parts", str(parts), "--wait",
               str(MERGE_WAIT_S)]
    job = f"{name}-shards-merge"
    spec = {
        "backoffLimit": PART_RETRIES,
        "podFailurePolicy": failure_policy("FailJob"),
        "ttlSecondsAfterFinished": 604800,
        "template": pod(job, name, image, command, [], cpus=1, memory_gib=16),
    }
    return api_object("batch/v1", "Job", job, job, spec=spec)


def failure_policy(on_bad_input: str) -> dict:
    return {"rules": [
        # A bad config or input file (exit 2 / 3) fails the same way on every retry.
        {"action": on_bad_input, "onExitCodes": {"containerName": SHARD_CONTAINER, "operator": "In", "values": [2, 3]}},
        # A node drained or preempted is not the job's fault: not counted against the budget.
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


def pod(job: str, name: str, image: str, command: list[str], env: list[dict], cpus: int, memory_gib: int) -> dict:
    """A CPU pod of job `job` on the training pods' volume and ConfigMap (those of `name`), under their policy."""
    container = {
        "name": SHARD_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKSPACE,
        "command": command,
        "env": [*env, {"name": "HOME", "value": HOME}, {"name": "XDG_CACHE_HOME", "value": f"{HOME}/.cache"},
                {"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "OMP_NUM_THREADS", "value": "1"}],
        "resources": {"requests": {"cpu": str(cpus), "memory": f"{memory_gib}Gi"},
                      "limits": {"memory": f"{memory_gib}Gi"}},
        "volumeMounts": [
            {"name": "workspace", "mountPath": WORKSPACE},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": HOME},
        ],
        "securityContext": container_security(),
    }
    return {
        "metadata": {"labels": labels(job)},  # not the training pods' (their headless Service selects those)
        "spec": {
            "restartPolicy": "Never",
            "securityContext": pod_security(),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [container],
            "volumes": [
                {"name": "workspace", "persistentVolumeClaim": {"claimName": WORKSPACE_CLAIM}},
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "home", "emptyDir": {}},
            ],
        },
    }
