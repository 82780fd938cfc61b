"""ruff over fp8dist/ (settings: pyproject.toml [tool.ruff]) finds nothing: lines within 120 characters, no unused
import or name, no likely bug (bugbear)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing_in_fp8dist():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "--no-cache",
                             "fp8dist"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    findings = [line for line in result.stdout.splitlines() if line.startswith("fp8dist/")]
    assert result.returncode == 0 and not findings, "\n".join(findings[:40]) + f"\n({len(findings)} findings)\n" \
        + result.stderr
