"""`ot-dist import onetrainer | kohya | simpletuner | diffusers | ai-toolkit`: parse, convert, validate, write the
commented YAML, list what is not honoured (ot_dist/migrate/common.py: write_imported)."""

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
                    "sd3_train_network.py, flux_train.py, sd3_train.py, lumina_train_network.py, lumina_train.py, "
                    "train_textual_inversion.py, sdxl_train_textual_inversion.py); "
                    "default: the one --command_line names")
    ko.add_argument("--dataset_config", default=None, help="the dataset TOML (default: the arguments' dataset_config)")
    ko.add_argument("--sample_prompts", default=None, help="the sample prompts file (default: the arguments' "
                    "sample_prompts)")
    ko.add_argument("--captions_folder", default=None, help="a new folder for a fine-tuning dataset's captions "
                    "(--in_json / metadata_file): a link to each image and its caption beside it (ot_dist reads a "
                    "caption file per image; the image folder is not touched)")
    _output(ko)
    st = sources.add_parser("simpletuner", help="a SimpleTuner setup (config.json / config.toml / config.env with its "
                            "multidatabackend.json)")
    st.add_argument("config", help="SimpleTuner's config/config.json, config.toml or config.env (or the folder "
                    "holding one)")
    st.add_argument("--databackend", default=None, help="its multidatabackend.json (default: the config's "
                    "data_backend_config)")
    st.add_argument("--lycoris_config", default=None, help="its lycoris_config.json (default: the config's "
                    "lycoris_config)")
    st.add_argument("--user_prompt_library", default=None, help="its prompt library JSON (default: the config's "
                    "user_prompt_library)")
    st.add_argument("--root", default=None, help="the folder SimpleTuner runs in, where its relative paths start "
                    "(default: the folder above config/ when the config lies in one, else the config's folder)")
    _output(st)
    di = sources.add_parser("diffusers", help="a diffusers example-script training command (train_text_to_image*.py, "
                            "train_dreambooth*.py, textual_inversion.py) as a saved command line")
    di.add_argument("command_line", help="a file holding the saved command line (`accelerate launch ... "
                    "train_dreambooth_lora.py --rank 16 ...`, continued over lines with \\)")
    di.add_argument("--script", default=None, help="the script the command runs, when the line does not name it")
    di.add_argument("--accelerate_config", default=None, help="the accelerate config file the launch used (default: "
                    "the command line's --config_file): its mixed_precision, num_processes and distributed_type")
    di.add_argument("--captions_folder", default=None, help="a new folder for an image folder's metadata.jsonl "
                    "captions: a link to each image and its caption beside it (ot_dist reads a caption file per "
                    "image; the image folder is not touched); an edit script's reference images beside it, as links "
                    "named as their images'")
    _output(di)
    at = sources.add_parser("ai-toolkit", help="an ostris ai-toolkit job file (config/examples/train_lora_*.yaml, or "
                            "the config its UI saves): config.process[0]")
    at.add_argument("config", help="the ai-toolkit job file (.yaml or .json)")
    _output(at)


def _output(parser) -> None:
    parser.add_argument("--out", required=True, help="the ot_dist config to write (YAML)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists")


def run_import(args: argparse.Namespace) -> int:
    from ot_dist.migrate.common import write_imported

    if args.import_source == "diffusers":
        from ot_dist.migrate.diffusers import import_diffusers

        imported = import_diffusers(args.command_line, args.script, args.accelerate_config, args.captions_folder)
        write_imported(imported, Path(args.out), args.force, "diffusers script arguments")
        return 0
    if args.import_source == "ai-toolkit":
        from ot_dist.migrate.ai_toolkit import import_ai_toolkit

        write_imported(import_ai_toolkit(args.config), Path(args.out), args.force, "ai-toolkit keys")
        return 0
    if args.import_source == "kohya":
        from ot_dist.migrate.kohya import import_kohya

        imported = import_kohya(args.config_file, args.command_line, args.script, args.dataset_config,
                                args.sample_prompts, captions_folder=args.captions_folder)
        write_imported(imported, Path(args.out), args.force, "kohya arguments")
        return 0
    if args.import_source == "simpletuner":
        from ot_dist.migrate.simpletuner import import_simpletuner

        imported = import_simpletuner(args.config, args.databackend, args.lycoris_config, args.user_prompt_library,
                                      args.root)
        write_imported(imported, Path(args.out), args.force, "SimpleTuner arguments")
        return 0
    from ot_dist.migrate.onetrainer import import_onetrainer

    imported = import_onetrainer(args.config, args.concepts, args.samples)
    write_imported(imported, Path(args.out), args.force, "OneTrainer fields")
    return 0
