"""MODEL as users write it (a Hub id transformers can resolve, a misspelt built-in name), and the up-front run
checks: every refusal at once, each fix applicable whichever command named the model."""
import os
import subprocess
import sys

import pytest

from fp8dist.commands.audit import check_before_launch
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError, Problems
from fp8dist.runtime.loading import check_efficient_loading
from fp8dist.config.models import BUILTIN, check_model_name
from tests.conftest import ROOT, run_cli


def test_a_misspelt_built_in_name_gets_a_did_you_mean():
    with pytest.raises(Fp8distError, match="unknown MODEL 'tiny-lama': did you mean tiny-llama?"):
        check_model_name("tiny-lama")
    with pytest.raises(Fp8distError, match="not a Hugging Face Hub id .org/name.") as caught:
        check_model_name("nope")
    assert all(name in str(caught.value) for name in BUILTIN)


def test_the_ram_efficient_loading_refusal_names_no_flag_the_command_lacks():
    """`fp8dist audit` takes the model as a positional: the fix must not say `--model DIR`."""
    spec = load_config({"parallel": {"cpu_ram_efficient_loading": True}})
    with pytest.raises(Fp8distError) as caught:
        check_efficient_loading("tiny-llama", spec)
    assert "--model" not in str(caught.value) and "name DIR as the model where you named 'tiny-llama'" in str(caught.value)


def test_ram_efficient_loading_refuses_a_moe_directory_before_launch(tmp_path):
    """transformers 5 saves 3-D experts as one tensor per expert, which shard-on-read cannot read: said before any
    rank starts, for MoE directories only."""
    import json

    spec = load_config({"parallel": {"cpu_ram_efficient_loading": True}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    with pytest.raises(Fp8distError, match=r"(?s)Mixture-of-Experts model \(8 experts\).*cpu_ram_efficient_loading=false"):
        check_efficient_loading(str(tmp_path), spec)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    check_efficient_loading(str(tmp_path), spec)


def test_the_audit_checks_report_every_problem_at_once():
    spec = load_config({"parallel": {"sharding": "hybrid", "shard_size": 3, "cpu_ram_efficient_loading": True}})
    with pytest.raises(Problems) as caught:
        check_before_launch(spec, "tiny-llama", nproc=2)
    assert len(caught.value.errors) == 2, str(caught.value)
    assert "MODEL 'tiny-llama' is built in memory" in str(caught.value)
    assert "parallel.shard_size=3 does not divide the 2 ranks" in str(caught.value)


RESOLVE = """
import sys
from fp8dist.errors import Fp8distError
from fp8dist.runtime.models import load_model
from fp8dist.config.models import check_model_name
loaded = load_model("acme/tiny-llama", "bf16")
print("loaded", type(loaded.model).__name__, next(loaded.model.parameters()).dtype)
try:
    check_model_name("acme/not-in-the-cache")
except Fp8distError as exc:
    print("refused", exc)
"""


def test_a_hub_id_in_the_cache_loads_and_one_that_is_not_is_refused_with_transformers_reason(tmp_path):
    """A Hub id resolves as transformers resolves it: from the Hub cache (offline here), weights included; an id
    the cache lacks is refused with transformers' own reason."""
    from transformers import AutoModelForCausalLM

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--acme--tiny-llama"  # huggingface_hub's cache layout
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    AutoModelForCausalLM.from_config(BUILTIN["tiny-llama"]()).save_pretrained(repo / "snapshots" / revision)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", RESOLVE], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded LlamaForCausalLM torch.bfloat16" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "refused unknown MODEL 'acme/not-in-the-cache'" in result.stdout, result.stdout
    assert "couldn't find them in the cached files" in result.stdout, result.stdout


@pytest.mark.parametrize("command", ["audit", "compare"])
def test_every_built_in_model_is_in_the_help(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert all(name in text for name in BUILTIN), text
    assert "Hub id" in text


def test_a_factory_module_is_found_from_the_directory_a_launch_starts_in(tmp_path):
    """The README's `--model tests.tp_models:unseen_qwen2_qlora` from the repository root, without PYTHONPATH: a
    script's ranks have its folder on the path (launch/), not the directory they started in, and found the module
    only with PYTHONPATH=. (one error per rank). A module that is nowhere is refused once, before any rank, with the
    fix (issue 46, item 5)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = [sys.executable, str(ROOT / "launch" / "train.py"), "--check", "--fp8dist-config",
             str(ROOT / "configs" / "fsdp2-qlora.yaml"), "--model"]
    done = subprocess.run([*check, "tests.tp_models:unseen_qwen2_qlora"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([*check, "tests.tp_models:unseen_qwen2_qlora"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 2 and done.stderr.count("cannot import MODEL factory") == 1, done.stderr[-2000:]
    assert f"in the current directory ({tmp_path})" in done.stderr and "fix: run from the directory that holds tests/"\
        in done.stderr and "Traceback" not in done.stderr
