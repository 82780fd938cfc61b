"""mypy over fp8dist/ (settings: pyproject.toml [tool.mypy]) finds no error: the typed Spec, ParallelDims, the
engine facts protocol and the plans are held to their annotations."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mypy_finds_no_error_in_fp8dist():
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", "/dev/null"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, "\n".join(errors[:40]) + f"\n({len(errors)} errors)\n" + result.stderr
