"""What the importer tests share: the keys an import refuses (each refusal must carry a fix), and writing a document
to a file, importing it and loading the result."""
import json
from typing import Callable

import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file

# A Hugging Face / Axolotl FSDP2 section and a small DeepSpeed JSON, for documents that need one
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}
DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
      "bf16": {"enabled": True}}


def refused_keys(run_import: Callable[[], str]) -> set[str]:
    """The keys the import `run_import()` refuses; it must refuse, and every issue must say its fix."""
    with pytest.raises(ImportProblem) as err:
        run_import()
    assert all(issue.fix for issue in err.value.issues), err.value
    return {issue.path for issue in err.value.issues}


def write_document(tmp_path, document: dict, name: str) -> str:
    """`document` written to tmp_path/name: JSON for a .json name, else YAML."""
    path = tmp_path / name
    path.write_text(json.dumps(document) if name.endswith(".json") else yaml.safe_dump(document))
    return str(path)


def import_document(tmp_path, kind: str, document: dict, name: str = "file.yaml") -> str:
    """The fp8dist config text `fp8dist import` makes of `document` read as `kind`."""
    return import_file(write_document(tmp_path, document, name), kind)


def spec_of(text: str):
    """The Spec an imported config text loads as."""
    return load_config(yaml.safe_load(text))


def refusals(tmp_path, kind: str, document: dict, name: str = "file.yaml") -> dict[str, str]:
    """key -> message of each refusal of importing `document` (every one with a fix)."""
    path = write_document(tmp_path, document, name)
    keys = refused_keys(lambda: import_file(path, kind))
    with pytest.raises(ImportProblem) as err:
        import_file(path, kind)
    return {issue.path: issue.message for issue in err.value.issues if issue.path in keys}
