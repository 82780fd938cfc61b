"""Every kind of bad config: exit 2, a message naming the problem and a fix, no traceback, quickly."""
import time

import pytest

from tests.conftest import run_cli

BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] +
                 [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
                  f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(9)])

CASES = {
    "empty": (b"", "empty file"),
    "comments_only": (b"# nothing\n", "empty file"),
    "top_list": (b"- a\n- b\n", "top level must be a mapping, not a list"),
    "top_scalar": (b"42\n", "top level must be a mapping"),
    "binary": (bytes(range(256)) * 4, "binary file"),
    "not_utf8": (b"engine: \xff\xfe\n", "not UTF-8"),
    "python_tag": (b"engine: !!python/object/apply:os.system ['touch PWNED']\n", "is not allowed"),
    "custom_tag": (b"engine: !foo bar\n", "is not allowed"),
    "alias_bomb": (BOMB.encode(), "aliases expand to more than"),
    "deep_nesting": (("a:\n" + "".join("  " * i + "  b:\n" for i in range(1, 200)) + "  " * 200 + "  c: 1\n").encode(),
                     "nesting deeper than"),
    "deep_flow": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nesting deeper than"),
    "huge": (b"# " + b"x" * (3 << 20) + b"\n", "larger than"),
    "duplicate_keys": (b"engine: fsdp2\nengine: deepspeed\n", "duplicate key 'engine'"),
    "bad_yaml": (b"engine: [fsdp2\n", "not valid YAML"),
    "self_interpolation": (b"precision:\n  load_dtype: ${precision.load_dtype}\n", "cannot resolve"),
    "missing_interpolation": (b"precision:\n  load_dtype: ${nowhere.at_all}\n", "cannot resolve"),
    "wrong_type": (b"train:\n  steps: many\n", "train.steps: wrong type, expected integer"),
    "wrong_enum": (b"precision:\n  load_dtype: fp64\n", "precision.load_dtype: value not allowed"),
    "unknown_top": (b"engin: fsdp2\n", "did you mean `engine`"),
    "unknown_deep": (b"precision:\n  fp8:\n    torchao:\n      recipe: rowwise\n", "precision.fp8.torchao.recipe: unknown key"),
    "bad_preset": (b"precision:\n  preset: bf17\n", "precision.preset: value not allowed"),
    "conflict_allgather_rowwise": (b"precision:\n  preset: torchao-float8-rowwise\n  fp8:\n    torchao:\n"
                                   b"      enable_fsdp_float8_all_gather: true\n", "needs tensorwise scaling"),
    "conflict_msamp_fsdp2": (b"engine: fsdp2\nprecision:\n  fp8:\n    backend: msamp\n", "MS-AMP has no FSDP2 support"),
    "conflict_o3_zero3": (b"precision:\n  preset: msamp-o3\ndeepspeed:\n  zero_stage: 3\n", "O3 needs ZeRO stage 1 or 2"),
    "conflict_master_without_mp": (b"precision:\n  mixed_precision: none\n  master_weights: fp32\n",
                                   "a master copy only exists with mixed precision"),
    "te_removed_field": (b"precision:\n  preset: te\n  fp8:\n    te:\n      interval: 1\n", "removed from Transformer Engine in 2.2"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_config_file(tmp_path, name):
    content, expected = CASES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    start = time.monotonic()
    result = run_cli("validate", path, cwd=tmp_path)
    assert time.monotonic() - start < 30
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "PWNED").exists()


def test_all_errors_are_reported_at_once(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("engin: fsdp2\ntrain:\n  steps: 0\nprecision:\n  load_dtype: fp64\n  bogus: 1\n")
    result = run_cli("validate", path)
    assert result.returncode == 2
    for fragment in ("engin: unknown key", "train.steps", "precision.load_dtype", "precision.bogus: unknown key"):
        assert fragment in result.stderr, result.stderr
    assert "4 problem(s)" in result.stderr


def test_missing_path_and_directory(tmp_path):
    result = run_cli("validate", tmp_path / "nope.yaml")
    assert result.returncode == 2 and "file not found" in result.stderr
    result = run_cli("validate", tmp_path)
    assert result.returncode == 2 and "is a directory" in result.stderr


def test_bad_override(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("engine: fsdp2\n")
    result = run_cli("validate", path, "precision.load_dtype=fp64")
    assert result.returncode == 2 and "precision.load_dtype" in result.stderr and "fp64" in result.stderr
    result = run_cli("validate", path, "deepspeed.zero_stage=3", "precision.preset=msamp-o3")
    assert result.returncode == 2 and "O3 needs ZeRO stage 1 or 2" in result.stderr
