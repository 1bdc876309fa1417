"""Where dfbuild keeps its caches (clones, sdists, imported trees). The lowest floor: errors and locks only."""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path

import platformdirs

from dfbuild.core.errors import DfbuildError, UsageError
from dfbuild.core.locks import hold

CACHE_ENV = "DFBUILD_CACHE_DIR"
# The installed package (src/dfbuild in a checkout) and, from a checkout, the repo around it: the one place
# that knows how deep this module lies, so that a module moving between packages never counts parents.
PACKAGE_DIR = Path(__file__).resolve().parents[1]
CHECKOUT_DIR = PACKAGE_DIR.parents[1]


def cache_dir() -> Path:
    """The user cache dir, or $DFBUILD_CACHE_DIR (tests point it at a dir they own)."""
    override = os.environ.get(CACHE_ENV)
    root = Path(override) if override else Path(platformdirs.user_cache_dir("dfbuild"))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot use {root} as dfbuild's cache dir: {exc.strerror or exc}",
            f"point ${CACHE_ENV} at a directory you can write (or unset it)" if override
            else f"make {root} a writable directory, or set ${CACHE_ENV}",
        ) from None
    if not root.is_dir():
        raise UsageError(f"cannot use {root} as dfbuild's cache dir: it is not a directory",
                         f"point ${CACHE_ENV} at a directory (or unset it)")
    return root


def git_dir(tree: Path) -> Path:
    """TREE's git dir, where dfbuild keeps the tree's lock, journal and records: TREE/.git, or the dir a
    worktree's (or submodule's) .git file names (`gitdir: PATH`). TREE/.git when neither is there."""
    dot = Path(tree) / ".git"
    if dot.is_file() and not dot.is_symlink():  # a regular file: never a FIFO to block on
        try:
            with open(dot, "rb") as handle:
                text = handle.read(4096).decode("utf-8")
        except (OSError, UnicodeError):
            return dot
        if text.startswith("gitdir:"):
            target = Path(text[len("gitdir:"):].strip())
            target = target if target.is_absolute() else Path(tree) / target
            if target.is_dir():
                return target
    return dot


def is_git_tree(tree: Path) -> bool:
    """Whether TREE is a git work tree (a clone, or a worktree whose .git file names its git dir)."""
    return git_dir(tree).is_dir()


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
    lock_file = str(path) + ".lock"
    busy = DfbuildError(
        f"another dfbuild holds the cache lock {lock_file}",
        "wait for it to finish; the lock is released when that process ends",
    )
    # says who holds it while it waits (locks.hold), instead of waiting in silence
    with hold(Path(lock_file), f"the cache lock {lock_file}", timeout=timeout, timeout_error=busy):
        yield


def default_work_dir(base: str) -> Path:
    """./dfbuild-BASE: the work dir of `release` and `prove`, whose src/ is the tree `checkout` and `apply`
    make by default (here, in the lowest floor: apply must not import the release stage and its numpy)."""
    import re

    return Path.cwd() / f"dfbuild-{re.sub(r'[^A-Za-z0-9._-]+', '-', base)}"
