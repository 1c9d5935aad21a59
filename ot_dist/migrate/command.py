"""`ot-dist import onetrainer | kohya`: parse, convert, validate, write the commented YAML, list what is not
honoured (ot_dist/migrate/common.py: write_imported)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_import_parser(sub) -> None:
    imp = sub.add_parser("import", help="turn another trainer's config into an ot_dist config")
    sources = imp.add_subparsers(dest="import_source", required=True)
    ot = sources.add_parser("onetrainer", help="a OneTrainer training config (JSON, any config version)")
    ot.add_argument("config", help="OneTrainer's config .json (saved from its UI, or a preset)")
    ot.add_argument("--concepts", default=None, help="its concepts file, when not inline (default: the config's "
                    "concept_file_name)")
    ot.add_argument("--samples", default=None, help="its sample prompts file (default: sample_definition_file_name)")
    _output(ot)
    ko = sources.add_parser("kohya", help="a kohya sd-scripts training setup (--config_file TOML and / or a saved "
                            "command line, with its --dataset_config or --train_data_dir)")
    ko.add_argument("--config_file", default=None, help="the training arguments as a TOML (kohya's --config_file)")
    ko.add_argument("--command_line", default=None, help="a file holding the saved command line (`accelerate launch ... "
                    "sdxl_train_network.py --network_dim 16 ...`); its arguments win over --config_file's, as in kohya")
    ko.add_argument("--script", default=None, help="the kohya script the setup runs (train_network.py, "
                    "sdxl_train_network.py, sdxl_train.py, train_db.py, fine_tune.py, flux_train_network.py, "
                    "sd3_train_network.py, train_textual_inversion.py, sdxl_train_textual_inversion.py); "
                    "default: the one --command_line names")
    ko.add_argument("--dataset_config", default=None, help="the dataset TOML (default: the arguments' dataset_config)")
    ko.add_argument("--sample_prompts", default=None, help="the sample prompts file (default: the arguments' "
                    "sample_prompts)")
    ko.add_argument("--captions_folder", default=None, help="a new folder for a fine-tuning dataset's captions "
                    "(--in_json / metadata_file): a link to each image and its caption beside it (ot_dist reads a "
                    "caption file per image; the image folder is not touched)")
    _output(ko)


def _output(parser) -> None:
    parser.add_argument("--out", required=True, help="the ot_dist config to write (YAML)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists")


def run_import(args: argparse.Namespace) -> int:
    from ot_dist.migrate.common import write_imported

    if args.import_source == "kohya":
        from ot_dist.migrate.kohya import import_kohya

        imported = import_kohya(args.config_file, args.command_line, args.script, args.dataset_config,
                                args.sample_prompts, captions_folder=args.captions_folder)
        write_imported(imported, Path(args.out), args.force, "kohya arguments")
        return 0
    from ot_dist.migrate.onetrainer import import_onetrainer

    imported = import_onetrainer(args.config, args.concepts, args.samples)
    write_imported(imported, Path(args.out), args.force, "OneTrainer fields")
    return 0
