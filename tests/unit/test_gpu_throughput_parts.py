"""benchmarks/gpu_throughput.py's pure parts (the GPU run itself needs an FP8 GPU and refuses here): kernel names
sorted into the step's parts, the profile summed per step, the predicted parts mapped onto the same parts, the
`measured (predicted)` rows, the layer count that fits, the result names run.py promises."""
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_throughput as g  # noqa: E402


@pytest.mark.parametrize("name, part", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
    ("triton_red_fused__to_copy_abs_amax_clamp_mul_0", "casts"),
    ("void transformer_engine::detail::cast_transpose_kernel<...>", "casts"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64", "fp8_gemms"),
    ("void cutlass::device_kernel<at::cuda::detail::f8f8bf16_rowwise_kernel>", "fp8_gemms"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "bf16_gemms"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", "bf16_gemms"),
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopA_TNT", "other"),  # a GEMM whose name does not say its type
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_per_fused_add_mean_mul_pow_rsqrt_0", "other"),
])
def test_kernel_names_go_to_their_part_or_other(name, part):
    assert g.kernel_part(name) == part


def test_profile_is_summed_per_step_and_the_rest_listed():
    parts, other = g.parts_of([("ncclDevKernel_ReduceScatter", 4000.0), ("flash_fwd_kernel", 2000.0),
                               ("triton_poi_fused_silu_0", 600.0), ("elementwise_kernel", 1000.0)], steps=2)
    assert set(parts) == set(g.PROFILE_PARTS)
    assert parts["communication"] == 2.0 and parts["attention"] == 1.0 and parts["other"] == pytest.approx(0.8)
    assert other == [("elementwise_kernel", 0.5), ("triton_poi_fused_silu_0", 0.3)]


def test_predicted_parts_use_the_step_models_parts():
    from fp8dist.estimate.step import PARTS

    assert {p for parts in g.PREDICTED_PARTS.values() for p in parts} == set(PARTS)
    step = dict.fromkeys(PARTS, 0.001)
    got = g.predicted_parts(step)
    assert got["other"] == pytest.approx(2.0) and got["fp8_gemms"] == pytest.approx(1.0)
    assert sum(got.values()) == pytest.approx(1000 * sum(step.values()))


def test_rows_put_the_prediction_beside_every_figure():
    row = g.throughput_row("float8 rowwise", (9000.0, 60.2, 1.051), (9500.0, 58.0, 1.1), "torchao 8B/8xH100: 1.10")
    assert "9000 (9500)" in row and "60.2 (58.0)" in row and "1.051 (1.100)" in row and row.endswith("1.10")
    assert "9000 (-)" in g.throughput_row("x", (9000.0, 1.0, 1.0), None)
    parts = dict.fromkeys(g.PROFILE_PARTS, 1.0)
    assert g.parts_row("bf16", parts, dict.fromkeys(g.PROFILE_PARTS, 2.0)).count("1.0 (2.0)") == len(g.PROFILE_PARTS)


def test_layers_that_fit():
    gib = 2**30
    assert g.layers_that_fit(20 * gib, 22 * gib, 80 * gib, headroom=0.8) == 23  # 18 + 2 x 23 = 64 <= 64
    assert g.layers_that_fit(20 * gib, 22 * gib, 800 * gib) == g.MOST_LAYERS
    assert g.layers_that_fit(90 * gib, 92 * gib, 80 * gib) == 1


def test_result_names_keep_the_promised_ones_and_match_run_py():
    import fnmatch

    from run import BENCHMARKS

    names = [n for case in g.CASES.values() if case.slug != "bf16" for n in g.result_names(case.slug, 512, True)]
    names += [f"gpu_fp8dist_over_hand_{r}_m512" for r in ("tensorwise", "rowwise")]
    promises = BENCHMARKS["gpu_throughput"].promises
    assert all(fnmatch.filter(names, p) for p in promises), [p for p in promises if not fnmatch.filter(names, p)]
    assert g.result_names("float8_rowwise", 8192, False) == ["gpu_tokens_per_s_float8_rowwise_vs_bf16_m8192"]
    assert {g.HAND_OF[c.slug] for c in g.CASES.values() if c.hand} <= {c.slug for c in g.CASES.values()}
