"""Version numbers as tuples, and which release of a distribution is installed (its metadata, without importing it).

Call `installed_version` through this module (`versions.installed_version(...)`, never a copy bound by
`from ... import`): the tests stand in for an installed release by patching it here, in one place.
"""
from __future__ import annotations

import re
from importlib import metadata

Version = tuple[int, ...]


def parse_version(text: str) -> Version:
    """'0.19.8' -> (0, 19, 8); '2.13.0+cpu' -> (2, 13, 0); '0.19.0.dev0' -> (0, 19, 0)."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(text))
    if not match:
        raise ValueError(f"not a version: {text!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def fmt(version: Version) -> str:
    return ".".join(str(p) for p in version)


def installed_version(distribution: str) -> str | None:
    """Version of an installed distribution from its metadata, without importing it."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
