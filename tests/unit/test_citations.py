"""The project's files cite only what a reader of the repository can open: public URLs and upstream paths, never
notes that live outside it (the planning folder beside the checkout, its research notes, its numbered seed files).
Third-party files kept as test data (tests/data) are not checked, the fixtures' own headers are."""
import re

from tests.conftest import ROOT

OUTSIDE = re.compile(r"shared/|research/\w+\.md|MISSION\.md|DESIGN\.md|\bseeds?[ _]0\d\d\b", re.IGNORECASE)
TREES = ("fp8dist", "benchmarks", "docs", "tests", "launch", "examples", "schemas", "configs")


def test_no_file_cites_notes_outside_the_repository():
    files = [ROOT / "README.md", *(p for tree in TREES for p in (ROOT / tree).rglob("*")
                                   if p.suffix in (".py", ".md", ".json", ".yaml", ".yml", ".sh", ".txt"))]
    ours = [p for p in files if p != ROOT / "tests/unit/test_citations.py"
            and ("tests/data" not in str(p) or "tests/data/fixtures" in str(p))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in ours
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)
