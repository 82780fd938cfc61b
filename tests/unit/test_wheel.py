"""A built (non-editable) wheel carries the schemas and works from any directory."""
import subprocess
import sys

from tests.conftest import ROOT


def test_installed_wheel_finds_schemas(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path / "whl")], check=True, capture_output=True)
    wheel = next((tmp_path / "whl").glob("fp8dist-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True)
    code = ("import fp8dist, sys; from fp8dist.cli import main; assert 'site' in fp8dist.__file__, fp8dist.__file__; "
            f"sys.exit(main(['validate', r'{ROOT / 'configs' / 'msamp-o3.yaml'}']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "opt_level: O3" in result.stdout
