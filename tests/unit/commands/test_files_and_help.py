"""Files as users expect them (the umask's mode, not a temporary file's 0600) and one override convention, said in
every --help."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fp8dist.cli import TAKES_OVERRIDES
from tests.conftest import ROOT


def run_with_umask(mask, *argv):
    return subprocess.run([*map(str, argv)], capture_output=True, text=True, cwd=ROOT, timeout=180,
                          preexec_fn=lambda: os.umask(mask))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_o_writes_with_the_umask_mode(tmp_path, mask):
    out = tmp_path / "ds.json"
    result = run_with_umask(mask, sys.executable, "-m", "fp8dist", "translate", "configs/deepspeed-bf16-zero2.yaml",
                            "--to", "deepspeed", "-o", out)
    assert result.returncode == 0, result.stderr
    assert mode(out) == 0o666 & ~mask


def test_an_export_is_published_with_the_umask_modes(tmp_path):
    """safetensors writes its files 0600 and mkdtemp makes the scratch directory 0700: the published export has the
    modes any new file and directory get (here under umask 022: 0644 / 0755)."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    from fp8dist.runtime.export import MARKER, _publish

    previous = os.umask(0o022)
    try:
        scratch = Path(tempfile.mkdtemp(dir=tmp_path))
        save_file({"w": torch.zeros(2)}, str(scratch / "model.safetensors"))
        (scratch / "config.json").write_text("{}\n")
        out = tmp_path / "export"
        _publish(scratch, out, tmp_path, {"step": 1}, "bf16", ["model.safetensors"])
    finally:
        os.umask(previous)
    assert mode(out) == 0o755
    assert {name: mode(out / name) for name in ("model.safetensors", "config.json", MARKER)} == dict.fromkeys(
        ("model.safetensors", "config.json", MARKER), 0o644)


def test_export_of_a_missing_directory_says_it_is_missing(tmp_path):
    result = run_with_umask(0o022, sys.executable, "-m", "fp8dist", "export", tmp_path / "nope", tmp_path / "out")
    assert result.returncode == 2 and f"{tmp_path / 'nope'}: does not exist" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", TAKES_OVERRIDES)
def test_every_command_that_takes_overrides_says_how_in_its_help(command):
    result = subprocess.run([sys.executable, "-m", "fp8dist", command, "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "KEY=VALUE words" in text and "precision.fp8.backend=none" in text, text
    assert "--fp8dist-set KEY=VALUE" in text


def test_the_training_script_says_its_override_form_in_its_help():
    result = subprocess.run([sys.executable, ROOT / "launch" / "train.py", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "--fp8dist-set KEY=VALUE" in text
    assert "--fp8dist-set precision.fp8.backend=none" in text, text
