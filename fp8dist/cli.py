"""`fp8dist` command line: validate | translate | import | schema | presets | env | estimate | compare | audit | export.

Exit codes: 0 ok; 1 the audit found a dtype that differs from the documented table (or a phase it could not
measure), or compare found a loss gap beyond its tolerance; 2 a usage,
config or environment error (message on stderr, no traceback). `validate`, `translate`, `import`, `schema` and
`estimate` never import torch at start (estimate builds its meta model lazily).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from fp8dist.errors import Fp8distError

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
AUDIT_TIMEOUT_S = 600  # default bound of an audit or compare run (their modules import torch: not imported here)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own exit code is 2 as well; keep its usage line
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _dump(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader never sees half a file and an error leaves none."""
    target = Path(path)
    if target.is_dir():
        raise Fp8distError(f"-o {path}: is a directory; name a file")
    if not target.parent.exists():
        raise Fp8distError(f"-o {path}: directory {target.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_validate(args) -> int:
    from fp8dist.config.load import load_config

    if len(args.config) > 1 and args.overrides:
        raise Fp8distError("KEY=VALUE overrides apply to one config; pass a single CONFIG with them")
    failed = 0
    for path in args.config:
        try:
            spec = load_config(path, overrides=args.overrides)
        except Fp8distError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        if len(args.config) == 1:
            sys.stdout.write(_dump(spec.to_dict()) if args.format == "json" else _yaml(spec.to_dict()))
        else:
            print(f"ok  {path}")
    return EXIT_ERROR if failed else EXIT_OK


def _yaml(document: Any) -> str:
    import yaml

    return yaml.safe_dump(document, sort_keys=False, default_flow_style=None)


def cmd_translate(args) -> int:
    from fp8dist.config.load import load_config
    from fp8dist.translate import TARGETS

    spec = load_config(args.config, overrides=args.overrides)
    if args.to == "accelerate":
        return _translate_accelerate(args, spec)
    versions = {"deepspeed": ("--deepspeed-version", "deepspeed_version", args.deepspeed_version),
                "fsdp2": ("--torchao-version", "torchao_version", args.torchao_version)}
    for target, (flag, _, value) in versions.items():
        if value and args.to != target:
            raise Fp8distError(f"{flag} applies to --to {target} only")
    _, keyword, value = versions[args.to]
    document = TARGETS[args.to](spec, **{keyword: value})
    text = _dump(document)
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _translate_accelerate(args, spec) -> int:
    """`translate --to accelerate`: the Accelerate config file (YAML; JSON when -o names a .json file). The
    DeepSpeed config is embedded as JSON text on stdout; with -o it is written beside the file as
    <name>.deepspeed.json and named by its absolute path (accelerate 1.15 HfDeepSpeedConfig reads both)."""
    from fp8dist.translate.accelerate import accelerate_file, render

    document, plan = accelerate_file(spec, args.deepspeed_version, args.torchao_version)
    beside = None
    if args.output:
        target = Path(args.output)
        if target.is_dir() or not target.parent.exists():
            write_atomic(args.output, "")  # raises the -o error; nothing is written
        if "deepspeed_config" in document:
            beside = target.with_name(target.name.rsplit(".", 1)[0] + ".deepspeed.json")
            document["deepspeed_config"]["deepspeed_config_file"] = str(beside.resolve())
    if args.output and args.output.endswith(".json"):
        text = _dump(document)
    else:
        text = render(document, plan, spec, args.config)
    if not args.output:
        sys.stdout.write(text)
        return EXIT_OK
    if beside is not None:
        write_atomic(str(beside), _dump(plan["deepspeed"]["config"]))
    try:
        write_atomic(args.output, text)
    except BaseException:
        if beside is not None:
            beside.unlink(missing_ok=True)
        raise
    return EXIT_OK


def cmd_import(args) -> int:
    from fp8dist.importers import import_file

    text = import_file(args.file, args.kind)
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def cmd_schema(args) -> int:
    from fp8dist.config import schema

    sys.stdout.write(_dump(schema.schema()))
    return EXIT_OK


def cmd_presets(args) -> int:
    from fp8dist.config import schema

    for name, preset in schema.presets().items():
        print(f"{name:24s} {preset['description']}")
    return EXIT_OK


def cmd_env(args) -> int:
    from fp8dist.environment import report

    info = report()
    if args.format == "json":
        sys.stdout.write(_dump(info))
    else:
        from fp8dist.environment import render

        sys.stdout.write(render(info))
    return EXIT_OK


def cmd_estimate(args) -> int:
    from fp8dist.config.load import load_config

    spec = load_config(args.config, overrides=args.overrides)  # config errors before torch is imported
    from fp8dist.estimate import estimate, render_table

    result = estimate(args.model, spec, args.world_size)
    if args.format == "json":
        sys.stdout.write(_dump(result))
    else:
        sys.stdout.write(render_table(result, markdown=args.format == "markdown"))
    return EXIT_OK


def cmd_compare(args) -> int:
    from fp8dist.compare import run_compare

    return run_compare(args)


def cmd_export(args) -> int:
    from fp8dist.export import export_hf

    exported = export_hf(args.checkpoint, args.out_dir, args.dtype)
    print(f"exported {exported.directory} ({exported.dtype}, {exported.tensors} tensors, {exported.bytes} bytes in "
          f"{', '.join(exported.files)})")
    return EXIT_OK


def cmd_audit(args) -> int:
    from fp8dist.audit.run import run_audit

    return run_audit(args)


def build_parser() -> argparse.ArgumentParser:
    from fp8dist import __version__

    parser = _Parser(prog="fp8dist", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fp8dist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("validate", help="check configs; print the resolved config")
    p.add_argument("config", nargs="+", help="YAML config(s); KEY=VALUE overrides may follow a single config")
    p.add_argument("--format", choices=["yaml", "json"], default="yaml")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("translate", help="print the DeepSpeed JSON, the FSDP2 plan or an Accelerate config file")
    p.add_argument("config")
    p.add_argument("--to", choices=["deepspeed", "fsdp2", "accelerate"], required=True)
    p.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    p.add_argument("--deepspeed-version", help="target DeepSpeed version (default: installed, else newest known)")
    p.add_argument("--torchao-version", help="target torchao version for --to fsdp2 (default: installed, else newest known)")
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("import", help="an Accelerate config, Axolotl YAML or DeepSpeed JSON as an fp8dist config")
    p.add_argument("file", help="the file to read (its kind is detected from its keys)")
    p.add_argument("--from", dest="kind", choices=["accelerate", "axolotl", "deepspeed"],
                   help="the kind of FILE, when detection cannot tell")
    p.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("schema", help="print the JSON Schema of the config")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("presets", help="list the named presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("env", help="versions, device, and which backends can run here")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("estimate", help="per-rank memory of a run (model built on the meta device: no weights read)")
    p.add_argument("model", help="built-in name (tiny-llama, small-llama), a shape (llama-3-8b, llama-3-70b, "
                   "bert-base-cased), a local Hugging Face model directory, or a config.json")
    p.add_argument("--config", help="fp8dist config (default: the schema defaults)")
    p.add_argument("--world-size", type=int, default=1, help="ranks the run shards over (default 1)")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("compare", help="loss curves of a config vs a baseline from the same weights and batches")
    p.add_argument("--config", required=True, help="the fp8dist config under test")
    p.add_argument("--baseline", required=True, help="the higher-precision fp8dist config to compare against")
    p.add_argument("--model", default="tiny-llama", help="built-in name, local Hugging Face model directory, or "
                   "package.module:factory (default tiny-llama)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (default 20)")
    p.add_argument("--data", help="local text or JSONL ({\"text\": ...} per line) file; default: synthetic batches")
    p.add_argument("--plot", help="write both loss curves and the gap to this PNG")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative loss gap that passes (default 0.05)")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (default 1)")
    p.add_argument("--timeout", type=float, default=AUDIT_TIMEOUT_S, help=f"seconds before the runs are stopped "
                   f"(default {AUDIT_TIMEOUT_S})")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("export", help="write a checkpoint's model in Hugging Face format (config.json + safetensors)")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a --checkpoint-dir of launch/train.py (its newest "
                   "complete checkpoint) or one step-NNNNNNNN checkpoint in it")
    p.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory (an earlier export there is replaced)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the exported weights (default: the run's precision.load_dtype)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("audit", help="measure the dtypes of a real run and compare with the documented table")
    p.add_argument("model", help="tiny-llama or small-llama (built in), a local Hugging Face model directory, or package.module:factory")
    p.add_argument("--config", help="fp8dist config (default: the schema defaults)")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    p.add_argument("--nproc", type=int, default=1, help="processes (2+ observes communication)")
    p.add_argument("--steps", type=int, default=2, help="training steps to observe")
    p.add_argument("--timeout", type=float, default=AUDIT_TIMEOUT_S,
                   help=f"seconds the audit run may take before it is stopped (default {AUDIT_TIMEOUT_S})")
    p.set_defaults(func=cmd_audit)
    return parser


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """KEY=VALUE words after the config are overrides, not positionals."""
    if not argv or argv[0] not in ("validate", "translate", "estimate"):
        return argv, []
    rest, overrides = [], []
    for word in argv:
        (overrides if ("=" in word and not word.startswith("-") and not os.path.exists(word)) else rest).append(word)
    return rest, overrides


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, overrides = _split_overrides(argv)
    args = build_parser().parse_args(argv)
    args.overrides = overrides
    try:
        return args.func(args)
    except Fp8distError as exc:
        print(f"fp8dist {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
