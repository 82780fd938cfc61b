"""Low-bit tensors read by what they hold, whatever their appearance dtype: torchao's low-bit optimizer states
(real OptimState8bit / OptimState4bit / OptimStateFp8, plain and wrapped in a DTensor as FSDP2 steps them) and
bitsandbytes' 4-bit weights (real Params4bit, quantized on the CPU)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit
from torchao.optim.subclass_fp8 import OptimStateFp8

from fp8dist.backends.storage import BlockLayout, storage

SHAPE = (64, 128)  # 8192 values


def _held(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("make, fmt, codes, per_code, block", [
    (lambda: OptimState8bit.zeros(SHAPE, signed=True, block_size=256, device="cpu"), "int8", "uint8", 1, 256),
    (lambda: OptimState4bit.zeros(SHAPE, signed=False, block_size=128, device="cpu"), "int4", "uint8", 2, 128),
    (lambda: OptimStateFp8.zeros(SHAPE, block_size=256, device="cpu"), "fp8_e4m3", "fp8_e4m3", 1, 256),
])
def test_torchao_optimizer_states_are_read_by_their_codes_not_their_appearance_dtype(make, fmt, codes, per_code,
                                                                                     block):
    state = make()
    assert state.dtype == torch.float32  # what the rest of PyTorch sees
    held = storage(state)
    assert (held.format, held.numel) == (fmt, 8192)
    # codes, one fp32 scale per block, and the code table the 8/4-bit states keep per tensor
    assert held.nbytes == _held(state.codes, state.scale, *([state.qmap] if hasattr(state, "qmap") else []))
    assert held.nbytes < 8192 * 4 / 2
    assert held.layout == BlockLayout(fmt, codes, per_code, block, "fp32")


def test_a_layout_says_codes_block_and_scale_in_words():
    assert storage(OptimState8bit.zeros(SHAPE, block_size=256, device="cpu")).layout.describe() == \
        "int8 codes (uint8), block 256, fp32 scale per block"
    assert storage(OptimState4bit.zeros(SHAPE, block_size=128, device="cpu")).layout.describe() == \
        "int4 codes (uint8, 2 per element), block 128, fp32 scale per block"
    assert storage(OptimStateFp8.zeros(SHAPE, block_size=256, device="cpu")).layout.describe() == \
        "fp8_e4m3 codes, block 256, fp32 scale per block"


def test_a_bf16_appearance_changes_nothing():
    state = OptimState8bit.zeros(SHAPE, block_size=256, device="cpu", dtype=torch.bfloat16)
    assert state.dtype == torch.bfloat16 and storage(state) == storage(OptimState8bit.zeros(SHAPE, device="cpu"))


@pytest.fixture
def fake_mesh():
    """Rank 0 of 2 (torch's fake process group: one process, collectives return at once)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    dist.destroy_process_group()


def test_an_fsdp2_state_is_the_dtensor_over_the_local_codes(fake_mesh):
    # as torchao 0.18 optim/adam.py _AdamBase._new_buffer wraps a sharded parameter's state
    local = OptimState8bit.zeros(SHAPE, block_size=256, device="cpu")
    state = DTensor.from_local(local, fake_mesh, [Shard(0)], run_check=False, shape=(128, 128),
                               stride=(128, 1))
    held = storage(state)
    assert (held.format, held.numel, held.nbytes) == ("int8", 8192, storage(local).nbytes)  # this rank's shard
    assert held.layout == BlockLayout("int8", "uint8", 1, 256, "fp32")


# ---- bitsandbytes ----

OUT, IN = 256, 512  # 131072 values: 2048 blocks of 64


def _linear4bit(**options):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(IN, OUT, bias=False, compute_dtype=torch.bfloat16, **options)
    before = layer.weight
    assert not before.bnb_quantized and storage(before).format == "fp32"  # not quantized yet: what it holds
    return layer.to("cpu")  # bitsandbytes 0.50 quantizes on the first move to a device, the CPU included


@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16])
def test_a_bnb_4bit_weight_is_nf4_at_its_logical_size_whatever_its_storage_dtype(quant_storage):
    weight = _linear4bit(quant_type="nf4", quant_storage=quant_storage, compress_statistics=False).weight
    assert weight.dtype == quant_storage and weight.numel() != OUT * IN  # the packed codes, reshaped
    held = storage(weight)
    assert (held.format, held.numel) == ("nf4", OUT * IN)
    state = weight.quant_state
    # packed codes (half a byte per value) + one fp32 absmax per 64 + the 16-entry fp32 table
    assert held.nbytes == OUT * IN // 2 + OUT * IN // 64 * 4 + 16 * 4 == _held(weight, state.absmax, state.code)
    assert 0.5 < held.nbytes / held.numel < 0.6


def test_bf16_storage_holds_the_same_codes_as_uint8():
    in_uint8 = _linear4bit(quant_type="nf4", quant_storage=torch.uint8, compress_statistics=False).weight
    in_bf16 = _linear4bit(quant_type="nf4", quant_storage=torch.bfloat16, compress_statistics=False).weight
    assert torch.equal(in_bf16.data.view(torch.uint8).flatten(), in_uint8.data.flatten())
    assert storage(in_bf16) == storage(in_uint8)


def test_double_quantized_absmax_counts_its_nested_state():
    weight = _linear4bit(quant_type="nf4", compress_statistics=True).weight
    state = weight.quant_state
    assert state.nested and state.absmax.dtype == torch.uint8
    held = storage(weight)
    nested = state.state2  # an fp32 absmax per 256 absmax, and the 256-entry dynamic table
    assert held.nbytes == _held(weight, state.absmax, state.code, state.offset, nested.absmax, nested.code)
    assert held.format == "nf4" and 0.5 < held.nbytes / held.numel < 0.53  # below the 0.5625 of fp32 absmax


def test_bnb_fp4_is_named_by_its_quant_type():
    held = storage(_linear4bit(quant_type="fp4", compress_statistics=False).weight)
    assert (held.format, held.numel) == ("fp4", OUT * IN) and 0.5 < held.nbytes / held.numel < 0.6
