"""The expected rows derived from a spec reproduce the documented tables (schemas/dtype_tables.json)."""
import pytest

from fp8dist.audit.expected import expected, implied_bytes_per_param, normalize, tables
from fp8dist.config.load import load_config

ROWS = [(name, row) for name, table in tables().items() for row in table["rows"]]


@pytest.mark.parametrize("table,row", ROWS, ids=[f"{t}:{r['name']}" for t, r in ROWS])
def test_derivation_reproduces_documented_row(table, row):
    spec = load_config({"engine": row["engine"], "precision": {"preset": row["preset"]}})
    derived = {phase: value for phase, (value, _) in expected(spec, nproc=2).items()}
    for column, cell in row["cells"].items():
        if column == "mixed_precision":
            assert spec.precision.mixed_precision == cell
            continue
        assert normalize(derived[column]) == normalize(cell), (column, derived[column], cell)


def test_normalize():
    assert normalize("fp32+fp32") == "fp32" and normalize("FP8+FP16") == "fp8+fp16"
    assert normalize("fp8_e4m3") == "fp8" and normalize("bf16") == "bf16"


def test_single_rank_has_no_communication_phase():
    spec = load_config({"precision": {"preset": "bf16"}})
    assert "communication" not in expected(spec, nproc=1) and "communication" in expected(spec, nproc=2)


@pytest.mark.parametrize("values,total,optimizer", [
    ({"precision": {"preset": "fp32"}}, 16, 8),                           # fp32 Adam: 4 + 4 + 8
    ({"precision": {"preset": "bf16"}, "engine": "deepspeed"}, 16, 8),    # ZeRO paper: 2 + 4 + 2 + 8 (2+2+12)
    ({"precision": {"preset": "bf16"}}, 16, 8),                           # FSDP2: the fp32 shards are the master
    ({"precision": {"preset": "bf16-pure"}}, 8, 4),
    ({"precision": {"preset": "msamp-o2"}}, 6, 3),                        # fp8 + fp16 moments
    ({"precision": {"preset": "msamp-o3"}}, 7, 3),                        # fp8 weights, fp16 master
    ({"precision": {"preset": "fp32"}, "optimizer": {"name": "sgd"}}, 8, 0),
])
def test_bytes_per_parameter_the_tables_imply(values, total, optimizer):
    implied = implied_bytes_per_param(load_config(values))
    assert sum(implied.values()) == total and implied["optimizer"] == optimizer, implied
