"""Errors a user can act on. The CLI prints them without a traceback and exits 2."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Iterator, Mapping, Sequence


class ExitCode(IntEnum):
    """Every exit code of the CLI, launch/train.py and the rank processes."""

    OK = 0
    # the audit saw another dtype than the config's (or could not measure a phase); compare beyond tolerance
    MISMATCH = 1
    ERROR = 2  # a usage, config or environment error: the message says which, and the fix
    LOST_PEER = 3  # launch/train.py: another rank died or stopped answering within train.process_group_timeout_s
    INTERRUPTED = 130  # Ctrl-C

_UNSET = object()


@dataclass(frozen=True)
class Issue:
    """One problem in a config: where it is, what is wrong, and how to fix it."""

    path: str
    message: str
    value: Any = _UNSET
    fix: str | None = None

    def render(self) -> str:
        text = f"{self.path or '<top level>'}: {self.message}"
        if self.value is not _UNSET:
            text += f" (got {_short(self.value)})"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Fp8distError(Exception):
    """Base class: a usage, config or environment problem (CLI exit code 2)."""

    exit_code = ExitCode.ERROR


class ConfigError(Fp8distError):
    """The config is invalid. Carries every issue found, not just the first. `overrides`: the KEY=VALUE overrides
    the issues come from, when the file itself is valid (the message then names them, not the file)."""

    def __init__(self, issues: list[Issue], source: str | None = None, overrides: Sequence[str] = ()):
        self.issues = list(issues)
        self.source = source
        self.overrides = tuple(overrides)
        where = f" in {source}" if source else ""
        if self.overrides:
            named = ", ".join(repr(override) for override in self.overrides)
            subject = f"override{'s' if len(self.overrides) > 1 else ''} {named}" + (f" of {source}" if source else "")
        else:
            subject = f"fp8dist config{where}"
        lines = [f"invalid {subject}: {len(self.issues)} problem(s)"]
        lines += [f"  - {issue.render()}" for issue in self.issues]
        super().__init__("\n".join(lines))


class UnsupportedEnvironment(Fp8distError):
    """The config is valid but cannot run here (missing package, wrong version, no FP8 hardware). `fix_settings`:
    config keys the fix sets (`precision.fp8.torchao.emulate: True`), where one fix is a setting; the preflight then
    says at once what the config would be refused for with it."""

    def __init__(self, message: str, fix: str | None = None, fix_settings: Mapping[str, Any] | None = None):
        self.fix = fix
        self.fix_settings = dict(fix_settings or {})
        super().__init__(message + (f"\n  fix: {fix}" if fix else ""))


class Problems(Fp8distError):
    """Several independent problems found by one check (a run's up-front checks): each said with its own fix, so
    the user fixes them all at once instead of meeting them one run at a time."""

    def __init__(self, errors: Sequence[Fp8distError]):
        self.errors = list(errors)
        self.exit_code = max(error.exit_code for error in self.errors)
        lines = [f"{len(self.errors)} problems, each below with its fix; nothing was started"]
        for number, error in enumerate(self.errors, 1):
            first, *rest = str(error).splitlines() or [type(error).__name__]
            lines.append(f"  {number}. {first}")
            lines += [f"     {line}" for line in rest]
        super().__init__("\n".join(lines))


class Checks:
    """Runs independent checks and collects what each refuses (`with checks.one(): ...`); `raise_found` then
    raises nothing, the one error as it is, or every error at once (Problems)."""

    def __init__(self):
        self.errors: list[Fp8distError] = []

    def add(self, error: Fp8distError) -> None:
        """A problem found without a call that raises it."""
        self.errors.append(error)

    @contextmanager
    def one(self) -> Iterator[None]:
        try:
            yield
        except Problems as exc:
            self.errors.extend(exc.errors)
        except Fp8distError as exc:
            self.errors.append(exc)

    def raise_found(self) -> None:
        """An error said twice (two configs refused for the same reason) is said once."""
        said: dict[str, Fp8distError] = {}
        for error in self.errors:
            said.setdefault(str(error), error)
        errors = list(said.values())
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise Problems(errors)
