"""The part of kustomize that the kustomizations in k8s/ (and `ot-dist k8s --out`) use, for machines without
kubectl: resources, components, configMapGenerator (disableNameSuffixHash), images, and JSON 6902 patches
with a kind / name target. Anything else in a kustomization is refused rather than ignored, so a new feature
in k8s/ cannot pass unrendered. When kubectl is installed the tests use `kubectl kustomize` and check that
this gives the same objects (tests/test_k8s.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "generatorOptions", "images",
             "patches"}


def build(folder: Path) -> list[dict]:
    return _build(Path(folder), [])


def _build(folder: Path, into: list[dict]) -> list[dict]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text()) or {}
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise NotImplementedError(f"{folder}/kustomization.yaml: {sorted(unknown)} not supported by mini_kustomize")
    objects = [] if spec.get("kind") != "Component" else into
    for resource in spec.get("resources", []):
        path = folder / resource
        if path.is_dir():
            objects += _build(path, [])
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for component in spec.get("components", []):
        _build(folder / component, objects)
    options = spec.get("generatorOptions", {})
    for generator in spec.get("configMapGenerator", []):
        if not options.get("disableNameSuffixHash"):
            raise NotImplementedError(f"{folder}: configMapGenerator without disableNameSuffixHash")
        data = {Path(f).name: (folder / f).read_text() for f in generator.get("files", [])}
        behavior = generator.get("behavior", "create")
        existing = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == generator["name"]]
        if behavior == "replace":
            if len(existing) != 1:
                raise ValueError(f"{folder}: configMapGenerator replaces {generator['name']!r}, found {len(existing)}")
            existing[0]["data"] = data
        elif behavior == "create":
            objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                            "data": data})
        else:
            raise NotImplementedError(f"{folder}: configMapGenerator behavior {behavior!r}")
    for patch in spec.get("patches", []):
        target = patch["target"]
        if set(target) - {"kind", "name"} or "patch" not in patch:
            raise NotImplementedError(f"{folder}: patches other than inline JSON 6902 by kind / name")
        operations = yaml.safe_load(patch["patch"])
        for obj in objects:
            if obj["kind"] == target.get("kind", obj["kind"]) and obj["metadata"]["name"] == target.get(
                    "name", obj["metadata"]["name"]):
                for operation in operations:
                    _apply(obj, operation)
    for image in spec.get("images", []):
        for obj in objects:
            _set_images(obj, image)
    return objects


def _apply(obj: dict, operation: dict) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
    holder = obj
    for part in parents:
        holder = holder[int(part)] if isinstance(holder, list) else holder[part]
    op = operation["op"]
    if isinstance(holder, list):
        index = len(holder) if last == "-" else int(last)
        if op == "add":
            holder.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            holder[index] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del holder[index]
        else:
            raise NotImplementedError(f"JSON patch op {op!r}")
    else:
        if op in ("add", "replace"):
            if op == "replace" and last not in holder:
                raise KeyError(f"JSON patch replace of a missing path {operation['path']}")
            holder[last] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del holder[last]
        else:
            raise NotImplementedError(f"JSON patch op {op!r}")


def _set_images(node, image: dict) -> None:
    """kustomize's `images`: every container whose image is `name` (with or without a tag) is renamed / retagged."""
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key in ("containers", "initContainers"):
        for container in node.get(key, []) or []:
            current = container.get("image", "")
            name, _, tag = current.partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}" if (
                    image.get("newTag") or tag) else image.get("newName", name)
    for value in node.values():
        _set_images(value, image)
