"""Load a config: safe YAML -> omegaconf (overrides, interpolation) -> plain dict -> schema -> rules -> spec.

YAML is parsed by fp8dist itself before omegaconf sees it, so that hostile files are refused in
bounded time and memory: size cap, no binary, only the YAML core tags (a `!!python/...` tag is never
constructed), bounded nesting, bounded alias expansion (billion laughs), duplicate keys refused.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

import fp8dist.config.rules as rules

import fp8dist.config.schema as schema

import fp8dist.config.vocabulary as vocabulary
from fp8dist.config.spec import Spec
from fp8dist.errors import ConfigError, Issue

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_EXPANDED_NODES = 20_000
_CORE_TAGS = {f"tag:yaml.org,2002:{name}" for name in
              ("str", "int", "float", "bool", "null", "map", "seq", "timestamp", "binary", "merge", "set", "omap", "pairs")}


def _fail(source: str, message: str, fix: str | None = None, value: Any = None) -> ConfigError:
    issue = Issue("", message, fix=fix) if value is None else Issue("", message, value, fix)
    return ConfigError([issue], source)


def read_text(path: str | Path) -> str:
    source = str(path)
    p = Path(path)
    if not p.exists():
        raise _fail(source, "file not found", "check the path")
    if p.is_dir():
        raise _fail(source, "is a directory, not a YAML file", "pass a .yaml file inside it")
    size = p.stat().st_size
    if size > MAX_FILE_BYTES:
        raise _fail(source, f"file is {size} bytes, larger than the {MAX_FILE_BYTES}-byte limit for a config",
                    "a precision config is a few dozen lines; check that this is the right file")
    raw = p.read_bytes()
    if b"\x00" in raw:
        raise _fail(source, "binary file (contains NUL bytes)", "pass a YAML text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(source, f"not UTF-8 text ({exc.reason} at byte {exc.start})", "save the file as UTF-8") from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict)):
                raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a scalar",
                                                        key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_events(text: str, source: str) -> None:
    """Walk parser events (no recursion, no construction): depth and tags."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _fail(source, f"nesting deeper than {MAX_DEPTH} levels",
                            "a config is a few levels deep; check the file")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        tag = getattr(event, "tag", None)
        if tag and tag != "!" and tag not in _CORE_TAGS:
            raise _fail(source, f"YAML tag {tag!r} is not allowed (line {event.start_mark.line + 1})",
                        "remove the tag: configs hold plain maps, lists, strings and numbers")


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Count nodes as if every alias were expanded, sharing work per node (billion-laughs guard)."""
    sizes: dict[int, int] = {}
    order: list[yaml.Node] = []
    stack, seen = [root], set()
    while stack:  # iterative post-order over the node graph
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        stack.extend(_children(node))
    for node in reversed(order):
        total = 1 + sum(sizes.get(id(child), 1) for child in _children(node))
        if total > MAX_EXPANDED_NODES:
            raise _fail(source, f"YAML aliases expand to more than {MAX_EXPANDED_NODES} nodes",
                        "remove the recursive anchors/aliases (a 'billion laughs' file)")
        sizes[id(node)] = total


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def parse_yaml(text: str, source: str) -> Any:
    try:
        _check_events(text, source)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            raise _fail(source, "empty file", "write a mapping, e.g. `precision: {preset: bf16}`")
        _check_expansion(root, source)
        loader = _StrictLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise _fail(source, f"not valid YAML{where}: {problem}", "fix the YAML syntax") from None


def apply_overrides(document: dict[str, Any], overrides: Sequence[str], source: str) -> dict[str, Any]:
    """Merge `key=value` overrides (omegaconf dotlist syntax) and resolve `${...}` interpolations."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError([Issue("", "override is not KEY=VALUE", o, "write e.g. precision.load_dtype=bf16")
                           for o in bad], source)
    try:
        merged = OmegaConf.merge(OmegaConf.create(document), OmegaConf.from_dotlist(list(overrides)))
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        first = str(exc).splitlines()[0]
        raise ConfigError([Issue(str(key), f"cannot resolve: {first}",
                                 fix="fix or remove the ${...} interpolation (it must name an existing key "
                                     "and must not refer to itself)")], source) from None
    except (RecursionError, ValueError, TypeError) as exc:
        raise ConfigError([Issue("", f"cannot build the config: {exc}")], source) from None
    return resolved


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, nested dicts merged key by key; `deepspeed.extra` is replaced whole."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and key != "extra":
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# Enum keys with an `off` value: YAML 1.1 (PyYAML, omegaconf) reads a bare `off` as false.
OFF_KEYS = (("audit", "first_step"),)


def _unbool_off(document: Mapping[str, Any]) -> Mapping[str, Any]:
    """`first_step: off` as the user wrote it, not the false YAML made of it."""
    for section, key in OFF_KEYS:
        block = document.get(section)
        if isinstance(block, Mapping) and block.get(key) is False:
            document = {**document, section: {**block, key: "off"}}
    return document


def resolve(document: Any, source: str = "<config>") -> dict[str, Any]:
    """Validate the user's document, then layer defaults < preset < document and check the rules."""
    if not isinstance(document, Mapping):
        kind = "a list" if isinstance(document, list) else f"a {type(document).__name__}"
        raise ConfigError([Issue("", f"the top level must be a mapping, not {kind}",
                                 fix="write keys at the top level, e.g. `engine: fsdp2`")], source)
    document = vocabulary.normalize(_unbool_off(document))
    issues = schema.validate(dict(document))
    if issues:
        raise ConfigError(issues, source)
    layered = schema.defaults()
    preset = (document.get("precision") or {}).get("preset")
    written = dict(document)  # what the user wrote, the preset's values counted as written by the user
    if preset:
        written = deep_merge(schema.presets()[preset]["values"], document)
        layered = deep_merge(layered, schema.presets()[preset]["values"])
    layered = deep_merge(layered, document)
    layered["precision"]["preset"] = preset
    issues = schema.validate(layered) or vocabulary.derive(layered, written, document) or rules.check(layered, explicit=document)
    if issues:
        raise ConfigError(issues, source)
    return layered


def load_config(config: str | Path | Mapping[str, Any] | Any = None,
                overrides: Sequence[str] = ()) -> Spec:
    """Load a config from a YAML path, a dict or an omegaconf object (None: all defaults).

    Version-dependent rules (DeepSpeed windows for MS-AMP, installed torchao) are checked where
    a version is known: by the translators and the runtimes, not here.
    """
    if config is None:
        source, document = "<defaults>", {}
    elif isinstance(config, (str, Path)):
        source = str(config)
        document = parse_yaml(read_text(config), source)
        if not isinstance(document, Mapping):
            document = resolve(document, source)  # raises the top-level error
    elif isinstance(config, Mapping):
        source, document = "<dict>", dict(config)
    else:
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(config, DictConfig):
            raise ConfigError([Issue("", f"cannot load a config from {type(config).__name__}",
                                     fix="pass a YAML path, a dict or an omegaconf DictConfig")])
        source, document = "<omegaconf>", OmegaConf.to_container(config, resolve=False)
    if overrides or _has_interpolation(document):
        document = apply_overrides(document, overrides, source)
    resolved = resolve(document, source)
    return Spec.from_dict(resolved, source=source, notes=tuple(rules.notes(resolved, document)))


def _has_interpolation(node: Any) -> bool:
    if isinstance(node, str):
        return "${" in node
    if isinstance(node, Mapping):
        return any(_has_interpolation(k) or _has_interpolation(v) for k, v in node.items())
    if isinstance(node, list):
        return any(_has_interpolation(v) for v in node)
    return False
