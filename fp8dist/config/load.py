"""Load a config: safe YAML -> omegaconf (overrides, interpolation) -> plain dict -> schema -> spec -> rules.

The file is read and parsed by fp8dist.config.reading (bounded, plain data only) before omegaconf sees it.
Interpolation resolves references to other keys of the config only: an omegaconf resolver (`${oc.env:NAME}`,
any `${name:...}`) is refused, since it reaches outside the file (an untrusted config would copy secrets from the
environment into the files fp8dist writes).
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

import fp8dist.config.reading as reading
import fp8dist.config.rules as rules

import fp8dist.config.schema as schema

import fp8dist.config.vocabulary as vocabulary
from fp8dist.config.spec import Spec
from fp8dist.errors import ConfigError, Issue

# Which other tool's file a document is, as one issue naming the import to run (fp8dist.formats.importing
# other_tool_issue). The formats layer is above this one: the composition root (fp8dist/__init__.py) hands it down.
OtherTool = Callable[[Mapping[str, Any], str], "Issue | None"]
_other_tool: list[OtherTool] = []


def provide_other_tool(find: OtherTool) -> None:
    """Install the recognition of other tools' files; the composition root calls it once."""
    _other_tool[:] = [find]


_REFERENCE_ONLY = ("interpolation may only name another key of the config, e.g. ${precision.load_dtype}; "
                   "write the value itself")
_ABSENT = object()


def apply_overrides(document: dict[str, Any], overrides: Sequence[str], source: str) -> dict[str, Any]:
    """Merge `key=value` overrides (values read as YAML, like the file) and resolve `${...}` references to other
    keys; a resolver is refused (resolver_calls), and so is a `${` left after resolving (literal_interpolations)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    values = _override_values(overrides, source)
    try:
        merged = OmegaConf.create(document)
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        raise ConfigError([Issue("", f"cannot build the config: {str(exc).splitlines()[0]}")], source) from None
    for override, (key, value) in zip(overrides, values):
        try:
            OmegaConf.update(merged, key, value, merge=True)
        # omegaconf 2.3's key parser raises IndexError on a key that opens a bracket it never closes ("[x")
        except (OmegaConfBaseException, ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError([Issue(key, f"not a key path, so the override cannot be applied ({first})",
                                     fix="name a key with dots between its sections, e.g. precision.load_dtype=bf16")],
                              source, overrides=[override]) from None
    try:
        unresolved = OmegaConf.to_container(merged, resolve=False)
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        raise ConfigError([Issue("", f"cannot apply the overrides: {str(exc).splitlines()[0]}",
                                 fix="check the KEY=VALUE words")], source, overrides=overrides) from None
    issues = resolver_calls(unresolved)
    if issues:
        raise ConfigError(issues, source)
    try:
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        first = str(exc).splitlines()[0]
        raise ConfigError([Issue(str(key), f"cannot resolve: {first}",
                                 fix="fix or remove the ${...} interpolation (it must name an existing key "
                                     "and must not refer to itself)")], source) from None
    except (RecursionError, ValueError, TypeError) as exc:
        raise ConfigError([Issue("", f"cannot build the config: {exc}")], source) from None
    issues = literal_interpolations(resolved, "after interpolation (an escaped \\${...})")
    if issues:
        raise ConfigError(issues, source)
    return cast(dict[str, Any], resolved)  # the container of a DictConfig built from a dict is a dict


def _override_values(overrides: Sequence[str], source: str) -> list[tuple[str, Any]]:
    """(key, value) of each KEY=VALUE override, the value read by the config file's YAML reader; every malformed
    override is named."""
    values, issues, bad = [], [], []
    for override in overrides:
        key, equals, text = override.partition("=")
        if not equals or not key.strip():
            issues.append(Issue("", "override is not KEY=VALUE", override, "write e.g. precision.load_dtype=bf16"))
            bad.append(override)
            continue
        try:
            values.append((key, reading.parse_yaml(text, f"override {override}") if text.strip() else None))
        except ConfigError as exc:
            issues += [Issue(key, f"the value of override {override!r}: {issue.message}", fix=issue.fix)
                       for issue in exc.issues]
            bad.append(override)
    if issues:
        raise ConfigError(issues, source, overrides=bad)
    return values


def resolver_calls(document: Any) -> list[Issue]:
    """One issue per string of `document` that calls an omegaconf resolver (`${oc.env:HOME}`, `${oc.decode:...}`,
    any registered `${name:...}`), found with omegaconf's own grammar, so what is refused is what it would call."""
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar_parser import OmegaConfGrammarParser, parse

    issues = []
    for path, text in reading.strings(document):
        if "${" not in text:
            continue
        try:
            tree = parse(text)
        except GrammarParseError:
            continue  # not an interpolation omegaconf can resolve: refused when it resolves
        nodes = [tree]
        while nodes:
            node = nodes.pop()
            if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
                issues.append(Issue(path, "calls an omegaconf resolver, which reaches outside the config (oc.env "
                                    "reads the environment)", text, _REFERENCE_ONLY))
                break
            nodes.extend(getattr(node, "children", None) or ())
    return sorted(issues, key=lambda issue: issue.path)


def literal_interpolations(document: Any, where: str) -> list[Issue]:
    """One issue per string of `document` that holds `${` where it must be taken as written (`where`): fp8dist
    reads `${` in a config as an interpolation, so the config it prints could not be read back the same."""
    return sorted((Issue(path, f"holds `${{` {where}, which fp8dist would read as an interpolation", text,
                         "write the value without `${`") for path, text in reading.strings(document) if "${" in text),
                  key=lambda issue: issue.path)


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
    return _checked(document, source)[0]


def _checked(document: Any, source: str) -> tuple[dict[str, Any], Spec]:
    """(the resolved config, its spec): the schema validates the layered dict, the vocabulary derives the DeepSpeed
    keys, and the rules check the spec built from it."""
    if not isinstance(document, Mapping):
        kind = "a list" if isinstance(document, list) else f"a {type(document).__name__}"
        raise ConfigError([Issue("", f"the top level must be a mapping, not {kind}",
                                 fix="write keys at the top level, e.g. `engine: fsdp2`")], source)
    written_document = document
    document = vocabulary.normalize(_unbool_off(document))
    issues = schema.validate(dict(document))
    if issues:  # another tool's file: said once, with the import, instead of one unknown key per line
        other = _other_tool[0](written_document, source) if _other_tool else None
        raise ConfigError([other] if other else issues, source)
    layered = schema.defaults()
    preset = (document.get("precision") or {}).get("preset")
    written = dict(document)  # what the user wrote, the preset's values counted as written by the user
    if preset:
        written = deep_merge(schema.presets()[preset]["values"], document)
        layered = deep_merge(layered, schema.presets()[preset]["values"])
    layered = deep_merge(layered, document)
    layered["precision"]["preset"] = preset
    issues = schema.validate(layered)
    if issues:
        raise ConfigError(issues, source)
    anyway = _unwritten(document)
    own = _changed(document, anyway)
    issues = vocabulary.derive(layered, _changed(written, anyway), own)
    if issues:
        raise ConfigError(issues, source)
    spec = Spec.from_dict(layered, source=source)
    issues = rules.check(spec, explicit=own)
    if issues:
        raise ConfigError(issues, source)
    return layered, spec


def written_settings(document: Mapping[str, Any]) -> dict[str, Any]:
    """What a valid document sets: its keys whose values differ from what the config holds without them."""
    document = vocabulary.normalize(_unbool_off(document))
    return _changed(document, _unwritten(document))


def _unwritten(document: Mapping[str, Any]) -> dict[str, Any]:
    """What each key holds when the user does not write it: defaults < preset, and the DeepSpeed keys that the
    document's `parallel` section decides (fp8dist.config.vocabulary). `document` is valid."""
    preset = (document.get("precision") or {}).get("preset")
    anyway = schema.defaults()
    if preset:
        anyway = deep_merge(anyway, schema.presets()[preset]["values"])
    vocabulary_only = {key: document[key] for key in ("engine", "parallel") if key in document}
    decided = deep_merge(anyway, vocabulary_only)
    vocabulary.derive(decided, vocabulary_only)
    anyway["deepspeed"] = decided["deepspeed"]
    return anyway


def _changed(written: Mapping[str, Any], anyway: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `written` that differs from `anyway`. A key written at the value it holds anyway sets nothing:
    it is neither a setting that does nothing on this engine nor a conflict with `parallel`. So the resolved config
    that `validate` prints, which holds every key, reads back the same."""
    out = {}
    for key, value in written.items():
        base = anyway.get(key, _ABSENT)
        if isinstance(value, Mapping) and isinstance(base, Mapping):
            inner = _changed(value, base)
            if inner:
                out[key] = inner
        elif type(value) is not type(base) or value != base:
            out[key] = value
    return out


def load_config(config: str | Path | Mapping[str, Any] | Any = None,
                overrides: Sequence[str] = ()) -> Spec:
    """Load a config from a YAML path, a dict or an omegaconf object (None: all defaults).

    Version-dependent rules (DeepSpeed windows for MS-AMP, installed torchao) are checked where
    a version is known: by the translators and the runtimes, not here.
    """
    document: Any  # what the user wrote, read into plain data; not a mapping where the file's top level is not one
    if config is None:
        source, document = "<defaults>", {}
    elif isinstance(config, (str, Path)):
        source = str(config)
        document = reading.read_file(config)
        if not isinstance(document, Mapping):
            document = resolve(document, source)  # raises the top-level error
    elif isinstance(config, Mapping):
        source, document = "<dict>", dict(config)
        reading.check_plain(document, source)
    else:
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(config, DictConfig):
            raise ConfigError([Issue("", f"cannot load a config from {type(config).__name__}",
                                     fix="pass a YAML path, a dict or an omegaconf DictConfig")])
        source, document = "<omegaconf>", OmegaConf.to_container(config, resolve=False)
        reading.check_plain(document, source)
    try:
        document, spec = _resolved(document, overrides, source)
    except ConfigError as exc:
        if overrides and not exc.overrides and _valid_alone(document, source):
            raise ConfigError(exc.issues, source, overrides=_overrides_of(exc.issues, overrides)) from None
        raise
    return dataclasses.replace(spec, notes=tuple(rules.notes(spec, written_settings(document))))


def _resolved(document: Any, overrides: Sequence[str], source: str) -> tuple[Any, Spec]:
    """(the document with the overrides and interpolations applied, the spec of the resolved config)."""
    if overrides or any("${" in text for _, text in reading.strings(document)):
        document = apply_overrides(document, overrides, source)
    return document, _checked(document, source)[1]


def _valid_alone(document: Any, source: str) -> bool:
    """Whether the config without its overrides is valid: then what is wrong came from the overrides."""
    try:
        _resolved(document, (), source)
    except ConfigError:
        return False
    return True


def _overrides_of(issues: Sequence[Issue], overrides: Sequence[str]) -> list[str]:
    """The overrides that set a key some issue names (or a section holding it); all of them when none does (a
    cross-field rule names another key than the one overridden)."""
    def touches(override: str) -> bool:
        key = override.partition("=")[0].strip()
        return any(issue.path == key or issue.path.startswith(key + ".") or key.startswith(issue.path + ".")
                   for issue in issues if issue.path)

    return [override for override in overrides if touches(override)] or list(overrides)
