"""PyPI sdists in dfbuild's cache (sdists/): what an offline base is imported from."""

from __future__ import annotations

from pathlib import Path

from . import pypi
from .paths import cache_dir


def fetch_sdist(requirement: str) -> Path:
    """The sdist for REQUIREMENT (name==version), downloaded from PyPI once and cached."""
    return pypi.fetch_sdist(requirement, cache_dir() / "sdists")
