"""The rules of the precision.fp8.te block (backend=te, or backend=msamp with use_te): each key checked against the
recipe's record (fp8dist.facts.transformer_engine), so TE never drops or refuses a value fp8dist passed."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.config.spec import Spec, TESpec
from fp8dist.errors import Issue
from fp8dist.facts.transformer_engine import (TE_FIELDS, TE_INERT_FIELDS, TE_RECIPES, TE_REMOVED_FIELDS,
                                              TE_TOKEN_MULTIPLE, TERecipe, TERejection, te_removed_field_reason)
from fp8dist.facts.versions import fmt


def _te_raises(record: TERecipe, rejection: TERejection) -> str:
    until = f"-{fmt(rejection.until)}" if rejection.until else " and later"
    return (f"{record.cls} raises '{rejection.message}' in Transformer Engine {fmt(rejection.since)}{until} "
            f"({rejection.source})")


def _value(te: TESpec, field: str) -> Any:
    """precision.fp8.te.<field> as the config holds it (a list where the spec keeps a tuple)."""
    value = getattr(te, field)
    return list(value) if isinstance(value, tuple) else value


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    te, issues = spec.fp8.te, []
    record = TE_RECIPES[te.recipe]
    for field in TE_REMOVED_FIELDS:
        value = _value(te, field)
        if value is not None:
            issues.append(Issue(f"precision.fp8.te.{field}", te_removed_field_reason(field), value,
                                f"remove precision.fp8.te.{field}"))
    for field, reason in TE_INERT_FIELDS.items():
        value = _value(te, field)
        if value is not None:
            raises = [_te_raises(record, r) for r in record.rejects if r.field == field and r.value == value]
            issues.append(Issue(f"precision.fp8.te.{field}", "; ".join([reason, *raises]), value,
                                f"remove precision.fp8.te.{field}"))
    for name in TE_FIELDS:
        value = _value(te, name)
        if value is None:
            continue
        entry = record.field(name)
        if entry is None:
            takers = [r.name for r in TE_RECIPES.values() if (taken := r.field(name)) and not taken.ignored]
            issues.append(Issue(f"precision.fp8.te.{name}", f"not a field of recipe '{record.name}' ({record.cls}); "
                                "TE would silently drop it", value,
                                f"remove it, or use recipe {' / '.join(takers)}"))
        elif entry.ignored:
            issues.append(Issue(f"precision.fp8.te.{name}", entry.ignored, value, f"remove precision.fp8.te.{name}"))
    for rejection in record.rejects:
        if rejection.field not in TE_INERT_FIELDS and _value(te, rejection.field) == rejection.value:
            issues.append(Issue(f"precision.fp8.te.{rejection.field}", _te_raises(record, rejection),
                                rejection.value,
                                f"leave precision.fp8.te.{rejection.field} null ({record.cls}'s default)"))
    train = spec.train
    tokens = train.micro_batch_size * train.seq_len
    if tokens % TE_TOKEN_MULTIPLE:
        multiple = TE_TOKEN_MULTIPLE
        issues.append(Issue("train.seq_len", f"Transformer Engine's FP8 GEMMs need the tokens of a micro-batch "
                            f"(train.micro_batch_size * train.seq_len = {tokens}) to be a multiple of {multiple} "
                            "(pytorch/utils.py assert_dim_for_fp8_exec fails the forward otherwise)", train.seq_len,
                            f"set train.seq_len to a multiple of {multiple} "
                            f"(e.g. {-(-train.seq_len // multiple) * multiple})"))
    if spec.fp8.backend == "te" and spec.parallel.tensor_size > 1:
        issues.append(Issue("parallel.tensor_size", "fp8dist swaps in Transformer Engine's own Linear, which DTensor "
                            "tensor parallel does not split (TE splits through its own tp_group / "
                            "sequence_parallel arguments at construction), and TE FP8 + FSDP2 + TP fails in "
                            "Accelerate too (huggingface/accelerate#3827)", spec.parallel.tensor_size,
                            "set parallel.tensor_size=1 (on FSDP2, precision.fp8.backend=torchao keeps FP8 under "
                            "tensor parallel)"))
    return issues
