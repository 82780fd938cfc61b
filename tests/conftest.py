import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def run_cli(*args, cwd=None, env=None, timeout=120):
    """Run `python -m fp8dist ...` in a fresh interpreter, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "fp8dist", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=full_env, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
