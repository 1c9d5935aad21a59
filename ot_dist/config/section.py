"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # Unknown keys are errors, not silently ignored: a typo must not train with a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
