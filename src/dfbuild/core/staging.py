"""A directory made beside its place and renamed into it when complete: an interrupt never leaves a
half-made DIR, and the next run removes the debris (dfbuild's own, never the user's).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from dfbuild.core import journal, paths, state, ui

# --- materialising DIR -------------------------------------------------------------


def staging_dir(dest: Path) -> Path:
    """Where a new DIR is built before it is renamed into place (same filesystem, so the rename is atomic)."""
    return dest.parent / f".{dest.name}.dfbuild-partial"


def clear_debris(dest: Path) -> None:
    """dfbuild's own leftovers from an interrupted run on DEST: a half-made DIR, a journal."""
    partial = staging_dir(dest)
    if partial.exists() or partial.is_symlink():
        ui.warn(f"removing {partial}, an unfinished checkout or import left by an interrupted dfbuild")
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink()
    if paths.is_git_tree(dest):
        journal.recover(dest)


@contextmanager
def staged(dest: Path):
    """A fresh staging dir for DEST, removed unless the block renamed it into place."""
    partial = staging_dir(dest)
    if partial.exists():
        shutil.rmtree(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    # made here, not by git: a read-only or full parent is then an OSError naming it (exit 16), not git's
    # "could not create work tree dir" as a GitCommandError (git clones into an empty dir all the same)
    partial.mkdir()
    try:
        yield partial
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


def move_into_place(made: Path, dest: Path) -> None:
    state.tree_made(made, dest)  # the new tree's own lock, taken before anyone can see it as DEST
    if dest.exists():
        dest.rmdir()  # empty, as checked: a non-empty DIR was refused
    os.replace(made, dest)
