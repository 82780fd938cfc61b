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


def pytest_terminal_summary(terminalreporter):
    """How many gloo worlds (tests/distributed/worlds.py) the session started and how many jobs they ran."""
    worlds = sys.modules.get("tests.distributed.worlds")
    if worlds is not None and worlds.WORLDS.starts:
        terminalreporter.write_line(f"kept gloo worlds: {worlds.WORLDS.starts} started, {worlds.WORLDS.jobs} jobs "
                                    "run in them")


def pytest_sessionfinish(session, exitstatus):
    """End the kept gloo worlds with the session."""
    worlds = sys.modules.get("tests.distributed.worlds")
    if worlds is not None:
        worlds.WORLDS.close()
