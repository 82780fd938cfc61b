"""Reading a config (or another tool's file) so that odd input is refused in bounded time and memory, and writing
YAML that reads back the same.

- Only a regular file is read, its size checked on the open descriptor before reading: a FIFO, a device
  (/dev/zero) or a directory is refused, never waited on or read without end.
- YAML is parsed by fp8dist before omegaconf sees it: only the tags of plain data (a `!!python/...` tag is never
  constructed; dates, sets, binary and pairs are not config values), bounded nesting, bounded alias expansion
  (billion laughs), no alias inside its own anchor (a structure that contains itself), duplicate keys refused,
  a value that cannot be built (`2024-13-45`, an integer of 5,000 digits) named with its line. A date stays a
  string and `1e-8` is a number, as JSON and YAML 1.2 read them.
- JSON the same way (duplicate keys, nesting, numbers).
- What comes out is plain data (`check_plain`, also run on dicts and overrides given in Python or on the command
  line): string keys, finite numbers within 64 bits, text without control characters, bounded nesting.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from fp8dist.errors import ConfigError, Issue

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_EXPANDED_NODES = 20_000
MAX_INTEGER = 2 ** 63 - 1  # DeepSpeed and torch read integers as 64-bit; a float holds any int below this
_TAG = "tag:yaml.org,2002:"
# The tags of plain data, what JSON holds: a date, a set, bytes or ordered pairs is not a config value.
_PLAIN_TAGS = {_TAG + name for name in ("str", "int", "float", "bool", "null", "map", "seq", "merge")}
# A number with an exponent and no dot or no exponent sign (1e-8, 1.0e8): YAML 1.1 reads it as a string, JSON
# and YAML 1.2 as a number (so does `fp8dist validate --format json`'s reader: it prints 1e-08).
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
# Characters YAML cannot carry unescaped (YAML 1.1 section 5.1); tab, newline and carriage return are text.
_NOT_TEXT = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _fail(source: str, message: str, fix: str) -> ConfigError:
    return ConfigError([Issue("", message, fix=fix)], source)


# -- files ---------------------------------------------------------------------------------------------------
def read_text(path: str | Path) -> str:
    """The UTF-8 text of a config file (regular, at most MAX_FILE_BYTES, no NUL byte)."""
    source = str(path)
    raw = _read_regular_file(path, source)
    if b"\x00" in raw:
        raise _fail(source, "binary file (contains NUL bytes)", "pass a YAML text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(source, f"not UTF-8 text ({exc.reason} at byte {exc.start})", "save the file as UTF-8") from None


def _read_regular_file(path: str | Path, source: str) -> bytes:
    """The bytes of a regular file, kind and size checked on the opened descriptor (no race with a swapped file).
    O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer; it is then refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise _fail(source, "file not found", "check the path") from None
    except (OSError, ValueError) as exc:
        raise _fail(source, f"cannot open it: {_os_reason(exc)}", "check the path and that you may read it") from None
    try:
        _check_regular(os.fstat(fd), source)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise _fail(source, f"cannot read it: {_os_reason(exc)}", "check the file") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:  # it grew after the check
        raise _too_large(source, len(raw))
    return raw


def _check_regular(info: os.stat_result, source: str) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise _fail(source, "is a directory, not a YAML file", "pass a .yaml file inside it")
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
        raise _fail(source, f"is {kind}, not a config file",
                    "pass a file saved on disk (fp8dist does not read pipes or devices)")
    if info.st_size > MAX_FILE_BYTES:
        raise _too_large(source, info.st_size)


def _too_large(source: str, size: int) -> ConfigError:
    return _fail(source, f"file is {size} bytes or more, larger than the {MAX_FILE_BYTES}-byte limit for a config",
                 "a precision config is a few dozen lines; check that this is the right file")


def _os_reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def read_file(path: str | Path) -> Any:
    """The parsed document of a config file: JSON when it is named *.json (what `validate --format json`
    prints), YAML otherwise."""
    text, source = read_text(path), str(path)
    return parse_json(text, source) if source.endswith(".json") else parse_yaml(text, source)


# -- YAML ----------------------------------------------------------------------------------------------------
def _without_timestamps(resolvers: dict) -> dict:
    return {first: [(tag, regexp) for tag, regexp in entries if tag != _TAG + "timestamp"]
            for first, entries in resolvers.items()}


class _Loader(yaml.SafeLoader):
    """SafeLoader for plain data: duplicate and unhashable keys refused; a scalar that cannot be built is a YAML
    error at its line, not a ValueError from deep inside PyYAML."""

    yaml_implicit_resolvers = _without_timestamps(yaml.SafeLoader.yaml_implicit_resolvers)

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
            value = node.value if isinstance(node, yaml.ScalarNode) else ""
            shown = value if len(value) <= 40 else f"{value[:37]}..."
            kind = node.tag.rsplit(":", 1)[-1]
            raise yaml.constructor.ConstructorError(None, None, f"cannot read {shown!r} as {kind} "
                                                    f"({str(exc).split(';')[0]})", node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # a list or mapping as a key
                raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a string",
                                                        key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes a string _Loader would read as a number (`'1e-8'`); dates stay quoted as well, so
    that PyYAML's safe_load (Accelerate, Axolotl) reads the file the same."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(_TAG + "float", _EXPONENT_FLOAT, list("-+0123456789."))


def parse_yaml(text: str, source: str) -> Any:
    try:
        _check_events(text, source)
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                raise _fail(source, "empty file", "write a mapping, e.g. `precision: {preset: bf16}`")
            _check_expansion(root, source)
            document = loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        fix = "write a plain value there" if isinstance(exc, yaml.constructor.ConstructorError) else \
            "fix the YAML syntax"
        raise _fail(source, f"not valid YAML{where}: {problem}", fix) from None
    check_plain(document, source)
    return document


def _check_events(text: str, source: str) -> None:
    """Walk parser events (no recursion, no construction): depth and tags."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _nesting(source)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        tag = getattr(event, "tag", None)
        if tag and tag != "!" and tag not in _PLAIN_TAGS:
            raise _fail(source, f"YAML tag {tag!r} is not allowed (line {event.start_mark.line + 1})",
                        "remove the tag: configs hold plain maps, lists, strings and numbers")


def _nesting(source: str) -> ConfigError:
    return _fail(source, f"nesting deeper than {MAX_DEPTH} levels", "a config is a few levels deep; check the file")


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Measure the document as if every alias were expanded, each node once (iterative post-order): its node count
    (billion laughs) and its depth (an alias deep inside another anchor nests deeper than the text shows). An alias
    inside its own anchor (`a: &a [*a]`) would be a structure that contains itself: refused."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded collection depth)
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_nodes.discard(id(node))
            below = [measured[id(child)] for child in _children(node)]
            size = 1 + sum(count for count, _ in below)
            depth = int(isinstance(node, yaml.CollectionNode)) + max((d for _, d in below), default=0)
            if size > MAX_EXPANDED_NODES:
                raise _fail(source, f"YAML aliases expand to more than {MAX_EXPANDED_NODES} nodes",
                            "remove the recursive anchors/aliases (a 'billion laughs' file)")
            if depth > MAX_DEPTH:
                raise _nesting(source)
            measured[id(node)] = (size, depth)
        elif id(node) in open_nodes:
            raise _fail(source, f"the alias at line {node.start_mark.line + 1} refers to an anchor it is inside (a "
                        "structure that contains itself)", "replace the alias by the values it should hold")
        elif id(node) not in measured:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def dump_yaml(document: Any, **style: Any) -> str:
    """YAML that parse_yaml reads back as `document` (and PyYAML's safe_load too)."""
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, **style)


# -- JSON ----------------------------------------------------------------------------------------------------
def parse_json(text: str, source: str) -> Any:
    """JSON with the YAML reader's bounds: duplicate keys refused, nesting bounded, plain data."""
    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                raise ConfigError([Issue(key, "duplicate key", fix="keep one of them")], source)
            seen[key] = value
        return seen

    try:
        document = json.loads(text, object_pairs_hook=pairs)
    except RecursionError:
        raise _nesting(source) from None
    except json.JSONDecodeError as exc:
        raise _fail(source, f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                    "fix the JSON syntax") from None
    except ValueError as exc:  # Python's limit on the digits of an integer read from text
        raise _fail(source, f"a number cannot be read ({exc})", "write the number it should be") from None
    check_plain(document, source)
    return document


# -- plain data ----------------------------------------------------------------------------------------------
def check_plain(document: Any, source: str) -> None:
    """Refuse what is not plain data, every place at once (see plain_data_issues)."""
    issues = plain_data_issues(document)
    if issues:
        raise ConfigError(issues, source)


def plain_data_issues(document: Any) -> list[Issue]:
    """Where `document` holds something no config, JSON file or YAML file read back could: a key that is not a
    string, a number out of range (NaN, infinity, an integer beyond 64 bits), text with control characters, a value
    of another type (a date given in Python), nesting beyond MAX_DEPTH (which also ends a structure that contains
    itself). Iterative: no recursion limit to hit."""
    issues: list[Issue] = []
    stack: list[tuple[Any, str, int]] = [(document, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, (Mapping, list, tuple)):
            if depth >= MAX_DEPTH:
                return issues + [Issue(path, f"nesting deeper than {MAX_DEPTH} levels",
                                       fix="a config is a few levels deep; check it")]
            for key, value in (node.items() if isinstance(node, Mapping) else enumerate(node)):
                where = _join(path, key if isinstance(key, (str, int)) else repr(key))
                if isinstance(node, Mapping) and (problem := _key_problem(key)):
                    issues.append(Issue(where, problem, _shown(key), "write the key as a quoted name, or remove "
                                        "it"))
                    continue
                stack.append((value, where, depth + 1))
        elif (value_problem := _value_problem(node)) is not None:
            issues.append(Issue(path, value_problem[0], _shown(node), value_problem[1]))
    return sorted(issues, key=lambda issue: issue.path)


def _key_problem(key: Any) -> str | None:
    if not isinstance(key, str):
        return f"a key must be a string, not {_kind(key)}"
    return _text_problem(key)


def _value_problem(value: Any) -> tuple[str, str] | None:
    """(why, fix) when `value` is not a plain scalar a config can hold."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        problem = _text_problem(value)
        return (problem, "remove the character") if problem else None
    if isinstance(value, int):
        return None if abs(value) <= MAX_INTEGER else (
            "number out of range (config numbers fit in 64 bits)", "write the number it should be")
    if isinstance(value, float):
        return None if math.isfinite(value) else (
            "not a finite number (NaN and infinity are not JSON, and no setting takes them)",
            "write a finite number")
    return (f"{_kind(value)} is not a config value (configs hold mappings, lists, strings, numbers, true/false "
            "and null)", "write it as a string or a number")


def _text_problem(text: str) -> str | None:
    bad = _NOT_TEXT.search(text)
    return None if bad is None else f"holds the control character {bad.group()!r}, which YAML cannot write as text"


def _kind(value: Any) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), f"a {type(value).__name__}")


def _shown(value: Any) -> Any:
    """The value for a message: an integer too long to print is said by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INTEGER:
        return f"an integer of {value.bit_length()} bits"
    return value


def _join(path: str, part: Any) -> str:
    return f"{path}.{part}" if path else str(part)


def strings(document: Any) -> Iterator[tuple[str, str]]:
    """(dotted path, text) of every string value in `document` (keys not included)."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            yield path, node
        elif isinstance(node, Mapping):
            stack.extend((value, _join(path, key)) for key, value in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((value, _join(path, index)) for index, value in enumerate(node))
