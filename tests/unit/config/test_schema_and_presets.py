"""The schema itself: valid JSON Schema, every field documented, presets cover the documented tables; the readable
reference generated from it (docs/config.md)."""
import json
import subprocess
import sys

import pytest
from jsonschema import Draft202012Validator

import fp8dist.config.schema as schema
from fp8dist.config.load import load_config
from fp8dist.config.spec import Spec
import dataclasses
import typing

TABLE_A = ["fp16-amp", "te", "msamp-o1", "msamp-o2", "msamp-o3"]
TABLE_B = ["bf16-pure", "bf16"]


def test_schema_is_valid_2020_12():
    Draft202012Validator.check_schema(schema.schema())


def _walk(node, path=""):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}" if path else key)


def test_every_field_has_description_and_default_and_objects_are_closed():
    for path, node in _walk(schema.schema()):
        if not path:
            continue
        assert node.get("description"), f"{path} has no description"
        assert "default" in node, f"{path} has no default"
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} allows unknown keys"


@pytest.mark.parametrize("name", TABLE_A + TABLE_B + ["fp32", "torchao-float8"])
def test_every_documented_row_is_a_preset_that_loads(name):
    assert name in schema.presets()
    spec = load_config({"precision": {"preset": name}})
    assert spec.precision.preset == name


def test_preset_values_land_and_explicit_keys_win():
    spec = load_config({"precision": {"preset": "msamp-o3"}})
    assert (spec.engine, spec.deepspeed.zero_stage, spec.fp8.backend, spec.fp8.msamp.opt_level) == \
        ("deepspeed", 2, "msamp", "O3")
    spec = load_config({"precision": {"preset": "bf16", "reduce_dtype": "bf16"}})
    assert spec.precision.reduce_dtype == "bf16" and spec.precision.master_weights == "fp32"


def test_schema_enum_lists_presets_from_presets_file():
    enum = schema.schema()["properties"]["precision"]["properties"]["preset"]["enum"]
    assert set(enum) == {None, *schema.presets()}


def _dataclass_tree(cls):
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in ("source", "notes"):  # where it came from and what it says, not schema fields
            continue
        hint = hints[f.name]
        out[f.name] = _dataclass_tree(hint) if dataclasses.is_dataclass(hint) else None
    return out


def _schema_tree(node):
    return {k: (_schema_tree(v) if v.get("type") == "object" and "properties" in v else None)
            for k, v in node["properties"].items()}


def test_spec_dataclasses_mirror_the_schema():
    assert _dataclass_tree(Spec) == _schema_tree(schema.schema())


def test_defaults_round_trip_through_the_schema():
    spec = load_config(None)
    assert Draft202012Validator(schema.schema()).is_valid(spec.to_dict())
    assert spec.engine == "fsdp2" and spec.precision.mixed_precision == "bf16"


def test_docs_config_md_is_the_generated_reference():
    """docs/config.md is `fp8dist schema --format markdown` (regenerate it with that command when this fails)."""
    from fp8dist.commands.reference import COMMAND, markdown
    from tests.conftest import ROOT

    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == markdown(), f"stale: run `{COMMAND}`"


def test_the_reference_names_every_key_every_preset_and_only_public_sources():
    from fp8dist.audit.expected import PHASES
    from fp8dist.commands.reference import markdown

    text = markdown()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    keys = {path for path, node in _walk(schema.schema()) if path and not (node.get("type") == "object"
                                                                          and "properties" in node)}
    assert keys <= rows, keys - rows
    for name in schema.presets():
        section = text.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        assert "| phase | " in section and "| `gemm` |" in section, name
    assert set(PHASES) <= rows
    assert '<a id="table-a"></a>' in text and '<a id="table-b"></a>' in text and "](#table-a)" in text
    # (no citation a reader cannot open: tests/unit/test_citations.py, for docs/config.md as for every file)
    assert "https://azure.github.io/MS-AMP/docs/user-tutorial/optimization-level" in text
    assert "https://huggingface.co/docs/accelerate/concept_guides/fsdp_and_deepspeed" in text


def test_the_reference_says_when_a_preset_cannot_run_on_an_engine():
    from fp8dist.commands.reference import markdown

    msamp = markdown().split("### `msamp-o2`\n", 1)[1].split("\n### ", 1)[0]
    assert "| phase | deepspeed | why |" in msamp and "On fsdp2: refused: " in msamp and "| `optimizer` | fp8+fp16 |" in msamp


def test_presets_point_to_the_tables_they_cite():
    result = subprocess.run([sys.executable, "-m", "fp8dist", "presets"], capture_output=True, text=True)
    assert result.returncode == 0 and "Table A row 'FP16 AMP'" in result.stdout
    assert "docs/config.md" in result.stdout and "fp8dist schema --format markdown" in result.stdout


def test_schema_markdown_imports_no_torch():
    code = ("import sys; from fp8dist.cli import main; rc = main(['schema', '--format', 'markdown']); "
            "print('TORCH=' + str('torch' in sys.modules), file=sys.stderr); raise SystemExit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "TORCH=False" in result.stderr and result.stdout.startswith("# Config reference")
