"""The one rule every importer applies to every key of another tool's file, written once.

Each key is in one of three classes, and each importer's table (KEYS in fp8dist/formats/<tool>/importer.py) says
which, with why; docs/import.md prints the tables:
- KEPT: fp8dist keeps its meaning; the importer maps it to the fp8dist key the table names (or, for DeepSpeed,
  into `deepspeed.extra`, which DeepSpeed itself reads);
- NO_EFFECT: it changes neither the numerics, nor the parallel layout, nor which parameters train, nor the
  global batch: it is noted in the output (`# not kept: KEY: VALUE - why`);
- REFUSED: it changes one of those and fp8dist cannot keep it: the import stops, naming the key, the value, why
  and the fix (exit 2, nothing written). A refusal may apply to some values only (`unless`: a parallel size of 1,
  an adapter of kind none), the others then have no effect and are noted.
A key in none of the tables is noted as unknown, with what to check; it is never dropped without a word.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from fp8dist.errors import Issue


class KeyClass(str, Enum):
    KEPT = "kept"
    NO_EFFECT = "no effect"
    REFUSED = "refused"


@dataclass(frozen=True)
class KeyRule:
    cls: KeyClass
    why: str  # KEPT: where it goes; NO_EFFECT: why it has none; REFUSED: what it changes that fp8dist cannot keep
    fix: str = ""  # REFUSED: what to do instead
    unless: Callable[[Any], bool] | None = None  # REFUSED: values for which the key has no effect after all
    otherwise: str = ""  # REFUSED with `unless`: why those values have none
    example: Any = True  # a value that exercises the class (tests/unit/formats/test_key_tables.py)


def kept(where: str, example: Any = True) -> KeyRule:
    return KeyRule(KeyClass.KEPT, where, example=example)


def no_effect(why: str, example: Any = True) -> KeyRule:
    return KeyRule(KeyClass.NO_EFFECT, why, example=example)


def refused(why: str, fix: str, *, unless: Callable[[Any], bool] | None = None, otherwise: str = "",
            example: Any = True) -> KeyRule:
    return KeyRule(KeyClass.REFUSED, why, fix, unless, otherwise, example)


def size_above_one(value: Any) -> bool:
    try:
        return int(value) > 1
    except (TypeError, ValueError):
        return True


def one_or_unset(value: Any) -> bool:
    return value in (None, "", 0, 1, "1") or not size_above_one(value)


def disabled(value: Any) -> bool:
    """false, 0, null, an empty section, `none`: a switch that is off."""
    if isinstance(value, dict):
        return not value or value.get("enabled") in (False, "false", 0)
    return value in (None, False, 0, "", "none", "None", "false", "False", "no")


class Table:
    """One tool's keys (dotted paths for nested sections) and the rule for those its importer did not map."""

    def __init__(self, tool: str, rules: dict[str, KeyRule], unknown_why: str):
        self.tool, self.rules, self.unknown_why = tool, dict(rules), unknown_why

    def rule(self, key: str) -> KeyRule | None:
        return self.rules.get(key)

    def settle(self, key: str, value: Any, notes, issues: list[Issue], shown: str | None = None) -> None:
        """Apply the rule to a key the importer left (not mapped). `shown`: the key as the output names it (with a
        prefix such as the file it came from); default `key`."""
        shown = shown or key
        if value is None:  # a key written without a value sets nothing: the tool's default applies
            return
        rule = self.rules.get(key)
        if rule is None:
            notes.dropped(shown, value, f"not in fp8dist's table of {self.tool} keys (docs/import.md): "
                                        f"{self.unknown_why}")
        elif rule.cls is KeyClass.REFUSED:
            if rule.unless is not None and rule.unless(value):
                notes.dropped(shown, value, rule.otherwise or "no effect with this value")
            else:
                issues.append(Issue(shown, rule.why, value, rule.fix))
        elif rule.cls is KeyClass.NO_EFFECT:
            notes.dropped(shown, value, rule.why)
        else:  # KEPT, but the importer did not map it: its own bug, said as such rather than dropped
            raise AssertionError(f"{self.tool} importer left the kept key {key!r} unmapped")

    def refuse(self, key: str, value: Any, issues: list[Issue], shown: str | None = None) -> bool:
        """The importer met a REFUSED key while mapping a section: add the issue (unless the value has no effect).
        True when refused."""
        rule = self.rules[key]
        if rule.unless is not None and rule.unless(value):
            return False
        issues.append(Issue(shown or key, rule.why, value, rule.fix))
        return True
