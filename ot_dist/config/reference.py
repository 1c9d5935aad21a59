"""Render the config reference (configs/REFERENCE.md) from the schema, so it cannot drift."""

from __future__ import annotations

import inspect
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ot_dist.config.schema import TrainConfig


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a type with a validator (schema.UserPath): the type is what the user writes
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _rows(model: type[BaseModel], prefix: str, sections: list):
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sections.append((key, annotation, field.description))
            continue
        item = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None
        if isinstance(item, type) and issubclass(item, BaseModel):  # a list of sections: document one item
            sections.append((f"{key}[]", item, None))
        if field.default is PydanticUndefined and field.default_factory is None:
            default = "**required**"
        elif field.default_factory is not None:
            default = f"`{field.default_factory()!r}`"
        else:
            default = f"`{field.default!r}`" if field.default is not None else "`null`"
        description = (field.description or "").replace("|", "\\|")  # a `|||` in a text is no column of the table
        rows.append(f"| `{key}` | {_type_name(annotation)} | {default} | {description} |")
    return rows


def render_reference() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from `ot_dist/config/schema.py` by `ot-dist config reference`; a test keeps it current.",
        "Unknown keys are errors. Any key can be overridden with `--set key.path=value`.",
        "",
    ]
    sections = [("", TrainConfig, None)]
    while sections:
        prefix, model, description = sections.pop(0)
        lines += [f"## `{prefix or 'top level'}`", ""]
        doc = description or (model.__doc__ if model not in (TrainConfig,) and model.__doc__ else None)
        if doc:
            lines += [inspect.cleandoc(doc), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += _rows(model, f"{prefix}." if prefix else "", sections)
        lines.append("")
    return "\n".join(lines + _optimizer_table())


def _optimizer_table() -> list[str]:
    from ot_dist.optim.registry import NOT_AVAILABLE, SPECS

    lines = [
        "## Optimizers",
        "",
        "The options each `optimizer.name` takes and their defaults (OneTrainer's). Setting any other option is an "
        "error. Adaptive optimizers (lr multiplies the step size they estimate; all parameter groups share one "
        "learning rate): " + ", ".join(n for n, s in SPECS.items() if s.adaptive) + ".",
        "",
        "| optimizer | implementation | options (default) |",
        "|---|---|---|",
    ]
    for name, spec in SPECS.items():
        options = ", ".join(f"`{k}` ({v})" for k, v in spec.defaults.items())
        lines.append(f"| `{name}` | `{spec.target.replace(':', '.')}` | {options} |")
    lines += ["", "Not available here: " + "; ".join(f"`{k}` ({why})" for k, why in NOT_AVAILABLE.items()) + ".", ""]
    return lines
