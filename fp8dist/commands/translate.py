"""`fp8dist translate CONFIG --to deepspeed|fsdp2|accelerate [-o FILE] [KEY=VALUE ...]`: stdout holds only the
document (the DeepSpeed JSON, the FSDP2 plan, or the Accelerate config file); `-o` writes it atomically."""
from __future__ import annotations

import sys
from typing import Any, Callable

from fp8dist.commands.output import check_output, dump_json, emit, write_atomic
from fp8dist.config.load import load_config
from fp8dist.errors import ExitCode, Fp8distError
from fp8dist.formats.accelerate.translate import (NotExpressible, accelerate_file, nearest_accelerate_file,
                                                  render)
from fp8dist.commands.validate import said
from fp8dist.translate.deepspeed import left_to_runtime, to_deepspeed
from fp8dist.translate.fsdp2 import to_fsdp2


def _fsdp2_json(spec, torchao_version: str | None = None, te_version: str | None = None) -> dict[str, Any]:
    return to_fsdp2(spec, torchao_version, te_version).to_json()


# target -> (its JSON document's translator, {its version flag: the translator's keyword for it, also the flag's
# argparse name})
TARGETS: dict[str, tuple[Callable[..., dict[str, Any]], dict[str, str]]] = {
    "deepspeed": (to_deepspeed, {"--deepspeed-version": "deepspeed_version"}),
    "fsdp2": (_fsdp2_json, {"--torchao-version": "torchao_version", "--te-version": "te_version"})}


def run(args) -> int:
    spec = load_config(args.config, overrides=args.overrides)
    notes = list(spec.notes) + (left_to_runtime(spec) if args.to == "deepspeed" else [])
    if notes and said(notes, f"{args.config}: ", args.strict):
        raise Fp8distError(f"{len(notes)} setting(s) of {args.config} would not be in the {args.to} file (above); "
                           "nothing written\n  fix: remove them, or translate without --strict (they are said, and "
                           "fp8dist's runtime still applies what it applies)")
    for target, (_, flags) in TARGETS.items():
        for flag, keyword in flags.items():
            # Accelerate's file takes the DeepSpeed and torchao targets; its TE recipe is Accelerate's own kwargs
            takes = args.to == target or (args.to == "accelerate" and keyword != "te_version")
            if getattr(args, keyword) and not takes:
                raise Fp8distError(f"{flag} applies to --to {target} only")
    if args.to == "accelerate":
        return _accelerate(args, spec)
    translator, flags = TARGETS[args.to]
    emit(dump_json(translator(spec, **{keyword: getattr(args, keyword) for keyword in flags.values()})), args.output)
    return ExitCode.OK


def _accelerate(args, spec) -> int:
    """The Accelerate config file (YAML; JSON when -o names a .json file). The DeepSpeed config is embedded as JSON
    text on stdout; with -o it is written beside the file as <name>.deepspeed.json and named by its absolute path
    (accelerate 1.15 HfDeepSpeedConfig reads both). What Accelerate cannot express is moved to the nearest setting it
    can, every difference said on stderr (and in the YAML's header); --strict refuses instead, writing nothing."""
    if args.strict:
        try:
            document, plan = accelerate_file(spec, args.deepspeed_version, args.torchao_version)
        except NotExpressible as exc:
            raise Fp8distError(f"{exc}\n(--strict: without it, the nearest run Accelerate can express is written where "
                               "one exists, every difference said)") from None
        differences: list[str] = []
    else:
        document, plan, spec, differences = nearest_accelerate_file(spec, args.deepspeed_version,
                                                                     args.torchao_version)
    for difference in differences:
        print(f"{args.config}: differs for Accelerate: {difference}", file=sys.stderr)
    if differences:
        print(f"{args.config}: the file is the nearest run Accelerate can express, not this config's: "
              f"{len(differences)} setting(s) differ (above); --strict refuses instead", file=sys.stderr)
    beside = None
    if args.output:
        target = check_output(args.output)
        if "deepspeed_config" in document:
            beside = target.with_name(target.name.rsplit(".", 1)[0] + ".deepspeed.json")
            document["deepspeed_config"]["deepspeed_config_file"] = str(beside.resolve())
    text = dump_json(document) if args.output and args.output.endswith(".json") else render(document, plan, spec,
                                                                                             args.config, differences)
    if not args.output:
        sys.stdout.write(text)
        return ExitCode.OK
    if beside is not None:
        write_atomic(str(beside), dump_json(plan["deepspeed"]["config"]))
    try:
        write_atomic(args.output, text)
    except BaseException:
        if beside is not None:
            beside.unlink(missing_ok=True)
        raise
    return ExitCode.OK
