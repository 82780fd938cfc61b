"""Odd input never crashes, hangs or leaks (issue 26): exit 0 or 2, never a traceback; exit 2 names the file or key
and writes nothing; what exits 0 reads back the same.

One regression test per cause found by a generative run, with its minimal input, then the generative test itself:
structure-aware mutations of every example config and of the Accelerate / Axolotl / DeepSpeed corpus, text-level
YAML edits, raw bytes and odd KEY=VALUE overrides, through validate, translate (all targets) and import, in-process.
A few hundred cases by default (seconds); `FP8DIST_FUZZ_EXAMPLES=5000` runs that many per test, randomly seeded,
and keeps failing examples in .hypothesis/odd_input so that the same command replays them.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fp8dist.cli import main
from fp8dist.config.schema import defaults
from tests.conftest import CONFIGS, ROOT, run_cli

CORPUS = ROOT / "tests" / "data"


@dataclass
class Result:
    code: int
    out: str
    err: str


def cli(*args) -> Result:
    """`fp8dist ARGS` in this process; an exception escaping main is a traceback and fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return Result(code, out.getvalue(), err.getvalue())


def refused(result: Result, *fragments: str) -> None:
    assert result.code == 2, result
    assert "Traceback" not in result.err and result.out == "", result
    for fragment in fragments:
        assert fragment in result.err, result.err


def reads_back(printed: str, fmt: str, folder: Path) -> None:
    """What `validate --format FMT` printed validates again to the same resolved config (printed the same)."""
    back = folder / f"back.{fmt}"
    back.write_text(printed, encoding="utf-8")
    again = cli("validate", back, "--format", fmt)
    assert again.code == 0 and again.out == printed, (printed, again)


def written(tmp_path: Path, name: str, text: str | bytes) -> Path:
    """The file `name` holding `text` (a lone surrogate written as the bytes UTF-8 forbids: odd input too)."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


# -- one test per cause ------------------------------------------------------------------------------------------
def test_numbers_beyond_python_and_json_are_refused_where_the_file_is_read(tmp_path):
    digits = "9" * 5000
    refused(cli("validate", written(tmp_path, "a.yaml", f"train: {{steps: {digits}}}\n")), "line 1", "as int")
    refused(cli("import", written(tmp_path, "ds.json", f'{{"train_batch_size": {digits}}}')), "a number cannot be read")
    refused(cli("translate", written(tmp_path, "b.yaml", f"train: {{gradient_clipping: {'9' * 400}}}\n"), "--to",
                "deepspeed"), "train.gradient_clipping: number out of range", "bits")


def test_nan_and_infinity_never_reach_a_json_file(tmp_path):
    out = tmp_path / "ds.json"
    for value in (".nan", ".inf", "-.inf", "1e999"):
        config = written(tmp_path, "c.yaml", f"train: {{gradient_clipping: {value}}}\n")
        refused(cli("translate", config, "--to", "deepspeed", "-o", out), "not a finite number")
    refused(cli("import", written(tmp_path, "nan.json", '{"gradient_clipping": NaN, "zero_optimization": {}}')),
            "gradient_clipping: not a finite number")
    assert not out.exists()


def test_a_date_is_text_and_an_impossible_one_no_crash(tmp_path):
    refused(cli("validate", written(tmp_path, "a.yaml", "2024-13-45: 1\n")), "2024-13-45: unknown key")
    config = written(tmp_path, "b.yaml", "engine: deepspeed\ndeepspeed: {extra: {tag: 2024-01-01}}\n")
    result = cli("translate", config, "--to", "deepspeed")
    assert result.code == 0 and json.loads(result.out)["tag"] == "2024-01-01", result
    refused(cli("validate", written(tmp_path, "c.yaml", "deepspeed: {extra: {tag: !!timestamp 2024-01-01}}\n")),
            "YAML tag 'tag:yaml.org,2002:timestamp' is not allowed")


def test_keys_that_are_not_strings(tmp_path):
    refused(cli("validate", written(tmp_path, "a.yaml", "? !!set {a: null}\n: 1\n")), "is not allowed")
    refused(cli("validate", written(tmp_path, "b.yaml", "? [a]\n: 1\n")), "line 1", "a mapping key must be a string")
    refused(cli("validate", written(tmp_path, "c.yaml", ".nan: 1\nx: 2\n")),
            "nan: a key must be a string, not a number")
    refused(cli("import", written(tmp_path, "d.yaml", "distributed_type: FSDP\n1: x\n")), "a key must be a string")


def test_an_alias_inside_its_own_anchor(tmp_path):
    refused(cli("validate", written(tmp_path, "a.yaml", "a: &a [*a]\n")), "refers to an anchor it is inside")
    deep = "a: &a " + "[" * 20 + "x" + "]" * 20 + "\nb: &b " + "[" * 20 + "*a" + "]" * 20 + "\n"
    refused(cli("validate", written(tmp_path, "b.yaml", deep)), "nesting deeper than 32 levels")


def test_an_override_that_is_not_yaml(tmp_path):
    config = written(tmp_path, "a.yaml", "engine: fsdp2\n")
    refused(cli("validate", config, "engine='fsdp2"), "engine: the value of override", "not valid YAML")
    refused(cli("validate", config, f"train.steps={'9' * 5000}"), "train.steps", "as int")
    refused(cli("validate", config, "x=" + "[" * 100 + "]" * 100), "nesting deeper than")


def test_an_override_key_that_opens_a_bracket_it_never_closes(tmp_path):
    """omegaconf's key parser raises IndexError on `[x` (found by the generative run at 10,000 cases per test)."""
    config = written(tmp_path, "a.yaml", "engine: fsdp2\n")
    for override in ("[=1", "[x=1", "[0=1"):
        refused(cli("validate", config, override), "not a key path", "fix: name a key with dots")
        refused(cli("translate", config, "--to", "deepspeed", override), "not a key path")


def test_values_of_the_wrong_shape(tmp_path):
    refused(cli("validate", written(tmp_path, "a.yaml", "parallel: {sharding: {}}\n")), "parallel.sharding")


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "/dev/urandom"])
def test_only_regular_files_are_read(tmp_path, special):
    """In a fresh process with a timeout: a FIFO used to hang, /dev/zero to be read until memory ran out."""
    path = special
    if special == "fifo":
        path = tmp_path / "config.yaml"
        os.mkfifo(path)
    result = run_cli("validate", path, timeout=60)
    assert result.returncode == 2 and "not a config file" in result.stderr and "Traceback" not in result.stderr


def test_path_and_output_errors_name_the_path(tmp_path):
    long = "a" * 300
    refused(cli("validate", tmp_path / f"{long}.yaml"), f"{long}.yaml", "cannot open it")
    config = ROOT / "configs" / "deepspeed-bf16-zero2.yaml"
    refused(cli("translate", config, "--to", "deepspeed", "-o", tmp_path / f"{long}.json"), f"-o {tmp_path}",
            "nothing written")
    refused(cli("translate", config, "--to", "accelerate", "-o", tmp_path / f"{'b' * 250}.yaml"), "nothing written")
    a_file = written(tmp_path, "file.txt", "x")
    refused(cli("translate", config, "--to", "fsdp2", "-o", a_file / "out.json"), f"{a_file} is not a folder")
    refused(cli("import", ROOT / "tests/data/fixtures/accelerate_fsdp_config.yaml", "-o", a_file / "x.yaml"),
            "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


@pytest.mark.parametrize("encode", [base64.urlsafe_b64encode, base64.b64encode])
def test_accelerate_inline_base64_deepspeed_config(tmp_path, encode):
    """HfDeepSpeedConfig reads deepspeed_config_file as a path, JSON text or base64 JSON (accelerate 1.15
    utils/deepspeed.py); a realistic config is longer than a file name may be."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                                "stage3_gather_16bit_weights_on_model_save": True, "contiguous_gradients": True}}
    inline = encode(json.dumps(ds).encode()).decode()
    assert len(inline) > 255
    accelerate = written(tmp_path, "acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  "
                         f"deepspeed_config_file: {inline}\n")
    result = cli("import", accelerate)
    assert result.code == 0 and "sharding: full" in result.out, result
    refused(cli("import", written(tmp_path, "bad.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  "
                                  f"deepspeed_config_file: {'x' * 400}\n")), "names a file that does not exist")


def test_validate_output_reads_back_the_same(tmp_path):
    for fmt in ("yaml", "json"):
        result = cli("validate", written(tmp_path, "empty.yaml", "{}\n"), "--format", fmt)
        assert result.code == 0 and result.err == "", result
        reads_back(result.out, fmt, tmp_path)
    result = cli("validate", written(tmp_path, "eps.yaml", "optimizer: {eps: 1e-8}\n"), "--format", "json")
    assert json.loads(result.out)["optimizer"]["eps"] == 1e-8, result
    reads_back(result.out, "json", tmp_path)
    offload = written(tmp_path, "offload.yaml", "engine: deepspeed\ndeepspeed: {offload_optimizer: cpu}\n")
    reads_back(cli("validate", offload, "--strict").out, "yaml", tmp_path)


def test_outputs_copy_no_interpolation_and_no_control_character(tmp_path):
    with_interpolation = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  offload_param_device: " \
                         "nvme\n  offload_param_nvme_path: ${oc.env:HOME}\n"
    refused(cli("import", written(tmp_path, "a.yaml", with_interpolation)), "deepspeed.nvme_path: holds `${`")
    refused(cli("import", written(tmp_path, "b.yaml", 'distributed_type: FSDP\nmain_training_function: "x\\x1b"\n')),
            "control character")
    odd_name = written(tmp_path, "c\x1b\n.yaml", (ROOT / "tests/data/fixtures/accelerate_fsdp_config.yaml").read_text())
    result = cli("import", odd_name)
    assert result.code == 0 and "\x1b" not in result.out, result
    reads_back(cli("validate", written(tmp_path, "imported.yaml", result.out)).out, "yaml", tmp_path)
    config = written(tmp_path, "d\n\x1b.yaml", (ROOT / "configs" / "fsdp2-bf16-pure.yaml").read_text())
    result = cli("translate", config, "--to", "accelerate")
    assert result.code == 0 and "\x1b" not in result.out and isinstance(yaml.safe_load(result.out), dict), result


def test_resolvers_are_refused_naming_the_key(tmp_path, monkeypatch):
    """An untrusted config must not copy the environment (a token) into what validate, translate or -o write."""
    monkeypatch.setenv("FP8DIST_TEST_SECRET", "s3cret")
    out = tmp_path / "ds.json"
    for text in ("deepspeed: {nvme_path: '${oc.env:FP8DIST_TEST_SECRET}'}\n",
                 "deepspeed: {extra: {x: 'a ${oc.decode:${oc.env:FP8DIST_TEST_SECRET}}'}}\n"):
        config = written(tmp_path, "a.yaml", "engine: deepspeed\n" + text)
        for args in (("validate", config), ("translate", config, "--to", "deepspeed", "-o", out)):
            result = cli(*args)
            refused(result, "calls an omegaconf resolver", "deepspeed.")
            assert "s3cret" not in result.err
    refused(cli("validate", written(tmp_path, "b.yaml", "{}\n"), "deepspeed.nvme_path=${oc.env:HOME}"),
            "deepspeed.nvme_path: calls an omegaconf resolver")
    refused(cli("validate", written(tmp_path, "c.yaml", "deepspeed: {nvme_path: '\\${x}'}\n")), "holds `${` after")
    reference = written(tmp_path, "d.yaml", "precision: {load_dtype: fp32, reduce_dtype: '${precision.load_dtype}'}\n")
    assert cli("validate", reference).code == 0
    assert not out.exists()


# -- the generative test ------------------------------------------------------------------------------------------
FUZZ_EXAMPLES = int(os.environ.get("FP8DIST_FUZZ_EXAMPLES", "0"))


# A long run keeps every failing example in this folder (gitignored): running the same command again replays it
# first, so a failure seen once can always be reproduced; the failure also prints a @reproduce_failure blob.
FUZZ_DATABASE = ROOT / ".hypothesis" / "odd_input"


def fuzz_settings(default_examples: int):
    """Seeded (derandomized), quick and without a database by default; FP8DIST_FUZZ_EXAMPLES=N for a long random
    run that records its failures in FUZZ_DATABASE."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    database = DirectoryBasedExampleDatabase(str(FUZZ_DATABASE)) if FUZZ_EXAMPLES else None
    return settings(max_examples=FUZZ_EXAMPLES or default_examples, derandomize=not FUZZ_EXAMPLES, deadline=None,
                    database=database, print_blob=bool(FUZZ_EXAMPLES), suppress_health_check=list(HealthCheck))


def _load_seed(path: Path):
    text = path.read_text(encoding="utf-8")
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


CONFIG_SEEDS = [_load_seed(path) for path in CONFIGS] + [{}]
IMPORT_SEEDS = [_load_seed(path) for path in sorted((CORPUS / "corpus").glob("*/*")) + sorted(
    (CORPUS / "fixtures").glob("*")) if path.suffix in (".yaml", ".yml", ".json")]
DEEPSPEED_SEEDS = [_load_seed(path) for path in sorted((CORPUS / "corpus" / "deepspeed").glob("*.json"))]


def _dotted(node, prefix=""):
    for key, value in node.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from _dotted(value, prefix + key + ".")


KEYS = sorted(_dotted(defaults()))
ODD_TEXT = ["", " ", "auto", "none", "fsdp2", "deepspeed", "bf16", "fp16", "fp8", "FULL_SHARD", "off", "yes", "NO",
            "${oc.env:HOME}", "${precision.load_dtype}", "${nowhere}", "${engine", "\\${x}", "\x1b[31m", "\x7f",
            "2024-13-45", "2024-01-01", "1e-8", "0x1F", "1_000", "\ud800", "\U0001f4a5", "x" * 300, "[", "{}", "cpu",
            "/tmp/x", "tensorwise", "hybrid", "adamw", "a\nb", "~"]
ODD_SCALARS = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 2, 3, 8, 2 ** 63, -(2 ** 63) - 1, 10 ** 400, 1e308, 1e-8, -0.0,
                     float("nan"), float("inf")] + ODD_TEXT),
    st.integers(), st.floats(), st.text(max_size=12))
ODD_VALUES = st.recursive(ODD_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner,
                                                 max_size=3)), max_leaves=6)
ODD_KEYS = st.one_of(st.sampled_from([key.rsplit(".", 1)[-1] for key in KEYS]), st.text(max_size=10),
                     st.sampled_from([1, 0.5, None, True, "2024-01-01", "${x}", "<<", "\x1b"]))
# Text-level edits of a YAML file: what a structure (or yaml.safe_dump) never writes.
SNIPPETS = ["!!python/object/apply:os.system ['true']", "&a [*a]", "? [a]\n: 1", "<<: *nope", "!!set {a: null}",
            "2024-13-45: 1", "'unclosed", "\t", "--- \n", "%YAML 1.1\n", "\ufeff", "!!binary aGk=",
            "!!timestamp 2024-01-01", "!!int 'x'", "!!bool maybe", "!!float ''", "!!int ''", "!!omap [a: 1]",
            "*undefined", "{a: 1, a: 2}", "? !!str\n", "&x 1\ny: *x", "9" * 5000, ".nan", "!custom x", "\x00",
            "- a\n- b", ": :", "[" * 40, "{{{", "a: ${oc.env:HOME}"]


def _leaves(document):
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict | list):
            stack.extend(node.values() if isinstance(node, dict) else node)
        else:
            yield node


# Values the seeds hold: an edit that uses one often gives a config that is valid, whose output must read back.
SEED_VALUES = sorted({repr(leaf): leaf for seed in CONFIG_SEEDS + [defaults()] for leaf in _leaves(seed)}.values(),
                     key=repr)
SOUND_OVERRIDES = ["train.steps=3", "engine=deepspeed", "engine=fsdp2", "parallel.sharding=full",
                   "precision.preset=bf16",
                   "optimizer.eps=1e-8", "deepspeed.extra={a: 1}", "precision.fp8.backend=torchao", "compile=true",
                   "parallel.offload=params", "deepspeed.offload_optimizer=cpu", "audit.first_step=off",
                   "deepspeed.nvme_path=/tmp/x y"]


def _positions(document):
    """(container, key) of every value in `document`, nested ones included."""
    stack, out = [document], []
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            out.append((node, key))
            stack.append(value)
    return out


@st.composite
def mutated(draw, seeds):
    """A seed document with 0-3 structure-aware edits: a value replaced by an odd one, a key removed, an odd key
    added, a subtree moved elsewhere."""
    document = copy.deepcopy(draw(st.sampled_from(seeds)))
    if not isinstance(document, dict):
        return document
    for _ in range(draw(st.integers(0, 3))):
        positions = _positions(document)
        edit = draw(st.sampled_from(["set", "delete", "add", "move"]))
        if not positions or edit == "add":
            targets = [document] + [c[k] for c, k in positions if isinstance(c[k], dict)]
            draw(st.sampled_from(targets))[draw(ODD_KEYS)] = draw(ODD_VALUES)
            continue
        container, key = draw(st.sampled_from(positions))
        if edit == "set":
            container[key] = draw(st.one_of(st.sampled_from(SEED_VALUES), ODD_VALUES))
        elif edit == "delete":
            del container[key]
        else:
            other, other_key = draw(st.sampled_from(positions))
            container[key] = copy.deepcopy(other[other_key])
    return document


@st.composite
def file_text(draw, document):
    """(text, file suffix): the document as JSON (named .json or .yaml) or YAML (mostly named .yaml), sometimes
    edited as text."""
    try:
        text, suffix = json.dumps(document, indent=1), draw(st.sampled_from([".json", ".yaml"]))
    except (TypeError, ValueError):  # keys JSON cannot have
        text, suffix = yaml.safe_dump(document, sort_keys=False), ".yaml"
    if draw(st.booleans()):
        text = yaml.safe_dump(document, sort_keys=False, allow_unicode=draw(st.booleans()))
        suffix = draw(st.sampled_from([".yaml"] * 5 + [".json"]))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["insert", "truncate", "line"]))
        if edit == "insert":
            text = text[:at] + draw(st.sampled_from(SNIPPETS)) + text[at:]
        elif edit == "truncate":
            text = text[:at]
        else:
            lines = text.splitlines(keepends=True) or [""]
            text += draw(st.sampled_from(lines))
    return text, suffix


def _inline_deepspeed(seed, how: str) -> dict:
    ds = json.dumps(seed)
    value = ds if how == "json" else base64.urlsafe_b64encode(ds.encode()).decode()
    return {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": value}}


OVERRIDE = st.one_of(st.sampled_from(SOUND_OVERRIDES), st.builds(
    lambda key, value: f"{key}={value}", st.one_of(st.sampled_from(KEYS), st.text(max_size=8)),
    st.one_of(st.sampled_from(ODD_TEXT + SNIPPETS), st.text(max_size=12))))


CASE_SECONDS = 60  # one command on one generated input; the slowest seen take well under a second


@contextlib.contextmanager
def no_hang(args: list):
    """A generated case that runs past CASE_SECONDS fails as a hang (SIGALRM in this process), instead of stalling
    the run."""
    def hung(*_):
        raise TimeoutError(f"no exit after {CASE_SECONDS} s: {args!r}")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(CASE_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_and_check(args: list, folder: Path) -> None:
    """The invariant: exit 0 or 2 and no traceback, within CASE_SECONDS; exit 2 says why and writes nothing; exit 0
    output reads back."""
    out_dir = folder / "out"
    out_dir.mkdir()
    with no_hang(args):
        result = cli(*args)
    target = f" --to {args[args.index('--to') + 1]}" if "--to" in args else ""
    event(f"{args[0]}{target}: exit {result.code}")
    assert result.code in (0, 2), (args, result)
    assert "Traceback" not in result.err, (args, result)
    if result.code == 2:
        assert result.err.strip() and not any(out_dir.iterdir()), (args, result)
        return
    command = args[0]
    output = next(iter(sorted(out_dir.iterdir())), None)
    printed = output.read_text(encoding="utf-8") if output else result.out
    if command == "validate":
        reads_back(printed, args[args.index("--format") + 1], folder)
    elif command == "import":
        again = cli("validate", written(folder, "imported.yaml", printed))
        assert again.code == 0, (printed, again)
        reads_back(again.out, "yaml", folder)
    elif "accelerate" in args and not str(output).endswith(".json"):
        assert isinstance(yaml.safe_load(printed), dict), printed
    else:
        json.loads(printed, parse_constant=lambda name: pytest.fail(f"{name} in the JSON output"))


def _in_folder(check):
    with tempfile.TemporaryDirectory() as folder:
        check(Path(folder))


@fuzz_settings(150)
@given(data=st.data(), document=mutated(CONFIG_SEEDS), overrides=st.lists(OVERRIDE, max_size=2))
def test_generated_configs_through_validate_and_translate(data, document, overrides):
    text, suffix = data.draw(file_text(document))
    command = data.draw(st.sampled_from([
        ["validate", "--format", "yaml"], ["validate", "--format", "json"],
        ["validate", "--format", "yaml", "--strict"], ["translate", "--to", "deepspeed"],
        ["translate", "--to", "fsdp2"], ["translate", "--to", "accelerate"]]))
    to_file = command[0] == "translate" and data.draw(st.booleans())

    def check(folder):
        config = written(folder, "config" + suffix, text)
        output = ["-o", folder / "out" / data.draw(st.sampled_from(["x.json", "x.yaml"]))] if to_file else []
        run_and_check([command[0], config, *command[1:], *output, *overrides], folder)

    _in_folder(check)


@fuzz_settings(100)
@given(data=st.data(), document=st.one_of(mutated(IMPORT_SEEDS), st.builds(
    _inline_deepspeed, mutated(DEEPSPEED_SEEDS), st.sampled_from(["json", "base64"]))))
def test_generated_tool_files_through_import(data, document):
    text, suffix = data.draw(file_text(document))
    kind = data.draw(st.sampled_from([[], ["--from", "accelerate"], ["--from", "axolotl"], ["--from", "deepspeed"]]))
    to_file = data.draw(st.booleans())

    def check(folder):
        output = ["-o", folder / "out" / "imported.yaml"] if to_file else []
        run_and_check(["import", written(folder, "file" + suffix, text), *kind, *output], folder)

    _in_folder(check)


@fuzz_settings(50)
@given(raw=st.binary(max_size=300), command=st.sampled_from([["validate", "--format", "yaml"], ["import"],
                                                            ["translate", "--to", "deepspeed"]]))
def test_raw_bytes(raw, command):
    _in_folder(lambda folder: run_and_check([command[0], written(folder, "raw.yaml", raw), *command[1:]], folder))


def test_a_generated_case_that_hangs_fails_instead_of_stalling(monkeypatch):
    import time

    monkeypatch.setattr(sys.modules[__name__], "CASE_SECONDS", 1)
    with pytest.raises(TimeoutError, match="no exit after 1 s"):
        with no_hang(["validate", "fifo"]):
            time.sleep(3)
