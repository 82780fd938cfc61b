"""`fp8dist validate CONFIG... [KEY=VALUE ...]`: the resolved config, or every error at once: the config's own, and
what `translate --to deepspeed` would refuse in its `deepspeed.extra` (fp8dist.translate.deepspeed.extra_issues)."""
from __future__ import annotations

import sys

from fp8dist.commands.output import dump_json
from fp8dist.config.load import load_config
from fp8dist.config.reading import dump_yaml
from fp8dist.errors import ConfigError, ExitCode, Fp8distError
from fp8dist.translate.deepspeed import extra_issues


def run(args) -> int:
    if len(args.config) > 1 and args.overrides:
        raise Fp8distError("KEY=VALUE overrides apply to one config; pass a single CONFIG with them")
    failed = 0
    for path in args.config:
        try:
            spec = load_config(path, overrides=args.overrides)
            issues = extra_issues(spec)
            if issues:
                raise ConfigError(issues, path)
        except Fp8distError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        if spec.notes and said(spec.notes, f"{path}: ", args.strict):
            failed += 1
            continue
        if len(args.config) == 1:
            sys.stdout.write(dump_json(spec.to_dict()) if args.format == "json" else as_yaml(spec.to_dict()))
        else:
            print(f"ok  {path}")
    return ExitCode.ERROR if failed else ExitCode.OK


def said(notes, prefix: str, strict: bool) -> bool:
    """Print the notes on stderr, one line each; True when --strict makes them refusals."""
    word = "refused (--strict)" if strict else "note"
    for note in notes:
        print(f"{prefix}{word}: {note}", file=sys.stderr)
    return strict


def as_yaml(document) -> str:
    return dump_yaml(document, default_flow_style=None)
