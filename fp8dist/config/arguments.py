"""Command-line hooks for training scripts: `--fp8dist-config x.yaml` plus `key=value` overrides."""
from __future__ import annotations

import argparse

from fp8dist.config.load import load_config
from fp8dist.config.spec import Spec


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--fp8dist-config PATH` and repeatable `--fp8dist-set KEY=VALUE` to a script's parser.

    Works next to `deepspeed.add_config_arguments(parser)`; the deepspeed launcher's
    `--local_rank` is accepted too, so scripts run under both `deepspeed` and `torchrun`.
    """
    group = parser.add_argument_group("fp8dist")
    group.add_argument("--fp8dist-config", metavar="PATH", default=None,
                       help="fp8dist precision config (YAML). Without it: the schema defaults.")
    group.add_argument("--fp8dist-set", metavar="KEY=VALUE", action="append", default=[],
                       help="override one config key (repeatable; the value is read as YAML), e.g. "
                            "--fp8dist-set precision.fp8.backend=none; the fp8dist commands take the same KEY=VALUE "
                            "as bare words after the config")
    if not any("--local_rank" in a.option_strings for a in parser._actions):
        parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                            help="set by the deepspeed launcher; the rank comes from the environment")
    return parser


def spec_from_args(args: argparse.Namespace) -> Spec:
    """The validated spec named by the parsed arguments."""
    return load_config(args.fp8dist_config, overrides=args.fp8dist_set)
