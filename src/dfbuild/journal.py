"""What dfbuild is in the middle of doing to a work tree, so an interrupted run can be undone.

Before `checkout` moves an existing DIR or `apply` commits its first patch, it
writes TREE/.git/dfbuild/journal.json (atomically) naming the operation and
what it needs to finish or undo it; the journal is removed when the operation
is complete or rolled back. A journal found by a later run (which holds the
tree lock, so the writer is gone) means that run was killed: `recover` then
clears dfbuild's own debris (stale git lock files, a half checkout, a
half-applied series) without touching anything dfbuild did not change, and the
user is never told that this debris is their local change.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from . import state, ui

JOURNAL_NAME = "journal.json"

# git's own lock files that a killed git process (ours) leaves behind
_GIT_LOCKS = ("index.lock", "HEAD.lock", "ORIG_HEAD.lock", "config.lock")


def journal_path(tree: Path) -> Path:
    return Path(tree) / ".git" / "dfbuild" / JOURNAL_NAME


def begin(tree: Path, op: str, **data) -> None:
    state.atomic_write_text(journal_path(tree), json.dumps(
        {"op": op, "pid": os.getpid(), **data}, indent=2, sort_keys=True) + "\n")


def end(tree: Path) -> None:
    try:
        journal_path(tree).unlink()
    except FileNotFoundError:
        pass


def pending(tree: Path) -> dict | None:
    path = journal_path(tree)
    if not path.exists():
        return None
    data = state.read_json(path, "journal")
    return data or {"op": "unknown"}


def _git(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=check)


def _clear_git_locks(tree: Path, branch: str | None) -> None:
    git_dir = Path(tree) / ".git"
    names = list(_GIT_LOCKS)
    if branch:
        names.append(f"refs/heads/{branch}.lock")
    for name in names:
        try:
            (git_dir / name).unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            pass


def restore_paths(tree: Path, commit: str, paths: list[str]) -> None:
    """Put HEAD and the index back at COMMIT and PATHS (only those) back to their content there.

    A path that did not exist at COMMIT was created by dfbuild and is removed;
    every other file in the tree, tracked or not, is left as it is.
    """
    tree = Path(tree)
    _git(tree, "reset", "--quiet", commit)  # HEAD and index only; the working tree is ours to fix below
    existing = set(_git(tree, "ls-tree", "-r", "--name-only", commit, "--", *paths).stdout.splitlines()) if paths else set()
    if existing:
        _git(tree, "checkout", "--quiet", commit, "--", *sorted(existing))
    for rel in paths:
        if rel in existing:
            continue
        target = tree / rel
        if target.is_file() or target.is_symlink():
            target.unlink()


def roll_back(tree: Path) -> bool:
    """Undo the apply in progress in this process (after a failure or Ctrl-C); False if that failed too.

    The journal stays when the rollback could not finish (a second Ctrl-C, a
    killed git), so the next run finishes it.
    """
    record = pending(tree)
    if not record or record.get("op") != "apply":
        return True
    try:
        # a git child killed along with us leaves its lock file: ours, under our tree lock
        _clear_git_locks(tree, record.get("branch"))
        restore_paths(tree, record["original_head"], list(record.get("paths") or []))
    except (Exception, KeyboardInterrupt):
        return False
    end(tree)
    return True


def recover(tree: Path) -> dict | None:
    """Undo (apply) or finish (checkout) what an interrupted dfbuild left in TREE; None if nothing."""
    tree = Path(tree)
    record = pending(tree)
    if record is None:
        return None
    op = record.get("op")
    _clear_git_locks(tree, record.get("branch"))
    if op == "apply" and record.get("original_head"):
        restore_paths(tree, record["original_head"], list(record.get("paths") or []))
        ui.warn(f"an earlier dfbuild apply on {tree} was interrupted; its partial series was rolled back "
                f"to {record['original_head'][:12]} (your own files were not touched)")
    elif op == "checkout" and record.get("commit") and record.get("branch"):
        # the interrupted `git checkout` is simply finished: the tree was clean (or stashed) before it
        _git(tree, "checkout", "--quiet", "--force", "-B", record["branch"], record["commit"])
        ui.warn(f"an earlier dfbuild checkout of {tree} was interrupted; it was finished "
                f"({record['commit'][:12]} on {record['branch']})")
    else:
        ui.warn(f"{tree} holds an unreadable dfbuild journal; removed it (check the tree with `git status`)")
    end(tree)
    return record
