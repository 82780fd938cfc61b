"""Errors a user can act on. The CLI prints them without a traceback and exits 2."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    """Every exit code of the CLI, launch/train.py and the rank processes."""

    OK = 0
    MISMATCH = 1  # the audit saw another dtype than the config's (or could not measure a phase); compare beyond tolerance
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
    """The config is invalid. Carries every issue found, not just the first."""

    def __init__(self, issues: list[Issue], source: str | None = None):
        self.issues = list(issues)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid fp8dist config{where}: {len(self.issues)} problem(s)"]
        lines += [f"  - {issue.render()}" for issue in self.issues]
        super().__init__("\n".join(lines))


class UnsupportedEnvironment(Fp8distError):
    """The config is valid but cannot run here (missing package, wrong version, no FP8 hardware)."""

    def __init__(self, message: str, fix: str | None = None):
        self.fix = fix
        super().__init__(message + (f"\n  fix: {fix}" if fix else ""))
