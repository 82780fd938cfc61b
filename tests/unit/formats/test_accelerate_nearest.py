"""`translate --to accelerate` writes the nearest run Accelerate can express (issue 35 item 9): every key Accelerate
refuses is moved to its nearest value and listed (stderr and the file's header), the file is read by Accelerate
1.15's own loader and launcher into the plugins of that nearest run, and `--strict` refuses instead. Configs with no
near run (FP8 under DeepSpeed, FP8 MoE experts, LoRA under Accelerate's float8 filter, fp16 loss scaling on FSDP2)
stay refused naming those keys."""
import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.accelerate.translate import (NotExpressible, _flat, accelerate_file, nearest_accelerate_file,
                                                 render)
from fp8dist.formats.importing import import_file
from tests.conftest import CONFIGS, ROOT, run_cli
from tests.unit.formats.test_accelerate import (AO_VERSION, DS_VERSION, _check_deepspeed_env, _check_fsdp_env,
                                                _launch_env, clean_env)  # noqa: F401 (clean_env: a fixture)

FLOAT8 = ROOT / "configs" / "fsdp2-torchao-float8.yaml"


def _changed(before, after):
    old, new = _flat(before.to_dict()), _flat(after.to_dict())
    return {key for key in set(old) | set(new) if old.get(key) != new.get(key)}


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_example_is_the_nearest_accelerate_run_with_each_difference_listed_or_refused(config, tmp_path,
                                                                                           clean_env):
    from accelerate.commands.config.config_args import load_config_from_file

    spec = load_config(config)
    try:
        document, plan, nearest, differences = nearest_accelerate_file(spec, DS_VERSION, AO_VERSION)
    except NotExpressible as exc:  # only keys no Accelerate run keeps
        assert exc.issues and all(issue.fix and getattr(issue, "nearest", None) is None for issue in exc.issues), exc
        return
    listed = {line.split(":", 1)[0] for line in differences}
    assert listed == _changed(spec, nearest), differences  # every change said, nothing else changed
    try:
        accelerate_file(spec, DS_VERSION, AO_VERSION)
        assert not differences  # an expressible config is written as it is
    except NotExpressible:  # a move may settle more than its own refusal (DDP: fp32 loading, fp32 reduction)
        assert differences
    path = tmp_path / "accelerate.yaml"
    path.write_text(render(document, plan, nearest, str(config), differences))
    assert load_config_from_file(str(path)).distributed_type.value in ("FSDP", "DEEPSPEED", "MULTI_GPU")
    if plan["ddp"]:
        return
    env = _launch_env(path)
    for key, value in env.items():
        clean_env.setenv(key, value)
    (_check_fsdp_env if nearest.engine == "fsdp2" else _check_deepspeed_env)(nearest, env)


def test_at_least_one_fp8_example_reaches_accelerate_and_what_stays_refused_is_only_what_has_no_near_run():
    reached, refused = [], {}
    for config in CONFIGS:
        spec = load_config(config)
        try:
            nearest_accelerate_file(spec, DS_VERSION, AO_VERSION)
            reached.append(config.stem)
        except NotExpressible as exc:
            refused[config.stem] = {issue.path for issue in exc.issues}
    assert {"fsdp2-torchao-float8", "fsdp2-torchao-rowwise", "fsdp2-float8-efficient", "te"} <= set(reached)
    assert refused["deepspeed-torchao-float8"] == {"precision.fp8.backend"}  # FP8 under a DeepSpeed file
    assert refused["fsdp2-moe-mxfp8"] == {"precision.fp8.torchao.experts"}
    assert refused["fsdp2-lora-float8"] == {"adapter.kind"}
    assert refused["fp16-amp"] == {"precision.loss_scaling"}


def test_the_nearest_float8_run_is_the_documented_expressible_variant_and_imports_back():
    """The five moves of fsdp2-torchao-float8 are those test_accelerate.py's hand-made variant makes, and the file
    imports back to the run it expresses."""
    spec = load_config(FLOAT8)
    document, plan, nearest, differences = nearest_accelerate_file(spec, DS_VERSION, AO_VERSION)
    assert nearest == load_config(FLOAT8, ["precision.load_dtype=fp32", "precision.reduce_dtype=bf16",
                                           "precision.fp8.torchao.emulate=false", "precision.fp8.modules.exclude=[]",
                                           "precision.fp8.modules.skip_first_last=true"])
    assert document["mixed_precision"] == "fp8" and document["fp8_config"]["backend"] == "AO"
    assert [line.split(":", 1)[0] for line in differences] == [
        "precision.reduce_dtype", "precision.fp8.torchao.emulate", "precision.fp8.modules.exclude",
        "precision.fp8.modules.skip_first_last", "precision.load_dtype"]
    assert all("(" in line and "->" in line for line in differences)  # from -> to, and why


def test_cli_writes_the_nearest_file_saying_every_difference_and_strict_refuses(tmp_path):
    out = tmp_path / "acc.yaml"
    before = run_cli("translate", FLOAT8, "--to", "accelerate", "--strict", "-o", out)
    assert before.returncode == 2 and "cannot translate" in before.stderr and "--strict" in before.stderr
    assert list(tmp_path.iterdir()) == []
    after = run_cli("translate", FLOAT8, "--to", "accelerate", "-o", out)
    assert after.returncode == 0, after.stderr
    said = [line for line in after.stderr.splitlines() if ": differs for Accelerate: " in line]
    assert len(said) == 5 and "5 setting(s) differ" in after.stderr
    text = out.read_text()
    assert "# NOT the run of" in text and text.count("# differs: ") == 5
    assert yaml.safe_load(text)["mixed_precision"] == "fp8"
    back = load_config(yaml.safe_load(import_file(out)))
    assert back.precision.load_dtype == "fp32" and back.fp8.backend == "torchao" and back.fp8.torchao.emulate is False
    assert back.fp8.modules.skip_first_last and back.precision.reduce_dtype == "bf16"
    # an expressible config: nothing differs, nothing said
    same = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "accelerate")
    assert same.returncode == 0 and same.stderr == "" and "# NOT the run" not in same.stdout
