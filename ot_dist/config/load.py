"""Read a YAML config, apply `--set key.path=value` overrides, validate once into a TrainConfig.

Every failure becomes a ConfigError whose message names the file or key and, where there is a
closed set, the allowed values.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ot_dist.config.schema import TrainConfig
from ot_dist.errors import ConfigError


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    raw = read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    return validate(raw, source=str(path))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        # Bytes, so that YAML's own encoding rules apply: UTF-8, or UTF-16 with its byte order mark (what Windows
        # PowerShell 5's `>` writes); anything else is a YAMLError naming the position, never a UnicodeDecodeError.
        raw = yaml.load(path.read_bytes(), Loader=UniqueKeyLoader)
    except yaml.reader.ReaderError as err:  # bytes that are not text in YAML's encodings
        raise ConfigError(f"{path}: not UTF-8 text (save it as UTF-8): {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except DuplicateKey as err:
        raise ConfigError(f"{path}: {err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(raw).__name__}")
    return raw


class DuplicateKey(Exception):
    pass


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping. PyYAML keeps the last one silently, so a second
    `data:` section pasted at the end of a config would drop the first one's keys without a word (YAML 1.2 says
    keys are unique; TOML and JSON-schema-checked configs of the peers refuse them too). Keys brought in by a merge
    (`<<: *defaults`) may be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise DuplicateKey(f"key {key!r} appears twice in one section (lines {first} and "
                                       f"{key_node.start_mark.line + 1}); YAML would keep only the last, so merge them")
        return super().construct_mapping(node, deep=deep)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """`a.b.c=value`: the value is parsed as YAML, so `1e-4`, `true`, `[1, 2]` and `null` are typed."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {override!r}: expected key.path=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: value is not valid YAML: {err}") from None
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        lines = [describe_error(e) for e in err.errors()]
        raise ConfigError(f"{source}: invalid config\n" + "\n".join(f"  - {line}" for line in lines)) from None


def describe_error(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error["loc"]]
    key = ".".join(loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = allowed_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        hint += f" Allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"{key}: unknown key{hint}"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "value_error":
        # Raised by our own validators: the message already names its keys.
        return str(error["msg"]).removeprefix("Value error, ")
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def allowed_keys(section_path: list[str]) -> list[str]:
    model: type[BaseModel] = TrainConfig
    for part in section_path:
        if part.isdigit():  # an item of a list of sections (data.concepts, sampling.prompts)
            continue
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def dump_config(config: TrainConfig) -> str:
    """The resolved config as YAML, every default filled in."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
