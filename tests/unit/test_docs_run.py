"""Every code block in README.md and docs/ works as written (issue 35: the README's watch snippet raised
AttributeError when copied). One test per block:

- python: run in a fresh interpreter, after a prelude that makes what the snippet assumes (`model`,
  `optimizer`, `loader`, a Trainer's arguments, the `fp8dist.yaml` / `my.yaml` it names) from a tiny model;
- yaml: a config block validates;
- bash, line by line (comments dropped, continuations joined): the light fp8dist commands (validate,
  translate, import, schema, presets, env, estimate) run for real in a folder that holds the files the line
  names (a user's file is a real file of that kind from tests/data); the exit code is 0, or the one its comment
  states ("exit 2"); the commands that launch ranks (audit, compare, export, torchrun, deepspeed, accelerate)
  are parsed by the parser that would read them, every file they name exists, and `launch/train.py` lines (an
  `fp8dist run` line's included, with the arguments it hands the script) pass its one-process `--check`. Their real runs are in tests/distributed. `pip install` and `pytest` are .ci/run's.
"""
from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CORPUS = ROOT / "tests" / "data" / "corpus"
# A user's own file named in the docs -> a real file of that kind (copied into the folder the line runs in).
USER_FILES = {
    "my.yaml": ROOT / "configs" / "deepspeed-bf16-zero2.yaml",
    "fp8dist.yaml": ROOT / "configs" / "fsdp2-bf16.yaml",
    "accelerate_config.yaml": CORPUS / "accelerate" / "trl__examples_accelerate_configs_fsdp2.yaml",
    "ds_config_zero2.json": CORPUS / "deepspeed" / "accelerate__tests_deepspeed_ds_config_zero2.json",
    "recipes/zephyr-7b-beta/sft/config_full.yaml":
        CORPUS / "trl" / "alignment-handbook__recipes_zephyr-7b-beta_sft_config_full.yaml",
    "my-adapter/adapter_config.json": CORPUS / "peft" / "llama-e__adapter_config.json",
    "axolotl-lora.yaml": CORPUS / "axolotl" / "axolotl__examples_mistral_mps_lora-mps.yml",
}
LIGHT = {"validate", "translate", "import", "schema", "presets", "env", "estimate"}
LAUNCHERS = {"torchrun", "deepspeed", "accelerate"}
SKIPPED = {"pip": "the install line is .ci/run's", "python -m pytest": "the test command is .ci/run's"}


def blocks() -> list[tuple[str, str, str]]:
    """(id, language, body) of every fenced block."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1), match.group(2)))
    return found


def bash_lines(body: str) -> list[tuple[str, str]]:
    """(command, comment) per logical line."""
    lines, pending = [], ""
    for raw in body.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        full = pending + raw
        pending = ""
        command, _, comment = full.partition(" #")
        if command.strip().startswith("#"):
            continue
        if command.strip():
            lines.append((command.strip(), comment))
    return lines


BLOCKS = blocks()
BASH = [(f"{bid} {command[:60]}", command, comment) for bid, lang, body in BLOCKS if lang == "bash"
        for command, comment in bash_lines(body)]


def test_every_block_has_a_runner():
    assert {lang for _, lang, _ in BLOCKS} <= {"bash", "python", "yaml", "text", ""}, BLOCKS


@pytest.fixture
def workdir(tmp_path):
    for name in ("configs", "launch", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name, source in USER_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, tmp_path / name)
    from fp8dist.config.models import tiny_llama_config

    tiny_llama_config().save_pretrained(tmp_path / "my-model")  # "a local HF dir": its config.json
    return tmp_path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def _expected_exit(comment: str) -> int:
    match = re.search(r"\bexit (\d)\b", comment)
    return int(match.group(1)) if match else 0


def _script_and_args(words: list[str]) -> tuple[str, list[str]]:
    """The script a launcher line runs and its arguments (launcher options before it)."""
    index = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[index], words[index + 1:]


def _paths_named(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith(("configs/", "launch/", "examples/")) or a.endswith((".yaml", ".json"))]


@pytest.mark.parametrize("label,command,comment", BASH, ids=[b[0] for b in BASH])
def test_bash_line(label, command, comment, workdir, monkeypatch, capsys):
    for prefix, why in SKIPPED.items():
        if command.startswith(prefix):
            pytest.skip(why)
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words.pop(0)
    if words[0] == "fp8dist" and words[1] in LIGHT:  # in this process (seconds saved per line): fp8dist's own main
        from fp8dist.cli import main

        monkeypatch.chdir(workdir)
        code = main(words[1:])
        out, err = capsys.readouterr()
        assert code == _expected_exit(comment), f"{command}\n{out[-2000:]}\n{err[-3000:]}"
        return
    if words[:2] == ["fp8dist", "run"]:  # `fp8dist run CONFIG [KEY=VALUE] -- SCRIPT ARGS`: checked as it checks
        from fp8dist.commands.run import script_arguments

        split = words.index("--")
        config, overrides = words[2], [w for w in words[3:split] if "=" in w and not w.startswith("-")]
        words = ["torchrun", *words[split + 1:][:1], *script_arguments(config, overrides, words[split + 2:])]
    elif words[0] == "fp8dist":
        from fp8dist.cli import _split_overrides, build_parser

        argv, _ = _split_overrides(words[1:])
        build_parser().parse_args(argv)  # argparse exits 2 on a flag the command does not have
        missing = [p for p in _paths_named(argv) if not (workdir / p).exists() and not p.startswith("my-")]
        assert not missing, f"{command}: no {missing}"
        return
    assert words[0] in LAUNCHERS, f"{label}: no runner for {words[0]!r}"
    script, args = _script_and_args(words)
    if not script.startswith(("launch/", "examples/")):
        pytest.skip(f"{script} stands for the reader's own training script")
    assert (ROOT / script).exists(), f"{command}: no {script}"
    missing = [p for p in _paths_named(args) if not (workdir / p).exists()]
    assert not missing, f"{command}: no {missing}"
    if script == "launch/train.py":  # its one-process check, in this process (what the line launches is tested
        # in tests/distributed): the script's own main, from the folder the line runs in
        monkeypatch.chdir(workdir)
        check = runpy.run_path(str(ROOT / script), run_name="docs_check")["main"]
        code = check(["--check", *args])
        out, err = capsys.readouterr()
        assert code == 0, f"{command}\n{out[-2000:]}\n{err[-3000:]}"
    else:  # the script's own parser takes these arguments
        probe = (f"import sys, runpy; sys.argv = {[script, *args]!r}; "
                 f"module = runpy.run_path({script!r}, run_name='docs_probe'); "
                 "parse = module.get('parse_args'); parse() if parse else None")
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=workdir, env=_env(),
                              timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"


def test_config_blocks_validate(tmp_path):
    from fp8dist.config.load import load_config

    configs = [(bid, body) for bid, lang, body in BLOCKS if lang == "yaml" and body.lstrip().startswith("engine:")]
    assert configs
    for bid, body in configs:
        path = tmp_path / "block.yaml"
        path.write_text(body, encoding="utf-8")
        load_config(str(path))  # raises, naming the key, if the block is not a valid config


# What a python block assumes, made small and real. Keyed by a line each block contains.
PRELUDES = {
    "from fp8dist.audit import watch": """
        import torch
        from fp8dist.runtime.models import load_model
        loaded = load_model("tiny-llama", "fp32")
        model = loaded.model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = [loaded.make_batch(1, 16, seed) for seed in range(2)]
        """,
    "AuditCallback(": """
        import torch
        from transformers import Trainer, TrainingArguments
        from fp8dist.runtime.models import load_model
        loaded = load_model("tiny-llama", "fp32")
        model = loaded.model
        args = TrainingArguments(output_dir="out", max_steps=1, use_cpu=True, report_to=[])
        data = [loaded.make_batch(1, 16, seed) for seed in range(2)]
        """,
    "accelerator_kwargs(": "",
}
PYTHON = [(bid, body) for bid, lang, body in BLOCKS if lang == "python"]
# On a machine without CUDA, what transformers requires besides the snippet: bf16 TrainingArguments need use_cpu
# (transformers 5 training_args.py: "Your setup doesn't support bf16/gpu").
CPU_ONLY = {'TrainingArguments(output_dir="out", ': 'TrainingArguments(output_dir="out", use_cpu=True, '}


# After the README's watch loop: what the test of that block also reads (the report is there after the loop).
AFTER_THE_WATCH_LOOP = "\nprint('report after the loop:', sorted(audit.report))\n"
_python_runs: dict[str, subprocess.CompletedProcess] = {}


def run_python_block(bid: str, body: str, workdir) -> subprocess.CompletedProcess:
    """The block in a fresh interpreter after its prelude, once per session (both tests of the watch block read
    the same run)."""
    if bid not in _python_runs:
        keys = [key for key in PRELUDES if key in body]
        assert len(keys) == 1, f"{bid}: give this block a prelude in PRELUDES (what it assumes, made real)"
        import torch

        if not torch.cuda.is_available():
            for written, on_cpu in CPU_ONLY.items():
                body = body.replace(written, on_cpu)
        after = AFTER_THE_WATCH_LOOP if "from fp8dist.audit import watch" in body else ""
        source = textwrap.dedent(PRELUDES[keys[0]]) + "\n" + body + after
        _python_runs[bid] = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                                           cwd=workdir, env=_env(), timeout=300)
    return _python_runs[bid]


@pytest.mark.parametrize("bid,body", PYTHON, ids=[b[0] for b in PYTHON])
def test_python_block(bid, body, workdir):
    done = run_python_block(bid, body, workdir)
    assert done.returncode == 0, f"{bid}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_watch_snippet_reports_after_the_loop(workdir):
    """The README's loop: the report is there after the loop, whatever the later steps did."""
    bid, body = next((bid, body) for bid, _, body in BLOCKS if "from fp8dist.audit import watch" in body)
    done = run_python_block(bid, body, workdir)
    assert done.returncode == 0 and "report after the loop: [" in done.stdout and "'checks'" in done.stdout, \
        done.stderr[-3000:]
