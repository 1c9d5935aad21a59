"""The names of the model families, importable without torch so the config can validate against them.
The specs themselves live in ot_dist/models/specs.py."""

# Text encoders each family has, by diffusers component name.
FAMILY_TEXT_ENCODERS: dict[str, tuple[str, ...]] = {
    "sd1": ("text_encoder",),
    "sd2": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
}
