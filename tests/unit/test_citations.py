"""The project's files cite only what a reader of the repository can open: public URLs and upstream paths, never
notes that live outside it (the planning folder beside the checkout, its research notes, its numbered seed files)."""
import re

from tests.conftest import ROOT

OUTSIDE = re.compile(r"shared/|research/\w+\.md|MISSION\.md|DESIGN\.md|\bseeds? 0\d\d\b")
TREES = ("fp8dist", "benchmarks", "docs", "tests", "launch", "examples", "schemas", "configs")


def test_no_file_cites_notes_outside_the_repository():
    files = [ROOT / "README.md", *(p for tree in TREES for p in (ROOT / tree).rglob("*")
                                   if p.suffix in (".py", ".md", ".json", ".yaml", ".yml", ".sh", ".txt"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in files if p != ROOT / "tests/unit/test_citations.py"
             and "tests/data" not in str(p) for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "\n".join(found)
