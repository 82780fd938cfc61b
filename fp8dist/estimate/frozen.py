"""An adapter run's frozen base by storage format: its parameters, their bytes in one whole copy and a rank's share.
Frozen parameters hold their weights only (no gradient, no optimizer state), in the dtype the audit expects for
them (audit/expected.py `frozen_weights`).

An NF4 base (`adapter.base_dtype: nf4`, QLoRA) holds in NF4 exactly the frozen Linear weights that
fp8dist/backends/nf4.py `nf4_linears` picks for the shard count, on the meta model as on the loaded one (it reads
names, shapes and requires_grad only): every frozen nn.Linear weight but the output layer, MoE routers and the
modules to save (adapter.modules_to_save: both PEFT copies), that
splits by rows into whole NF4 blocks over the ranks FSDP2 shards weights on (dp_shard x cp, the count
engines/fsdp2/engine.py quantizes for), its scales double-quantized per `nf4_scaler_block` of them. Biases, norms,
embeddings, MoE experts and the Linears that do not fit stay in the load dtype (the other part of the audit's
`frozen_weights` cell, e.g. `bf16+nf4`). An NF4 weight's bytes: `nf4_tensor_bytes`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from fp8dist.audit.expected import expected, frozen_bytes_per_param, normalize
from fp8dist.backends.nf4 import nf4_linears, nf4_scaler_block
from fp8dist.config.spec import Spec
from fp8dist.dtypes import FAMILY_BYTES
from fp8dist.errors import Fp8distError
from fp8dist.estimate.model import MetaModel
from fp8dist.estimate.result import FrozenFormat, LeftOut
from fp8dist.facts.torchao import (NF4_BLOCK, NF4_DEQUANTIZE_INDEX_BYTES, NF4_DEQUANTIZE_VALUE_COPIES,
                                   NF4_SCALER_BLOCK)

NF4 = "nf4"  # the format name fp8dist.backends.storage gives an NF4Tensor, and the audit's frozen_weights cell
NF4_TABLE_ENTRIES = 16  # the NF4 code book every NF4Tensor holds (`nf4`: 16 values, in the weight's dtype)


def nf4_tensor_bytes(numel: int, value_bytes: int, shards: int = 1, scaler_block: int = NF4_SCALER_BLOCK) -> int:
    """The bytes one rank holds of an NF4 weight of `numel` values quantized from a dtype of `value_bytes` bytes and
    sharded over `shards` ranks: what torchao's NF4Tensor holds (torchao 0.18
    torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py `NF4Tensor.from_tensor`, `double_quantize_scalers`):
    `quantized_data`, the 4-bit codes two per uint8 (numel / 2 bytes); `quantized_scalers`, one int8 scale per
    NF4_BLOCK values; `quantization_factor`, one per `scaler_block` scales (backends/nf4.py nf4_scaler_block), in the
    weight's dtype (`256 / (2 * scaler_absmax)` of the weight's absmax); `scaler_mean`, a 0-d tensor in the weight's
    dtype; `nf4`, the 16-entry table in the weight's dtype. FSDP2 splits the first three by rows over the shards
    (nf4_tensor.py `nf4_split`: `_INNER_TENSOR_NAMES_FOR_SHARDING`); every shard keeps the mean and the table whole
    (`construct_nf4_args`). Counted as fp8dist.backends.storage reads an NF4Tensor (its buffers). `numel` splits into
    whole scaler blocks over `shards` (backends/nf4.py `nf4_unfit`, `nf4_scaler_block`), so every count is exact."""
    codes = numel // 2
    scalers = numel // NF4_BLOCK
    factors = numel // (NF4_BLOCK * scaler_block) * value_bytes
    return (codes + scalers + factors) // shards + (1 + NF4_TABLE_ENTRIES) * value_bytes


def nf4_dequantize_bytes(numel: int, value_bytes: int) -> int:
    """The bytes an eager GEMM of an NF4 weight of `numel` values (quantized from `value_bytes`-byte values) allocates
    for a moment to dequantize it (fp8dist.facts.torchao NF4_DEQUANTIZE_*). A cast to another compute dtype comes
    after get_original_weight's temporaries are freed, and its two copies (value_bytes + compute bytes, at most 2 + 4)
    stay below them."""
    return numel * (NF4_DEQUANTIZE_INDEX_BYTES + NF4_DEQUANTIZE_VALUE_COPIES * value_bytes)


@dataclass(frozen=True)
class FrozenBase:
    by_format: Mapping[str, FrozenFormat]  # {} when nothing is frozen
    nf4_kept: tuple[LeftOut, ...]  # an NF4 base: the frozen Linears kept in the load dtype, and why
    bytes_per_param: float  # a rank's bytes per frozen element it holds, every format together
    nf4_weights: frozenset[str] = frozenset()  # the parameters held in NF4
    nf4_value_bytes: int = 0  # the bytes of the dtype they were quantized from
    largest_nf4_numel: int = 0  # a rank's elements of the largest NF4 weight, gathered whole to compute

    def dequantize_bytes(self) -> int:
        """The transient of dequantizing the largest NF4 weight for its GEMM (one at a time)."""
        return nf4_dequantize_bytes(self.largest_nf4_numel, self.nf4_value_bytes)

    @property
    def per_rank_bytes(self) -> int:
        return sum(part.per_rank_bytes for part in self.by_format.values())

    def gathered_bytes(self, fqn: str, numel: int, compute_bytes: int) -> int:
        """The bytes of `numel` elements of parameter `fqn` gathered whole: an NF4 weight is all-gathered as NF4 (its
        codes, scales and factors: torchao's NF4Tensor.fsdp_pre_all_gather, nf4_tensor.py), every other parameter in
        the compute dtype (FSDP2's MixedPrecisionPolicy.param_dtype)."""
        if fqn in self.nf4_weights:
            return nf4_tensor_bytes(numel, self.nf4_value_bytes)
        return numel * compute_bytes


def frozen_base(meta: MetaModel, spec: Spec, local: Mapping[str, int], shards: int) -> FrozenBase:
    """The frozen parameters of the adapted meta model by storage format; a rank's share of each divided over the
    `shards` ranks the weights are sharded on (`local`: a tp rank's elements of each parameter)."""
    frozen = [(fqn, param.numel()) for fqn, param in meta.model.named_parameters() if not param.requires_grad]
    if not frozen or not spec.adapter.enabled:  # no adapter: nothing is frozen by the config
        return FrozenBase({}, (), 0.0)
    if spec.adapter.base_dtype != NF4:
        fmt = expected(spec)["frozen_weights"][0]
        part = _plain_format(frozen, local, frozen_bytes_per_param(spec), shards)
        return FrozenBase({fmt: part}, (), part.bytes_per_param)
    chosen, kept = nf4_linears(meta.model, shards)
    if not chosen:
        raise Fp8distError(f"adapter.base_dtype=nf4: no frozen Linear of {type(meta.model).__name__} fits NF4's "
                           f"blocks on {shards} shard(s) ({'; '.join(f'{k}: {v}' for k, v in list(kept.items())[:3])}):"
                           " the run refuses it\n  fix: adapter.base_dtype=auto for this model")
    rest = next(part for part in expected(spec)["frozen_weights"][0].split("+") if part != NF4)
    value_bytes = int(FAMILY_BYTES[normalize(rest)])  # the load dtype: the weights NF4 quantizes, its factors' dtype
    weights = {f"{name}.weight" for name in chosen}
    quantized = [(fqn, numel) for fqn, numel in frozen if fqn in weights]
    params = dict(meta.model.named_parameters())
    scaler_block = {fqn: nf4_scaler_block(params[fqn].shape[0], params[fqn].shape[1], shards) for fqn, _ in quantized}
    # a rank that holds none of a weight (a pipeline rank: another stage's) holds none of its NF4 tensor either
    per_rank = sum(nf4_tensor_bytes(local[fqn], value_bytes, shards, scaler_block[fqn]) for fqn, _ in quantized
                   if local[fqn])
    held = sum(local[fqn] for fqn, _ in quantized) / shards
    by_format = {NF4: FrozenFormat(parameters=sum(numel for _, numel in quantized),
                                   bytes=sum(nf4_tensor_bytes(numel, value_bytes, 1, scaler_block[fqn])
                                             for fqn, numel in quantized),
                                   per_rank_bytes=per_rank, bytes_per_param=round(per_rank / held, 4) if held
                                   else 0.0),
                 rest: _plain_format([(fqn, numel) for fqn, numel in frozen if fqn not in weights], local,
                                     value_bytes, shards)}
    elements = {NF4: held, rest: sum(local[fqn] for fqn, _ in frozen if fqn not in weights) / shards}
    mean = sum(by_format[fmt].bytes_per_param * elements[fmt] for fmt in by_format) / (sum(elements.values()) or 1)
    return FrozenBase({fmt: part for fmt, part in sorted(by_format.items()) if part.parameters}, tuple(
        LeftOut(name, why) for name, why in kept.items()), round(mean, 4), frozenset(weights), value_bytes,
        max(local[fqn] for fqn, _ in quantized))


def _plain_format(params: list[tuple[str, int]], local: Mapping[str, int], bytes_per_param: float,
                  shards: int) -> FrozenFormat:
    """Parameters held as plain tensors of `bytes_per_param` bytes each."""
    numel = sum(n for _, n in params)
    return FrozenFormat(parameters=numel, bytes=math.ceil(numel * bytes_per_param),
                        per_rank_bytes=math.ceil(sum(local[fqn] for fqn, _ in params) * bytes_per_param / shards),
                        bytes_per_param=float(bytes_per_param))
