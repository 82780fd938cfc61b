"""Transformer Engine's real pure-Python files, taken from its release wheels, for the contract tests
(tests/unit/backends/test_te_recipe_contract.py). TE itself cannot be installed or imported without CUDA, but
every registry wheel `transformer_engine-X-py3-none-any.whl` holds the Python sources, and its recipe module
(transformer_engine/common/recipe/__init__.py) imports only the standard library and pydantic.

- `download(versions, cache)`: `pip download --no-deps --only-binary=:all: transformer-engine==X` for each release
  not cached yet, in parallel, each into a temporary directory first (two runs never see half a wheel). The cache
  is $FP8DIST_TE_WHEEL_CACHE, else the test session's temporary directory.
- `load_recipe_module(wheel)`: that one file, executed under a private module name (never `transformer_engine`),
  registered in sys.modules before it runs: the file uses `from __future__ import annotations`, and the dataclass
  machinery behind pydantic's dataclasses looks the module up there. NVTE_* variables are cleared while it runs,
  because some class defaults read them at class creation (NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES, ...).
- `sources(wheel, folder)`: the text of the .py files under a folder of the wheel, for reading attribute names.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

CACHE_ENV = "FP8DIST_TE_WHEEL_CACHE"
RECIPE_MEMBER = "transformer_engine/common/recipe/__init__.py"
_MODULES: dict[tuple, ModuleType] = {}


class Unavailable(Exception):
    """A wheel could not be had (no network, no such release): the tests skip with this reason."""


def _wheel(folder: Path) -> Path | None:
    wheels = sorted(folder.glob("transformer_engine-*-py3-none-any.whl"))
    return wheels[0] if wheels else None


def _download_one(version: str, cache: Path) -> Path:
    target = cache / version
    if (found := _wheel(target)) is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--retries", "1",
                   "--timeout", "30", "--no-deps", "--only-binary=:all:", f"transformer-engine=={version}", "-d", tmp]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download transformer-engine=={version} took over 300 s") from None
        wheel = _wheel(Path(tmp))
        if result.returncode != 0 or wheel is None:
            output = (result.stderr or result.stdout).strip().splitlines()
            raise Unavailable(f"`pip download transformer-engine=={version}` failed (no network or no such "
                              f"release?): {output[-1] if output else f'exit {result.returncode}'}")
        target.mkdir(exist_ok=True)
        os.replace(wheel, target / wheel.name)
    return target / wheel.name


def download(versions: list[str], cache: Path) -> dict[str, Path]:
    """version -> its wheel in `cache`, downloading those not there yet (in parallel)."""
    with ThreadPoolExecutor(max_workers=len(versions)) as pool:
        wheels = list(pool.map(lambda v: _download_one(v, cache), versions))
    return dict(zip(versions, wheels))


def load_recipe_module(wheel: Path, **nvte: str) -> ModuleType:
    """The wheel's transformer_engine.common.recipe, as a private module (one per wheel and environment, kept);
    `nvte`: NVTE_* variables set while it runs (the others are cleared)."""
    key = (wheel, tuple(sorted(nvte.items())))
    if key in _MODULES:
        return _MODULES[key]
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(RECIPE_MEMBER)
    path = wheel.parent / "recipe.py"
    if not path.is_file():
        partial = path.with_name(f"recipe.{os.getpid()}.tmp")
        partial.write_bytes(source)
        os.replace(partial, path)
    name = "_fp8dist_te_recipe_" + re.sub(r"\W", "_", "_".join([wheel.name.split("-")[1], *(f"{k}{v}" for k, v in key[1])]))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = {variable: os.environ.pop(variable) for variable in list(os.environ) if variable.startswith("NVTE_")}
    os.environ.update(nvte)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        for variable in nvte:
            del os.environ[variable]
        os.environ.update(saved)
    _MODULES[key] = module
    return module


def sources(wheel: Path, folder: str) -> dict[str, str]:
    """Path -> text of every .py file under `folder` (e.g. transformer_engine/pytorch/tensor/) of the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name).decode() for name in archive.namelist()
                if name.startswith(folder) and name.endswith(".py")}
