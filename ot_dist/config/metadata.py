"""The `metadata` section: what the ModelSpec header (`modelspec.*`) of every exported file says about the model
beyond what ot_dist knows itself (ot_dist/checkpoint/modelspec.py; kohya sd-scripts' --metadata_* options)."""

from __future__ import annotations

from pydantic import Field

from ot_dist.config.section import Section


class MetadataConfig(Section):
    """The ModelSpec header (Stability AI's model metadata spec) of the LoRA, single-file and embedding files a run
    writes, which SwarmUI and other model browsers show. Architecture, resolution, prediction type and date come
    from the run; these are the words only the user knows. null = left out (the title: the name of output_dir)."""

    title: str | None = Field(default=None, description="`modelspec.title`; null = the name of output_dir. The EMA "
                              "export's title ends in `_ema`, as its file name does.")
    author: str | None = Field(default=None, description="`modelspec.author`.")
    description: str | None = Field(default=None, description="`modelspec.description` (markdown).")
    license: str | None = Field(default=None, description="`modelspec.license`.")
    tags: str | None = Field(default=None, description="`modelspec.tags`, comma-separated.")
