"""The `fp8dist` command line.

This module parses the command line and dispatches to fp8dist.commands (one module per command); exit codes are
fp8dist.errors.ExitCode: 0 ok; 1 the audit saw a dtype other than the config's (or could not measure a phase), or
compare found a loss gap beyond its tolerance; 2 a usage, config or environment error (message on stderr, no
traceback). `validate`, `translate`, `import`, `schema` and `estimate` never import torch at start (estimate
builds its meta model lazily): each command's module is imported only when it runs.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from fp8dist.errors import ExitCode, Fp8distError

AUDIT_TIMEOUT_S = 600  # default bound of an audit or compare run
# Commands whose words after the positionals may be KEY=VALUE config overrides.
TAKES_OVERRIDES = ("validate", "translate", "estimate", "audit", "compare", "run", "calibrate")
OVERRIDES_HELP = ("config overrides: KEY=VALUE words (after the command, anywhere) set one config key each, the "
                  "value read as YAML, e.g. precision.fp8.backend=none train.steps=4; launch/train.py and scripts "
                  "using fp8dist.add_config_arguments take the same as --fp8dist-set KEY=VALUE")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own exit code is 2 as well; keep its usage line
        self.print_usage(sys.stderr)
        self.exit(ExitCode.ERROR, f"{self.prog}: error: {message}\n")


class _CommandParser(_Parser):
    """A command's parser: words it does not take are refused by it, with its own usage line (argparse leaves them
    to the top-level parser, which would print the usage of `fp8dist` itself)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(_unrecognized(self.prog, extra))
        return namespace, extra


def _unrecognized(prog: str, extra: list[str]) -> str:
    """argparse's message, and for `fp8dist run` given its script without `--`, the line it meant."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    if prog.endswith(" run") and not extra[0].startswith("-"):
        message += (f"\n  fix: the script and its arguments follow `--`: fp8dist run CONFIG [KEY=VALUE ...] -- "
                    f"{' '.join(extra)}")
    return message


def _validate(args):
    from fp8dist.commands import validate
    return validate.run(args)


def _translate(args):
    from fp8dist.commands import translate
    return translate.run(args)


def _import_config(args):
    from fp8dist.commands import import_config
    return import_config.run(args)


def _schema(args):
    from fp8dist.commands import schema
    return schema.run_schema(args)


def _presets(args):
    from fp8dist.commands import schema
    return schema.run_presets(args)


def _env(args):
    from fp8dist.commands import env
    return env.run(args)


def _estimate(args):
    from fp8dist.commands import estimate
    return estimate.run(args)


def _compare(args):
    from fp8dist.commands import compare
    return compare.run_compare(args)


def _export(args):
    from fp8dist.commands import export
    return export.run(args)


def _run(args):
    from fp8dist.commands import run
    return run.run(args)


def _calibrate(args):
    from fp8dist.commands import calibrate
    return calibrate.run(args)


def _audit(args):
    from fp8dist.commands import audit
    return audit.run_audit(args)


def build_parser() -> argparse.ArgumentParser:
    import fp8dist
    from fp8dist.estimate.shapes import HUB_IDS, SHAPES
    from fp8dist.facts.hardware import GPUS
    from fp8dist.config.models import MODEL_FORMS, model_forms

    parser = _Parser(prog="fp8dist")
    parser.add_argument("--version", action="version", version=f"fp8dist {fp8dist.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    p = sub.add_parser("validate", help="check configs; print the resolved config")
    p.add_argument("config", nargs="+", help="YAML config(s); KEY=VALUE overrides may follow a single config")
    p.add_argument("--format", choices=["yaml", "json"], default="yaml")
    p.add_argument("--strict", action="store_true", help="exit 2 when the config holds keys that do nothing here "
                   "(another engine's keys); without it they are said on stderr")
    p.set_defaults(func=_validate)

    p = sub.add_parser("translate", help="print the DeepSpeed JSON, the FSDP2 plan or an Accelerate config file")
    p.add_argument("config")
    p.add_argument("--to", choices=["deepspeed", "fsdp2", "accelerate"], required=True)
    p.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    p.add_argument("--deepspeed-version", help="target DeepSpeed version (default: installed, else newest known)")
    p.add_argument("--torchao-version",
                   help="target torchao version for --to fsdp2 (default: installed, else newest known)")
    p.add_argument("--te-version", help="target Transformer Engine version for --to fsdp2: the recipe fields that "
                   "release keeps (default: installed, else newest known)")
    p.add_argument("--strict", action="store_true", help="exit 2, writing nothing, when the config holds keys that do "
                   "nothing here or settings the target file cannot carry (said on stderr without it; --to "
                   "accelerate then writes the nearest run Accelerate can express, every difference said)")
    p.set_defaults(func=_translate)

    p = sub.add_parser("import", help="an Accelerate config, Axolotl YAML, DeepSpeed JSON, TRL / alignment-handbook "
                       "recipe or PEFT adapter_config.json as an fp8dist config")
    p.add_argument("file", help="the file to read (its kind is detected from its keys)")
    p.add_argument("--from", dest="kind", choices=["accelerate", "axolotl", "deepspeed", "trl", "peft"],
                   help="the kind of FILE, when detection cannot tell")
    p.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    launch = p.add_argument_group("the launch's own values (a DeepSpeed JSON's \"auto\", an Accelerate config's "
                                  "launch flags), named as accelerate launch / TrainingArguments name them")
    launch.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"],
                        help="the precision you launch with (accelerate launch --mixed_precision; TrainingArguments "
                             "bf16 / fp16); a DeepSpeed JSON whose bf16 / fp16 is \"auto\" is refused without it")
    launch.add_argument("--per-device-train-batch-size", type=int, metavar="N",
                        help="fills train_micro_batch_size_per_gpu \"auto\" (else fp8dist's default, said)")
    launch.add_argument("--gradient-accumulation-steps", type=int, metavar="N",
                        help="fills gradient_accumulation_steps \"auto\" (else 1, said)")
    launch.add_argument("--learning-rate", type=float, metavar="LR",
                        help="fills optimizer.params.lr \"auto\" (else Accelerate's 0.001, said)")
    p.set_defaults(func=_import_config)

    p = sub.add_parser("schema", help="print the JSON Schema of the config, or the readable reference (docs/config.md)")
    p.add_argument("--format", choices=["json", "markdown"], default="json", help="json: the JSON Schema; markdown: "
                   "every key with its values, default and meaning, the documented dtype tables, and per preset the "
                   "dtypes the audit expects (what docs/config.md holds)")
    p.set_defaults(func=_schema)

    p = sub.add_parser("presets", help="list the named presets (their tables: fp8dist schema --format markdown)")
    p.set_defaults(func=_presets)

    p = sub.add_parser("env", help="versions, device, and which backends can run here")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=_env)

    p = sub.add_parser("estimate", help="per-rank memory of a run (model built on the meta device: no weights read)")
    p.add_argument("model", help=f"{model_forms(SHAPES)}; a shape's Hub id ({', '.join(HUB_IDS.values())}) is "
                   "built from the shape, without the network; KEY=VALUE config overrides may follow")
    p.add_argument("--config", help="fp8dist config (default: the schema defaults)")
    p.add_argument("--world-size", type=int, default=1, help="ranks the run shards over (default 1)")
    p.add_argument("--gpu", choices=list(GPUS), help="also predict the step on this GPU: time and tokens/s per GPU "
                   "for the config and its bf16 twin, by part, and each Linear's FP8 speedup (docs/speed.md)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the world size spans, for --gpu (default 1): NVLink "
                   "within a node, 400 Gb/s per GPU across")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    p.set_defaults(func=_estimate)

    p = sub.add_parser("compare", help="loss curves of a config vs a baseline from the same weights and batches")
    p.add_argument("--config", required=True, help="the fp8dist config under test")
    p.add_argument("--baseline", required=True, help="the higher-precision fp8dist config to compare against")
    p.add_argument("--model", default="tiny-llama", help=f"{MODEL_FORMS} (default tiny-llama)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (default 20)")
    p.add_argument("--data", help="local text or JSONL ({\"text\": ...} per line) file; default: synthetic batches")
    p.add_argument("--plot", help="write both loss curves and the gap to this PNG")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative loss gap that passes, as a "
                   "fraction of the baseline's loss between 0 and 1 (default 0.05: 5%%)")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (default 1)")
    p.add_argument("--timeout", type=float, default=AUDIT_TIMEOUT_S, help=f"seconds before the runs are stopped "
                   f"(default {AUDIT_TIMEOUT_S})")
    p.add_argument("--layer-steps", metavar="STEPS", help="comma-separated steps (from 1) at which to report, per "
                   "layer, the SQNR of the config's activations and gradients against the baseline's on the "
                   "baseline's weights and batch, and the first layer where they part (FSDP2 configs)")
    p.add_argument("--fixed-routing", action="store_true", help="MoE models: the config's run replays the "
                   "baseline's expert choices, so the gap carries no routing flips")
    p.set_defaults(func=_compare)

    p = sub.add_parser("export", help="write a checkpoint's model in Hugging Face format (config.json + safetensors)")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a --checkpoint-dir of launch/train.py (its newest "
                   "complete checkpoint) or one step-NNNNNNNN checkpoint in it")
    p.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory (an earlier export there is replaced)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the exported weights (default: the run's precision.load_dtype; a LoRA run's "
                   "adapter directory: the adapters' master dtype)")
    p.add_argument("--merge", action="store_true", help="an adapter run's checkpoint: write the base (read again "
                   "from its MODEL) with the adapters merged in, instead of a PEFT adapter directory")
    p.set_defaults(func=_export)

    p = sub.add_parser("audit", help="measure the dtypes of a real run and compare with the documented table")
    p.add_argument("model", help=MODEL_FORMS)
    p.add_argument("--config", help="fp8dist config (default: the schema defaults)")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    p.add_argument("--nproc", type=int, default=1, help="processes (2+ observes communication)")
    p.add_argument("--steps", type=int, default=2, help="training steps to observe")
    p.add_argument("--timeout", type=float, default=AUDIT_TIMEOUT_S,
                   help=f"seconds the audit run may take before it is stopped (default {AUDIT_TIMEOUT_S})")
    p.add_argument("--numerics", action="store_true",
                   help="also check every FP8 weight GEMM of the audited step: each operand cast's underflow and "
                        "saturation, the GEMM's SQNR against high precision (limits: audit.numerics); that step "
                        "costs up to 3x a plain one")
    p.set_defaults(func=_audit)

    p = sub.add_parser("calibrate", help="precision.fp8.policy auto's calibration: each Linear's recipe from its "
                       "measured FP8 numerics and predicted speed, written as explicit precision.fp8.overrides")
    p.add_argument("model", help=MODEL_FORMS)
    p.add_argument("--config", required=True, help="the fp8dist config to calibrate (backend torchao)")
    p.add_argument("-o", "--output", required=True, help="the config to write (atomically): --config as written, "
                   "with policy manual and the calibrated overrides")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1); their measurements are summed")
    p.add_argument("--steps", type=int, default=None, help="the run's first steps to calibrate on (default "
                   "precision.fp8.calibration_steps, 2)")
    p.add_argument("--timeout", type=float, default=AUDIT_TIMEOUT_S,
                   help=f"seconds the calibration may take before it is stopped (default {AUDIT_TIMEOUT_S})")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("run",
                       usage="fp8dist run CONFIG [KEY=VALUE ...] [--nproc N] [--launcher L] -- SCRIPT [ARGS ...]",
                       help="check, then launch a training script on N ranks with the config (torchrun or deepspeed)",
                       description="Check the config and this machine in one process (a refusal: one message, exit "
                       "2, no rank started), then run SCRIPT under the launcher of the config's engine with "
                       "--fp8dist-config CONFIG and each override as --fp8dist-set KEY=VALUE (the arguments "
                       "fp8dist.add_config_arguments reads). The launcher's failure dump is left out; the exit code "
                       "is the failed rank's. Example: fp8dist run configs/fsdp2-bf16.yaml train.steps=4 -- "
                       "launch/train.py --model tiny-llama")
    p.add_argument("config", help="the fp8dist config the script trains with")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks on this node (default: one per CUDA GPU; 2 without one, on gloo)")
    p.add_argument("--launcher", choices=["torchrun", "deepspeed"], default=None,
                   help="default: deepspeed for engine: deepspeed, torchrun for fsdp2")
    p.set_defaults(func=_run, script=[])
    for name in TAKES_OVERRIDES:
        sub.choices[name].epilog = OVERRIDES_HELP
    parser.description = (f"{fp8dist.__doc__.splitlines()[0]} Commands: {', '.join(sub.choices)}; `fp8dist COMMAND "
                          "--help` says what each takes.")
    return parser


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """KEY=VALUE words after the command are config overrides, not positionals."""
    if not argv or argv[0] not in TAKES_OVERRIDES:
        return argv, []
    rest: list[str] = []
    overrides: list[str] = []
    for word in argv:
        (overrides if ("=" in word and not word.startswith("-") and not os.path.exists(word)) else rest).append(word)
    return rest, overrides


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:  # `fp8dist run ... -- SCRIPT ARGS`: the script's words are its own
        argv, script = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    argv, overrides = _split_overrides(argv)
    args = build_parser().parse_args(argv)
    args.overrides = overrides
    if args.command == "run":
        args.script = script
    try:
        return int(args.func(args))
    except Fp8distError as exc:
        print(f"fp8dist {args.command}: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        return int(ExitCode.OK)


if __name__ == "__main__":
    raise SystemExit(main())
