"""The benchmark harness (benchmarks/run.py, _common.py): it reads every script's result lines (the one protocol of
fp8dist.runtime.ranks) and judges them against their goals. The measurements themselves are not tests
(benchmarks/README.md)."""
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import parse_results  # noqa: E402


def test_result_lines_are_collected_and_judged():
    import contextlib
    import io

    from _common import result

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("noise before")
        result("overhead_fsdp2_bf16", 1.0132, "<=1.02", "median step time fp8dist / by hand")
        result("allgather", 0.5009, "<=0.5")
        result("cli", 0.3, "<=0.25", "slow start")
        result("bytes_per_param_fp32", 1.005, "=1", "measured 16.08 / implied 16")
        result("bytes_per_param_bf16", 0.98, "=1")
        result("gap", 0.0041, ">=0.01")
        result("noise", 0.9977, "info", "A/A")
        print("result not_a_result=1 goal=<=2")
    text = out.getvalue()
    got = {r.name: (r.value, r.verdict(), r.label) for r in parse_results(text)}
    assert got == {
        "overhead_fsdp2_bf16": (1.0132, "meets", "median step time fp8dist / by hand"),
        "allgather": (0.5009, "MISSES", ""),
        "cli": (0.3, "MISSES", "slow start"),
        "bytes_per_param_fp32": (1.005, "meets", "measured 16.08 / implied 16"),  # within 1%
        "bytes_per_param_bf16": (0.98, "MISSES", ""),
        "gap": (0.0041, "MISSES", ""),
        "noise": (0.9977, "info", "A/A"),
    }

