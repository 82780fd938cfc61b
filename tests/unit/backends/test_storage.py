"""The audit reads what Transformer Engine and MS-AMP tensors really store, and sees the GEMMs those
libraries run outside aten. Neither library imports here, so the objects below carry exactly the
attributes the probes read (TE 2.20 tensor/storage/*.py: uint8 buffers + `_fp8_dtype`, a tex.DType;
MS-AMP v0.4.0 ScalingTensor: `.value` + `.meta.qtype`, a QType), and the GEMM entry points sit at the
module paths the real libraries use; the assertions are about fp8dist's probes."""
import enum
import sys
import types
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

import fp8dist.audit.probes as probes
from fp8dist.audit.expected import expected, normalize
from fp8dist.backends.storage import enum_short, is_tensor_like, storage
from fp8dist.config.load import load_config


class DType(enum.Enum):  # str() and .name as pybind11 prints transformer_engine_torch.DType
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


class Float8TensorStorage:
    def __init__(self, rows, cols, fp8_dtype, with_transpose=False):
        self._data = torch.zeros(rows, cols, dtype=torch.uint8)
        self._transpose = torch.zeros(cols, rows, dtype=torch.uint8) if with_transpose else None
        self._fp8_dtype = fp8_dtype


@dataclass
class QType:  # msamp/common/dtype/dtypes.py
    name: str
    value: int


class ScalingTensor:  # not a torch.Tensor, as in MS-AMP
    def __init__(self, value, qtype_name):
        self.value = value
        self.meta = types.SimpleNamespace(qtype=QType(qtype_name, 0))

    @property
    def qtype(self):
        return self.meta.qtype

    def numel(self):
        return self.value.numel()


def test_enum_names_map_to_table_names():
    assert enum_short(DType.kFloat8E4M3) == "fp8_e4m3" and enum_short("DType.kFloat8E5M2") == "fp8_e5m2"
    assert enum_short(QType("kFloat16", 3)) == "fp16" and enum_short(DType.kFloat4E2M1) == "fp4_e2m1"


def test_te_quantized_storage_is_read_by_its_format_not_uint8():
    plain = storage(Float8TensorStorage(4, 8, DType.kFloat8E4M3))
    assert (plain.format, plain.numel, plain.nbytes) == ("fp8_e4m3", 32, 32)
    cached = storage(Float8TensorStorage(4, 8, DType.kFloat8E5M2, with_transpose=True))
    assert (cached.format, cached.nbytes) == ("fp8_e5m2", 64)  # the transpose cache is memory too
    assert is_tensor_like(Float8TensorStorage(1, 1, DType.kFloat8E4M3)) and not is_tensor_like(object())


class NVFP4TensorStorage:  # TE 2.8+: two E2M1 values per uint8 byte, [M, K] stored as [M, K/2]
    def __init__(self, rows, cols, columnwise=False):
        self._rowwise_data = torch.zeros(rows, cols // 2, dtype=torch.uint8)
        self._columnwise_data = torch.zeros(cols, rows // 2, dtype=torch.uint8) if columnwise else None
        self._fp4_dtype = DType.kFloat4E2M1


def test_nvfp4_storage_counts_two_values_per_byte():
    packed = storage(NVFP4TensorStorage(64, 128))
    assert (packed.format, packed.numel, packed.nbytes) == ("fp4_e2m1", 64 * 128, 64 * 128 // 2)
    both = storage(NVFP4TensorStorage(64, 128, columnwise=True))  # the columnwise copy is memory, not values
    assert (both.numel, both.nbytes) == (64 * 128, 64 * 128)
    assert storage(Float8TensorStorage(64, 128, DType.kFloat8E4M3)).numel == 64 * 128  # one value per byte


def test_msamp_scaling_tensors_and_o2_optimizer_states():
    fp8 = ScalingTensor(torch.zeros(16, 16, dtype=torch.uint8), "kFloat8E4M3")
    fp16 = ScalingTensor(torch.zeros(16, 16, dtype=torch.float16), "kFloat16")
    assert (storage(fp8).format, storage(fp8).nbytes) == ("fp8_e4m3", 256)
    assert probes.summarize([fp8, fp16]) == ("fp16+fp8_e4m3", {"fp8_e4m3": 256, "fp16": 256})
    optimizer = types.SimpleNamespace(state={0: {"step": 3, "exp_avg": fp8, "exp_avg_sq": fp16}})
    observed, _ = probes.optimizer_states(optimizer)
    assert observed == "fp8_e4m3+fp16" and normalize(observed) == "fp8+fp16"  # table A, MS-AMP O2
    # 3 bytes per parameter instead of Adam's 8: MS-AMP's "up to 62.5%" less optimizer memory.
    assert probes.nbytes(probes.state_tensors(optimizer)) / 256 == 3


@pytest.fixture
def library_modules(monkeypatch):
    """TE 2.x, TE 1.x and MS-AMP GEMM entry points at their real module paths."""
    te2 = types.ModuleType("transformer_engine.pytorch.module.linear")
    te2.general_gemm = lambda A, B, *args, **kwargs: "te2-out"
    te1 = types.ModuleType("transformer_engine.pytorch.module.layernorm_linear")
    te1.fp8_gemm = lambda *args, **kwargs: "te1-out"
    gemm_module = types.ModuleType("msamp.operators.gemm.gemm")

    class Gemm:
        @classmethod
        def fp8_gemm(cls, mat_a, mat_b, out_qtype, bias=None, use_split_accumulator=False):
            return ("msamp-out", cls.__name__)

    gemm_module.Gemm = Gemm
    device_module = types.ModuleType("msamp.common.utils.device")
    device_module.Device = types.SimpleNamespace(is_fp8_supported=lambda: False)
    for module in (te2, te1, gemm_module, device_module):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return te2, te1, Gemm


def test_library_gemms_are_recorded_and_the_libraries_restored(library_modules):
    te2, te1, Gemm = library_modules
    originals = (te2.general_gemm, te1.fp8_gemm, Gemm.__dict__["fp8_gemm"])

    def te_linear_forward(weight, inp):  # TE's modules look general_gemm up in their module at call time
        return te2.general_gemm(weight, inp, layout="TN")

    e4m3, e5m2 = Float8TensorStorage(16, 16, DType.kFloat8E4M3), Float8TensorStorage(16, 16, DType.kFloat8E5M2)
    recorder = probes.MatmulRecorder()
    with recorder:
        assert te_linear_forward(e4m3, e4m3) == "te2-out"
        te2.general_gemm(e4m3, e5m2, layout="NN")
        te2.general_gemm(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16))
        te1.fp8_gemm("A", "A_scale_inv", 0, DType.kFloat8E4M3, "B", "B_scale_inv", 0, DType.kFloat8E5M2, None, None)
        scaled = ScalingTensor(torch.zeros(16, 16, dtype=torch.uint8), "kFloat8E4M3")
        assert Gemm.fp8_gemm(scaled, scaled, QType("kFloat16", 3), use_split_accumulator=True) == ("msamp-out", "Gemm")
    fp8, other = recorder.split()
    assert fp8 == Counter({("te.general_gemm", ("fp8_e4m3", "fp8_e4m3")): 1,
                           ("te.general_gemm", ("fp8_e4m3", "fp8_e5m2")): 1,
                           ("te.fp8_gemm", ("fp8_e4m3", "fp8_e5m2")): 1,
                           ("msamp.fp8_gemm", ("fp8_e4m3", "fp8_e4m3")): 1})
    assert other == Counter({("te.general_gemm", ("bf16", "bf16")): 1})
    assert probes.low_precision_format(fp8) == "fp8"
    assert probes.describe_fp8(fp8) == "e4m3xe4m3: 2, e4m3xe5m2: 2"
    assert len(recorder.notes) == 2 and "emulated in 16-bit" in recorder.notes[1]
    assert "counted by calls, not FLOPs" in recorder.notes[0]
    # TE's GEMMs count FLOPs from their operands' shapes (the stand-in storages have none): 2 * 2*2*2
    assert recorder.ledger.flops == {("transformer_engine", "bf16"): 16, ("transformer_engine", "fp8_e4m3"): 0}
    assert (te2.general_gemm, te1.fp8_gemm, Gemm.__dict__["fp8_gemm"]) == originals


def test_te_gemm_flops_follow_the_layout():
    from fp8dist.audit.library_gemms import te_gemm_flops

    weight, inp, grad = torch.empty(32, 16), torch.empty(8, 16), torch.empty(8, 32)  # N=32, K=16, M=8
    flops = 2 * 8 * 32 * 16
    assert te_gemm_flops(weight, inp, "TN") == flops  # forward
    assert te_gemm_flops(weight, grad, "NN") == flops  # input gradient
    assert te_gemm_flops(inp, grad, "NT") == flops  # weight gradient


def test_recorder_touches_nothing_when_no_library_is_loaded():
    before = {name for name in sys.modules if name.startswith(("transformer_engine", "msamp"))}
    recorder = probes.MatmulRecorder()
    with recorder:
        torch.ones(2, 2) @ torch.ones(2, 2)
    assert recorder.calls == Counter({("mm", ("fp32", "fp32")): 1}) and recorder.notes == []
    assert {name for name in sys.modules if name.startswith(("transformer_engine", "msamp"))} == before


def test_nvfp4_recipe_expects_fp4_gemms():
    spec = load_config({"precision": {"preset": "te", "fp8": {"te": {"recipe": "nvfp4"}}}})
    assert expected(spec)["gemm"][0] == "fp4"
    assert expected(load_config({"precision": {"preset": "te"}}))["gemm"][0] == "fp8"
