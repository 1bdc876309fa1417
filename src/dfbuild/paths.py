"""Where dfbuild keeps its caches (clones, sdists, imported trees)."""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path

import platformdirs
from filelock import FileLock, Timeout

from .errors import DfbuildError

CACHE_ENV = "DFBUILD_CACHE_DIR"


def cache_dir() -> Path:
    """The user cache dir, or $DFBUILD_CACHE_DIR (tests point it at a dir they own)."""
    override = os.environ.get(CACHE_ENV)
    root = Path(override) if override else Path(platformdirs.user_cache_dir("dfbuild"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in blocks (release archives can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def locked(path: Path, timeout: float = 600):
    """Hold an inter-process lock next to `path` so concurrent runs don't share a half-made cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path) + ".lock")
    try:
        with lock.acquire(timeout=timeout):
            yield
    except Timeout:
        raise DfbuildError(
            f"another dfbuild holds the cache lock {lock.lock_file}",
            "wait for it to finish; the lock is released when that process ends",
        ) from None
