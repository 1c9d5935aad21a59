"""`ot-dist import onetrainer`: parse, convert, validate, write the commented YAML, list what is not honoured."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ot_dist.errors import ConfigError


def add_import_parser(sub) -> None:
    imp = sub.add_parser("import", help="turn another trainer's config into an ot_dist config")
    sources = imp.add_subparsers(dest="import_source", required=True)
    ot = sources.add_parser("onetrainer", help="a OneTrainer training config (JSON, any config version)")
    ot.add_argument("config", help="OneTrainer's config .json (saved from its UI, or a preset)")
    ot.add_argument("--concepts", default=None, help="its concepts file, when not inline (default: the config's "
                    "concept_file_name)")
    ot.add_argument("--samples", default=None, help="its sample prompts file (default: sample_definition_file_name)")
    ot.add_argument("--out", required=True, help="the ot_dist config to write (YAML)")
    ot.add_argument("--force", action="store_true", help="replace --out when it exists")


def run_import(args: argparse.Namespace) -> int:
    import yaml

    from ot_dist.config.load import validate
    from ot_dist.migrate.onetrainer import import_onetrainer

    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"--out: {out} exists (--force replaces it)")
    imported = import_onetrainer(args.config, args.concepts, args.samples)
    validate(imported.config)  # what is written is a config ot_dist accepts, or nothing is written
    header = [f"# {line}" for line in imported.notes]
    if imported.not_honoured:
        header.append("# NOT HONOURED (OneTrainer fields this config does not reproduce):")
        header += [f"#   - {line}" for line in imported.not_honoured]
    body = yaml.safe_dump(imported.config, sort_keys=False, allow_unicode=True)
    out.write_text("\n".join(header) + "\n" + body, encoding="utf-8")
    for line in imported.not_honoured:
        print(f"not honoured: {line}", file=sys.stderr)
    print(f"wrote {out} ({len(imported.not_honoured)} OneTrainer fields not honoured, listed in it)", file=sys.stderr)
    return 0
