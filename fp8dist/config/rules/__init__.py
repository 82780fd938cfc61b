"""Cross-field rules the schema cannot express. Pure: a resolved, typed spec in (with what the user wrote), every
issue out.

The rules for every engine and backend are in `common`; those of one engine or one backend in its own module, found
here by name (ENGINE_RULES, BACKEND_RULES) and nowhere else: a rule module does not ask which engine it runs on
(what the config layer must know of an engine is fp8dist.config.engines TRAITS). Rules that depend on an installed or
targeted version live with the translators and runtimes.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from fp8dist.config.rules import common, deepspeed, fsdp2, msamp, policy, te, torchao
from fp8dist.config.schema import schema
from fp8dist.config.spec import Spec
from fp8dist.errors import Issue

Rule = Callable[[Spec, Mapping[str, Any]], list[Issue]]
ENGINE_RULES: dict[str, Rule] = {"fsdp2": fsdp2.check, "deepspeed": deepspeed.check}
# precision.fp8 blocks (common.blocks_in_use: `te` also runs under MS-AMP with use_te)
BACKEND_RULES: dict[str, Rule] = {"torchao": torchao.check, "te": te.check, "msamp": msamp.check}


def check(spec: Spec, explicit: Mapping[str, Any] | None = None) -> list[Issue]:
    """Every issue of `spec`; `explicit`: what the user wrote (the rules that refuse a written setting read it)."""
    written = explicit or {}
    issues = common.check(spec, written) + policy.check(spec, written)  # policy: per-Linear recipes, schedule
    for block in common.blocks_in_use(spec.fp8):
        issues += BACKEND_RULES[block](spec, written)
    return issues + ENGINE_RULES[spec.engine](spec, written)


# What says the same on the selected engine as a key of another engine's own section: {(section, selected engine):
# {key: value -> equivalent or None}} (fp8dist.config.vocabulary). An engine with no entry just gets the key named.
_OTHER_ENGINE_EQUIVALENTS: dict[tuple[str, str], dict[str, Callable[[Any], str | None]]] = {
    ("deepspeed", "fsdp2"): {
        "zero_stage": lambda v: {0: "parallel.sharding: replicate", 2: "parallel.sharding: grad_op",
                                 3: "parallel.sharding: full"}.get(v, "none (ZeRO-1 has no FSDP2 equivalent)"),
        "offload_optimizer": lambda v: "parallel.offload: params (FSDP2 offloads parameters and the optimizer step "
                                       "together)" if v != "none" else None,
        "offload_param": lambda v: "parallel.offload: params" if v != "none" else None},
}


def notes(spec: Spec, explicit: Mapping[str, Any]) -> list[str]:
    """What the user wrote that does nothing on the selected engine: another engine's own section (one line per
    key, with what says the same on this engine where something does). Not errors: a config may keep both engines'
    settings to switch `engine` alone; `--strict` refuses them."""
    engine, out = spec.engine, []
    for other in schema()["properties"]["engine"]["enum"]:
        written = explicit.get(other) if other != engine else None
        equivalents = _OTHER_ENGINE_EQUIVALENTS.get((other, engine), {})
        for key, value in (written.items() if isinstance(written, Mapping) else ()):
            if key == "extra" and not value:
                continue
            equivalent = equivalents[key](value) if key in equivalents else None
            out.append(f"{other}.{key}={value!r} does nothing with engine {engine} (a {other} key)"
                       + (f"; on {engine} it is {equivalent}" if equivalent else ""))
    return out
