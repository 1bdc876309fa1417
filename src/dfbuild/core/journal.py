"""What dfbuild is in the middle of doing to a work tree, so an interrupted run can be undone.

Before `checkout` moves an existing DIR, stashes a user's changes (`--force`)
or `apply` commits its first patch, it writes TREE/.git/dfbuild/journal.json
(atomically) naming the operation and what it needs to finish or undo it; the
journal is removed when the operation is complete or rolled back. A journal
found by a later run (which holds the tree lock, so the writer is gone) means
that run was killed: `recover` then clears dfbuild's own debris (git lock files
its dead git left, a half checkout, a half-applied series).

A rollback restores only bytes dfbuild itself wrote: a journalled file whose
content is neither the base's nor one that the series' patches produce was
changed by someone else after the crash (a user's edit), and its bytes are kept
aside in TREE/.git/dfbuild/kept/STAMP/PATH (named in the warning) before the
file is put back. A git lock that another process holds is never removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path, PurePosixPath

from dfbuild.core import gitrun, readers, state, ui
from dfbuild.core.errors import ForeignStateError, LockedError
from dfbuild.core.paths import git_dir

JOURNAL_NAME = "journal.json"
KEPT_DIR = "kept"

# git's own lock files that a killed git process (ours) leaves behind
_GIT_LOCKS = ("index.lock", "HEAD.lock", "ORIG_HEAD.lock", "config.lock", "refs/stash.lock", "logs/refs/stash.lock")
_HEX = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_ABBREV = re.compile(r"^[0-9a-f]{7,64}$")
_OPS = ("apply", "checkout", "stash")
# the keys each operation's journal holds (begin/update/held_by_another write no others)
_KEYS = {"apply": {"original_head", "branch", "paths", "wrote"}, "checkout": {"commit", "branch", "previous"},
         "stash": set()}
_COMMON_KEYS = {"op", "pid", "started", "foreign_locks"}
_NAME_MAX = 255  # bytes in one file name (NAME_MAX on Linux, macOS and Windows' NTFS)


def record_dir(tree: Path) -> Path:
    return git_dir(tree) / "dfbuild"


def journal_path(tree: Path) -> Path:
    return record_dir(tree) / JOURNAL_NAME


def make_room(tree: Path) -> None:
    """Make TREE/.git/dfbuild a directory dfbuild can write: a file in its place is not a record; remove it."""
    folder = record_dir(tree)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        ui.warn(f"{folder} is not a directory; replaced it with dfbuild's record directory")
        folder.unlink()
    folder.mkdir(parents=True, exist_ok=True)


def _clear_record(path: Path) -> None:
    """Remove dfbuild's record PATH (inside .git/dfbuild), whatever is there: a file, a link or a directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            pass


def begin(tree: Path, op: str, **data) -> None:
    make_room(tree)
    _clear_record(journal_path(tree))
    state.atomic_write_text(journal_path(tree), json.dumps(
        {"op": op, "pid": os.getpid(), "started": time.time(), **data}, indent=2, sort_keys=True) + "\n")


def update(tree: Path, **data) -> None:
    """Add DATA to the journal in progress."""
    record = readers.loads_json(state.read_state_bytes(journal_path(tree), "journal"))
    record.update(data)
    state.atomic_write_text(journal_path(tree), json.dumps(record, indent=2, sort_keys=True) + "\n")


def end(tree: Path) -> None:
    _clear_record(journal_path(tree))


def _commit_exists(tree: Path, rev: object) -> bool:
    return isinstance(rev, str) and bool(_HEX.match(rev)) and gitrun.ok(tree, "cat-file", "-e", f"{rev}^{{commit}}")


def _safe_rel(rel: object) -> bool:
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return False
    parts = PurePosixPath(rel).parts
    return not PurePosixPath(rel).is_absolute() and ".." not in parts and parts[:1] != (".git",)


def branch_ok(branch: object) -> bool:
    """A branch name git accepts whose lock file (refs/heads/BRANCH.lock) a file system can hold: every
    component, with ".lock" added, within NAME_MAX (a 300-character name is refused here, not by an OSError)."""
    if not (isinstance(branch, str) and branch and not branch.startswith("-") and "\0" not in branch
            and len(branch.encode("utf-8", "surrogateescape")) <= 200):
        return False
    if any(len(part.encode("utf-8", "surrogateescape")) + len(".lock") > _NAME_MAX for part in branch.split("/")):
        return False
    return gitrun.ok(None, "check-ref-format", f"refs/heads/{branch}")


def problem(tree: Path, record: dict) -> str | None:
    """Why RECORD is not a journal dfbuild wrote (its schema), or None when it is one."""
    op = record.get("op")
    if op not in _OPS:
        return f"unknown operation {op!r}"
    unknown = sorted(set(record) - _COMMON_KEYS - _KEYS[op])
    if unknown:  # every name a journal holds is checked before use: a key no check knows is not dfbuild's
        return f"{', '.join(map(repr, unknown))} is not part of a {op} journal"
    if not isinstance(record.get("pid", 0), int) or isinstance(record.get("pid", 0), bool):
        return "pid is not a number"
    if not isinstance(record.get("started", 0), (int, float)) or isinstance(record.get("started", 0), bool):
        return "started is not a time"
    if record.get("branch") is not None and not branch_ok(record["branch"]):
        return "branch is not a branch name"
    foreign = record.get("foreign_locks", [])
    if not isinstance(foreign, list) or not all(f in _lock_names(record.get("branch")) for f in foreign):
        return "foreign_locks is not a list of git's lock files"
    if op == "apply":
        if not _commit_exists(tree, record.get("original_head")):
            return "original_head is not a commit of this tree"
        paths = record.get("paths")
        if not isinstance(paths, list) or not all(_safe_rel(p) for p in paths):
            return "paths is not a list of paths inside the tree"
        wrote = record.get("wrote", {})
        if not isinstance(wrote, dict) or not all(
                _safe_rel(k) and isinstance(v, list) and all(isinstance(i, str) and _ABBREV.match(i) for i in v)
                for k, v in wrote.items()):
            return "wrote is not a map of paths to blob ids"
    elif op == "checkout":
        if not _commit_exists(tree, record.get("commit")):
            return "commit is not a commit of this tree"
        if not branch_ok(record.get("branch")):
            return "branch is not a branch name"
        if record.get("previous") is not None and not _commit_exists(tree, record["previous"]):
            return "previous is not a commit of this tree"
    return None


def pending(tree: Path) -> dict | None:
    """The journal of an unfinished operation on TREE; {"op": "unknown"} when it is unreadable or invalid."""
    path = journal_path(tree)
    if not (path.exists() or path.is_symlink()):
        if record_dir(tree).exists() and not record_dir(tree).is_dir():
            return {"op": "unknown"}  # a file where dfbuild's record directory belongs
        return None
    data = state.read_json(path, "journal")
    if not data:
        return {"op": "unknown"}
    why = problem(tree, data)
    if why:
        # it reads, but it names what dfbuild never writes (a branch out of refs/heads, a path out of the
        # tree): acting on it, or removing it unseen, could do what its writer wanted; the user looks
        raise ForeignStateError(path, why, "journal")
    return data


# --- git locks --------------------------------------------------------------------------


def _open_by_someone(path: Path) -> bool:
    """Whether a live process has PATH open (Linux /proc; elsewhere: unknown, so False)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    target = str(path)
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return True
                except OSError:
                    continue
        except OSError:
            continue
    return False


def _lock_names(branch: object) -> list[str]:
    names = list(_GIT_LOCKS)
    if isinstance(branch, str) and branch:
        names.append(f"refs/heads/{branch}.lock")
    return names


def git_locks(tree: Path, branch: object = None) -> list[Path]:
    """git's lock files that exist in TREE's git dir; BRANCH's only when it is a valid branch name, and
    only a lock whose folder is inside the git dir (refs/heads as a symlink elsewhere is never entered)."""
    found = git_dir(tree)
    real = os.path.realpath(found)
    names = _lock_names(branch if branch_ok(branch) else None)
    return [found / n for n in names if _inside(real, found / n) and (found / n).is_file()]


def _inside(real_git_dir: str, lock: Path) -> bool:
    folder = os.path.realpath(lock.parent)
    return folder == real_git_dir or folder.startswith(real_git_dir + os.sep)


def held_by_another(tree: Path, lock: Path) -> LockedError:
    """LOCK was found held while this run's git needed it: note it in the journal as not ours to remove."""
    try:
        record = readers.loads_json(state.read_state_bytes(journal_path(tree), "journal"))
        held = record.get("foreign_locks") if isinstance(record.get("foreign_locks"), list) else []
        update(tree, foreign_locks=sorted({*held, lock.relative_to(git_dir(tree)).as_posix()}))
    except (OSError, ValueError, AttributeError):
        pass
    return locked_error(tree, lock)


def locked_error(tree: Path, lock: Path) -> LockedError:
    return LockedError(f"another git process holds {tree} ({lock} exists); nothing more was done",
                       f"wait for that git command to finish; if none is running, remove {lock} and run again")


def _clear_dead_git_locks(tree: Path, record: dict) -> None:
    """Remove the lock files that the dead run's git left; refuse (LockedError) one that someone else holds.

    A lock is the dead run's when it appeared while that run's journal existed
    (not older than it), no live process has it open, and the run did not
    itself find it held by another git (journal 'foreign_locks').
    """
    started = record.get("started")
    foreign = set(record.get("foreign_locks") or []) if isinstance(record.get("foreign_locks"), list) else set()
    for lock in git_locks(tree, record.get("branch")):
        try:
            mtime = lock.stat().st_mtime
        except OSError:
            continue
        rel = lock.relative_to(git_dir(tree)).as_posix()
        older = isinstance(started, (int, float)) and mtime < started - 1
        if rel in foreign or older or _open_by_someone(lock):
            raise locked_error(tree, lock)
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


# --- restoring only what dfbuild wrote --------------------------------------------------


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _current_blob(path: Path) -> str | None:
    """The blob id of PATH's bytes in the work tree (a symlink: its target), None when absent or a directory."""
    try:
        if path.is_symlink():
            return blob_id(os.fsencode(os.readlink(path)))
        if path.is_file():
            return blob_id(path.read_bytes())
    except OSError:
        return None
    return None


def _blobs_at(tree: Path, commit: str, paths: list[str]) -> dict[str, str]:
    if not paths:
        return {}
    out = gitrun.run(tree, "ls-tree", "-r", commit, "--", *paths).stdout
    found = {}
    for line in out.splitlines():
        meta, _, name = line.partition("\t")
        found[name] = meta.split()[2]
    return found


def _ours(tree: Path, record: dict, commits: list[str], paths: list[str]) -> dict[str, set[str]]:
    """Per path: the blob ids (full, or abbreviated as in a patch's index line) that dfbuild may have written."""
    ours: dict[str, set[str]] = {p: set() for p in paths}
    for commit in commits:
        for name, blob in _blobs_at(tree, commit, paths).items():
            ours.setdefault(name, set()).add(blob)
    for name, ids in (record.get("wrote") or {}).items():
        ours.setdefault(name, set()).update(ids)
    return ours


def _is_ours(current: str, ids: set[str]) -> bool:
    return any(current.startswith(i) for i in ids)


def _descendants(tree: Path, start: str) -> list[str]:
    """START and the commits between it and HEAD either way (a derived series may redo its commits from
    below START): the commits whose files dfbuild may have left in the tree."""
    head = gitrun.run(tree, "rev-parse", "--verify", "--quiet", "HEAD", check=False).stdout.strip()
    if not head:
        return [start]
    return [start, *gitrun.run(tree, "rev-list", f"{start}...{head}", check=False).stdout.split()]


def restore_paths(tree: Path, commit: str, paths: list[str], record: dict | None = None) -> list[tuple[str, Path]]:
    """Put HEAD and the index back at COMMIT and PATHS (only those) back to their content there.

    A path that did not exist at COMMIT was created by dfbuild and is removed;
    every other file in the tree, tracked or not, is left as it is. A path whose
    bytes dfbuild did not write is copied to .git/dfbuild/kept/ first; returns
    [(path, copy)] for those.
    """
    tree = Path(tree)
    ours = _ours(tree, record or {}, _descendants(tree, commit), paths)
    kept: list[tuple[str, Path]] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for rel in paths:
        current = _current_blob(tree / rel)
        if current is None or _is_ours(current, ours.get(rel, set())):
            continue
        copy = _kept_path(tree, stamp, rel)
        if (tree / rel).is_symlink():
            os.symlink(os.readlink(tree / rel), copy)
        else:
            shutil.copy2(tree / rel, copy)
        kept.append((rel, copy))
    gitrun.run(tree, "reset", "--quiet", commit)  # HEAD and index only; the working tree is ours to fix below
    existing: set[str] = set()
    if paths:
        existing = set(gitrun.run(tree, "ls-tree", "-r", "--name-only", commit, "--", *paths).stdout.splitlines())
    if existing:
        gitrun.run(tree, "checkout", "--quiet", commit, "--", *sorted(existing))
    for rel in paths:
        if rel in existing:
            continue
        target = tree / rel
        if target.is_file() or target.is_symlink():
            target.unlink()
    return kept


def _kept_path(tree: Path, stamp: str, rel: str) -> Path:
    """Where a user's bytes are kept: TREE/.git/dfbuild/kept/STAMP/REL, every folder of it a real directory
    of dfbuild's (a symlink planted at kept/ or below would send the copy outside the tree)."""
    folder = record_dir(tree)
    state.record_dir_ready(folder)
    for part in (KEPT_DIR, stamp, *PurePosixPath(rel).parts[:-1]):
        folder = folder / part
        state.record_dir_ready(folder)
    copy = folder / PurePosixPath(rel).name
    if copy.is_symlink() or copy.exists():
        copy.unlink()  # a name taken in dfbuild's own folder (the same second, twice): replaced, never followed
    return copy


def _kept_words(tree: Path, kept: list[tuple[str, Path]]) -> str:
    if not kept:
        return "no file had changed since dfbuild wrote it, so nothing of yours was touched"
    return "; ".join(f"{rel} had changed since dfbuild wrote it: your version is kept as {copy} "
                     f"(copy it back with `cp {copy} {Path(tree) / rel}`)" for rel, copy in kept)


def roll_back(tree: Path) -> bool:
    """Undo the apply in progress in this process (after a failure or Ctrl-C); False if that failed too.

    The journal stays when the rollback could not finish (a second Ctrl-C, a git
    lock held by another process), so the next run finishes it. Git locks are
    never removed here: a git child interrupted with us removes its own.
    """
    record = pending(tree)
    if not record or record.get("op") != "apply":
        return True
    if git_locks(tree, record.get("branch")):
        # another git's (see held_by_another) or our own killed child's: the next run tells them apart
        return False
    try:
        kept = restore_paths(tree, record["original_head"], list(record.get("paths") or []), record)
    except (Exception, KeyboardInterrupt):
        return False
    if kept:
        ui.warn(f"the partial series in {tree} was rolled back; {_kept_words(tree, kept)}")
    end(tree)
    return True


def recover(tree: Path) -> dict | None:
    """Undo (apply) or finish (checkout, stash) what an interrupted dfbuild left in TREE; None if nothing."""
    tree = Path(tree)
    record = pending(tree)
    if record is None:
        return None
    op = record.get("op")
    if op == "unknown":
        ui.warn(f"{tree} holds an unreadable dfbuild journal; removed it (check the tree with `git status`)")
        if record_dir(tree).exists() and not record_dir(tree).is_dir():
            make_room(tree)
        end(tree)
        return record
    _clear_dead_git_locks(tree, record)
    if op == "apply":
        kept = restore_paths(tree, record["original_head"], list(record.get("paths") or []), record)
        ui.warn(f"an earlier dfbuild apply on {tree} was interrupted; its partial series was rolled back "
                f"to {record['original_head'][:12]}; {_kept_words(tree, kept)}")
    elif op == "checkout":
        kept = _finish_checkout(tree, record)
        ui.warn(f"an earlier dfbuild checkout of {tree} was interrupted; it was finished "
                f"({record['commit'][:12]} on {record['branch']})"
                + (f"; {_kept_words(tree, kept)}" if kept else ""))
    else:  # stash: git stores the stash before it cleans the tree, so nothing is lost either way
        ui.warn(f"an earlier `dfbuild --force` was interrupted while stashing your changes in {tree}; "
                f"they are either still in the tree or in `git -C {tree} stash list`")
    end(tree)
    return record


def _finish_checkout(tree: Path, record: dict) -> list[tuple[str, Path]]:
    """Finish the interrupted `git checkout -B BRANCH COMMIT`: the tree was clean (or stashed) before it.

    Only files whose bytes are the previous commit's or the new one's are
    written; any other bytes (an edit since the crash) are kept aside first.
    """
    commit, previous = record["commit"], record.get("previous")
    names = ("diff", "--name-only", "--no-renames", "-z")
    changed = gitrun.run(tree, *names, commit, "--").stdout.split("\0")
    if previous:
        changed += gitrun.run(tree, *names, previous, commit, "--").stdout.split("\0")
    paths = sorted({p for p in changed if p})
    ours: dict[str, set[str]] = {p: set() for p in paths}
    for rev in filter(None, (commit, previous)):
        for name, blob in _blobs_at(tree, rev, paths).items():
            ours[name].add(blob)
    kept = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for rel in paths:
        current = _current_blob(tree / rel)
        if current is None or _is_ours(current, ours[rel]):
            continue
        copy = _kept_path(tree, stamp, rel)
        shutil.copy2(tree / rel, copy, follow_symlinks=False)
        kept.append((rel, copy))
    gitrun.run(tree, "checkout", "--quiet", "--force", "-B", record["branch"], commit)
    return kept
