"""The package list in pyproject.toml matches the source tree.

setuptools installs only the packages listed there; a package moved or added without updating the list
breaks `pip install -e .` on a clean clone (it did once: `fp8dist/importers` was listed after it moved).
"""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_is_listed_and_every_listed_package_exists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    mapped = project["tool"]["setuptools"].get("package-dir", {})
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "fp8dist").rglob("__init__.py")
    }
    assert on_disk - listed == set(), "packages missing from pyproject.toml"
    for name in listed:
        folder = ROOT / mapped.get(name, name.replace(".", "/"))
        assert folder.is_dir(), f"{name} is listed in pyproject.toml but {folder} does not exist"
