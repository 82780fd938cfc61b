"""`fp8dist calibrate MODEL --config C -o policy.yaml [--nproc N] [--steps K] [KEY=VALUE ...]`: precision.fp8.policy
auto's calibration pass (fp8dist.audit.calibration) on N ranks (fp8dist.commands.calibrate_worker), written as a
config that says the decision explicitly: C as written (with the KEY=VALUE overrides), `precision.fp8.policy: manual`
and the calibrated `precision.fp8.overrides` after the written ones, one comment line per Linear with its reasons.
A run of the written file reproduces the decision without calibrating again (its audit checks each Linear's format).

Everything that can fail without launching fails first (exit 2, one message naming the flag or key, nothing
written); the file is checked to load as a config before it is written, and written atomically.
"""
from __future__ import annotations

import sys
from typing import Any

from fp8dist.commands.audit import TIMEOUT_S, check_before_launch
from fp8dist.commands.output import check_output, write_atomic
from fp8dist.config import reading
from fp8dist.config.load import apply_overrides, load_config
from fp8dist.config.rules.policy import calibration_issues
from fp8dist.errors import ConfigError, ExitCode, Fp8distError
from fp8dist.runtime.ranks import launch

WORKER = "fp8dist.commands.calibrate_worker"


def _flag_error(flag: str, value: Any, why: str, fix: str) -> Fp8distError:
    return Fp8distError(f"{flag} {value}: {why}\n  fix: {fix}")


def run(args) -> int:
    if args.nproc < 1:
        raise _flag_error("--nproc", args.nproc, "at least one rank calibrates", "--nproc 1 (or more ranks)")
    if args.steps is not None and args.steps < 1:
        raise _flag_error("--steps", args.steps, "the calibration runs at least one step's batches",
                          "--steps 1 or more (default: precision.fp8.calibration_steps, 2)")
    if args.timeout <= 0:
        raise _flag_error("--timeout", f"{args.timeout:g}", "a time bound is positive seconds",
                          f"--timeout {TIMEOUT_S}")
    check_output(args.output)  # before anything runs: nothing to write into is said now
    overrides = list(args.overrides) + [f"precision.fp8.calibration_steps={args.steps}"] * (args.steps is not None)
    # the config's own policy (manual or auto) does not matter here: calibrate measures as auto would
    spec = load_config(args.config, overrides=overrides + ["precision.fp8.policy=manual"])
    issues = calibration_issues(spec, run=False)
    if issues:
        raise ConfigError(issues, args.config)
    check_before_launch(spec, args.model, args.nproc)
    result = launch(WORKER, [args.model, args.config, "\n".join(overrides + ["precision.fp8.policy=manual"])],
                    args.nproc, args.timeout, "calibration run",
                    lambda line: print(line, file=sys.stderr, flush=True))
    document = written(args.config, args.overrides, result["overrides"])
    try:
        load_config(document)
    except ConfigError as exc:  # the calibrated overrides with the rest of the config: what a run would refuse
        raise Fp8distError(f"the calibrated policy does not load as a config with {args.config}: {exc}; nothing "
                           f"written\n  fix: report this with the config") from None
    text = header(args, result) + _yaml(document)
    write_atomic(args.output, text)
    print(f"fp8dist: note: {result['report']}", file=sys.stderr, flush=True)
    print(f"fp8dist calibrate: wrote {args.output}: {result['summary']}")
    return ExitCode.OK


def written(config: str, overrides: list[str], calibrated: list[dict[str, Any]]) -> dict[str, Any]:
    """The config as written (its KEY=VALUE overrides applied), with policy manual and the calibrated overrides
    after the written ones."""
    document = reading.read_file(config)
    if overrides:
        document = apply_overrides(document, overrides, config)
    document = dict(document)
    precision = dict(document.get("precision") or {})
    fp8 = dict(precision.get("fp8") or {})
    fp8.pop("calibration_steps", None)  # manual: nothing calibrates
    fp8["policy"] = "manual"
    fp8["overrides"] = list(fp8.get("overrides") or []) + calibrated
    precision["fp8"] = fp8
    document["precision"] = precision
    return document


def header(args, result: dict[str, Any]) -> str:
    lines = [f"# fp8dist calibrate {args.model} --config {args.config}"
             + "".join(f" {o}" for o in args.overrides) + f" --nproc {args.nproc}"
             + (f" --steps {args.steps}" if args.steps is not None else ""),
             f"# device: {result['device']}; {result['summary']}",
             "# the decision per Linear (precision.fp8.overrides below says it; policy manual: no calibration again):"]
    for d in result["decisions"]:
        lines.append(f"#   {d['fqn']}: {d['recipe'] or 'compute dtype'} ({d['numerics']}; {d['speed']})")
    return "\n".join(lines) + "\n"


def _yaml(document: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=120)
