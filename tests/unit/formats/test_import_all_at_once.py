"""`fp8dist import` says every problem of a file at once (issue 46, item 9): what the importer refuses and what
fp8dist's own rules refuse in the rest of the file, instead of the second only after the first is fixed."""
import pytest

from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file
from tests.conftest import ROOT

AXOLOTL = ROOT / "tests" / "data" / "corpus" / "axolotl"


@pytest.mark.parametrize("name, both", [
    # an 8-bit optimizer under DeepSpeed (the importer) and context_parallel_size: 8 on DeepSpeed (the rules)
    ("axolotl__examples_alst_llama3-8b-deepspeed-alst.yaml", ("optimizer", "parallel.context_size")),
    # an 8-bit optimizer under DeepSpeed and a QLoRA (NF4) base on DeepSpeed
    ("axolotl__examples_mistral_mixtral_mixtral.yml", ("optimizer", "adapter.base_dtype")),
])
def test_an_axolotl_file_refused_for_several_keys_lists_all_of_them(name, both):
    with pytest.raises(ImportProblem) as raised:
        import_file(AXOLOTL / name)
    assert [issue.path for issue in raised.value.issues] == list(both), str(raised.value)
    assert "8-bit Adam states" in raised.value.issues[0].message
    assert raised.value.issues[1].message.startswith("the imported config is refused by fp8dist: ")
    assert "2 problem(s)" in str(raised.value)
