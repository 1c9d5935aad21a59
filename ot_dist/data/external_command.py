"""`ot-dist shard index TARS_OR_GLOB... --out DIR`: index existing webdataset tars for training (external.py)."""

from __future__ import annotations

import argparse

from ot_dist.data.external import CAPTION_SUFFIXES, IMAGE_SUFFIXES
from ot_dist.data.remote import DEFAULT_RETRIES
from ot_dist.errors import ConfigError


def add_index_parser(shard_sub) -> None:
    index = shard_sub.add_parser(
        "index", help="index existing webdataset tars (img2dataset's, webdataset.ShardWriter's) to train from them "
                      "as they are: data.shards: DIR")
    index.add_argument("tars", nargs="+", metavar="TARS_OR_GLOB",
                       help="tar files, globs ('/data/*.tar') or brace ranges ('shard-{000000..000099}.tar'); or "
                       "URLs read by range through fsspec ('s3://bucket/laion/{00000..00999}.tar', 'gs://...', "
                       "'https://...'), stored in the index as given")
    index.add_argument("--out", required=True, metavar="DIR", help="the set's folder: index/ and manifest.json")
    index.add_argument("--config", default=None, help="a training config: its resolution(s), data.bucket_step, "
                       "data.bucket_assignment, data.max_bad_fraction, data.max_image_pixels; and the bucket report")
    index.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="override a key of --config (value parsed as YAML); repeatable")
    index.add_argument("--resolution", default="1024", help="without --config: training resolution(s), e.g. "
                       "1024 or 768,1024 (buckets are assigned at the largest; default 1024)")
    index.add_argument("--bucket-step", type=int, default=64, help="without --config: bucket sides are multiples of "
                       "this (default 64; 8 for SD 1.x / 2.x)")
    index.add_argument("--image-ext", default=",".join(IMAGE_SUFFIXES), metavar="EXTS",
                       help=f"image member suffixes, first present wins (default {','.join(IMAGE_SUFFIXES)})")
    index.add_argument("--caption-ext", default=",".join(CAPTION_SUFFIXES), metavar="EXTS",
                       help=f"caption member suffixes, first present wins (default {','.join(CAPTION_SUFFIXES)})")
    index.add_argument("--caption-field", default="caption", help="the caption's field in a json member "
                       "(default caption)")
    index.add_argument("--max-bad-fraction", type=float, default=None, help="share of unreadable images skipped "
                       "(named) before indexing stops (default: --config's data.max_bad_fraction, else 0.01)")
    index.add_argument("--workers", type=int, default=1, help="processes that read the tars (default 1; the "
                       "index is the same with any number)")
    index.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                       metavar="KEY=VALUE", help="an fsspec option of the store the URLs name, value parsed as YAML "
                       "(endpoint_url=https://minio:9000); repeatable; over --config's data.storage_options. No "
                       "credentials: they come from the environment (AWS_ACCESS_KEY_ID, ...)")
    index.add_argument("--world-size", type=int, default=1, help="with --config: processes the bucket report "
                       "assumes (default 1)")


def _suffixes(value: str, option: str) -> tuple[str, ...]:
    suffixes = tuple(s.strip().lstrip(".") for s in value.split(",") if s.strip())
    if not suffixes:
        raise ConfigError(f"shard index: {option} needs at least one suffix, got {value!r}")
    return suffixes


def _storage_options(pairs: list[str], config) -> dict:
    """storage_options and retries for URL tars: --config's data section, then each --storage-option KEY=VALUE,
    checked as data.storage_options is (no credentials)."""
    import yaml

    from ot_dist.config.schema import DataConfig

    options = dict(config.data.storage_options) if config is not None else {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"shard index: --storage-option takes KEY=VALUE, got {pair!r}")
        options[key.strip()] = yaml.safe_load(value)
    try:
        DataConfig._no_credentials(options)
    except ValueError as err:
        raise ConfigError(f"shard index: --storage-option / data.{err}") from None
    return {"storage_options": options, "retries": config.data.remote_retries if config is not None else DEFAULT_RETRIES}


def run_index(args: argparse.Namespace) -> int:
    from ot_dist.data.external import index_webdataset

    options = {"image_suffixes": _suffixes(args.image_ext, "--image-ext"),
               "caption_suffixes": _suffixes(args.caption_ext, "--caption-ext"), "caption_field": args.caption_field}
    config = None
    if args.config:
        from ot_dist.config.load import load_config

        config = load_config(args.config, args.overrides)
        data = config.data
        options |= {"resolutions": config.resolutions(), "bucket_step": data.bucket_step,
                    "bucket_assignment": data.bucket_assignment, "max_bad_fraction": data.max_bad_fraction,
                    "max_image_pixels": data.max_image_pixels}
    else:
        try:
            resolutions = sorted({int(r) for r in args.resolution.split(",")})
        except ValueError:
            raise ConfigError(f"shard index: --resolution takes numbers like 1024 or 768,1024, got {args.resolution!r}") from None
        if args.bucket_step < 1 or min(resolutions) < args.bucket_step:
            raise ConfigError(f"shard index: --bucket-step {args.bucket_step} must be at least 1 and at most the "
                              f"resolution {min(resolutions)}")
        options |= {"resolutions": resolutions, "bucket_step": args.bucket_step}
    options |= _storage_options(args.storage_options, config)
    if args.workers < 1:
        raise ConfigError(f"shard index: --workers must be at least 1, got {args.workers}")
    options["workers"] = args.workers
    if args.max_bad_fraction is not None:
        options["max_bad_fraction"] = args.max_bad_fraction
    index_webdataset(args.tars, args.out, **options)
    if config is not None:
        from ot_dist.data.training_data import report_for

        print("\n".join(report_for(config, args.out, args.world_size)))
    print(f"train from it with data.shards: {args.out}")
    return 0
