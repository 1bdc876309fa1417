"""State that survives bad luck: atomic files, locks that say who holds them, owned temp dirs.

- `atomic_write_*`: temp file in the same directory, fsync, rename. A reader
  sees the old file or the new one, never half of one, whatever kills us.
- `read_json`: a record that is missing *or unreadable* is treated as absent,
  with a warning, never as a crash.
- `hold`: an inter-process lock (filelock) held for a whole command. A second
  command waits and says who holds it (pid, command, since when), or fails at
  once with LockedError (exit 15) when it was asked not to wait. Locks are
  re-entrant within one process, so a command may take the lock of a stage it
  calls.
- `temp_dir`: every scratch directory lives under CACHE/tmp, named after the
  pid that made it; the next run sweeps the ones whose process is gone (a
  `kill -9` leaves them behind).
- `fault_point`: a test-only hook (DFBUILD_TEST_STOP_AFTER) for fault injection.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# the lowest floor: errors, ui, locks, readers and paths only (never manifest, source or anything above)
from dfbuild.core import readers, ui
from dfbuild.core.locks import adopt, folder_ready, hold, hold_dir, read_state_bytes
from dfbuild.core.paths import cache_dir, git_dir, is_git_tree

# --- atomic files -----------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its rename is durable enough
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> Path:
    """Write DATA to PATH so that PATH is always either the old file or the new one.

    durable=False skips the fsyncs (for notes that may be lost, like a lock's owner).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        _fsync_dir(path.parent)
    return path


def atomic_write_text(path: Path, text: str, *, durable: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def read_json(path: Path, what: str = "record") -> dict:
    """PATH's JSON object, or {} when it is missing; an unreadable one is {} with a warning.

    PATH is opened the safe way (locks.open_state_file): a symlink, FIFO or device
    there is refused (StateFileError, exit 15), never followed or waited on.
    """
    path = Path(path)
    try:
        data = readers.loads_json(read_state_bytes(path, what))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # readers.FormatError: not UTF-8 or JSON, a key twice, too deep
        why = exc.message if isinstance(exc, readers.FormatError) else type(exc).__name__
        ui.warn(f"ignoring the unreadable {what} {path} ({why}); it is treated as absent")
        return {}
    if not isinstance(data, dict):
        ui.warn(f"ignoring the {what} {path}: it is not a JSON object; it is treated as absent")
        return {}
    return data


def clear_non_file(path: Path, what: str = "record") -> None:
    """A directory where dfbuild's own record file PATH belongs (in .git/dfbuild or the cache) is not a
    record: warn and remove it, so the record can be written again (never used on a user's dir)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        ui.warn(f"{path} should be dfbuild's {what} but is a directory; removed it")
        shutil.rmtree(path, ignore_errors=True)


# --- locks ------------------------------------------------------------------------------

def lock_dir() -> Path:
    folder = cache_dir() / "locks"
    folder_ready(folder, "folder of lock files")
    return folder


def _cache_lock_path(kind: str, target: Path) -> Path:
    resolved = str(Path(target).resolve())
    stem = re.sub(r"[^A-Za-z0-9]+", "-", resolved).strip("-")[-40:]
    digest = hashlib.sha256(os.fsencode(resolved)).hexdigest()[:16]
    return lock_dir() / f"{kind}-{stem}-{digest}.lock"


def tree_lock_path(tree: Path) -> Path:
    return git_dir(tree) / "dfbuild" / "lock"


def lock_path_for(kind: str, target: Path) -> Path:
    """The lock file of a work tree (TREE/.git/dfbuild/lock); a build dir is locked by the flock of the
    dir itself (this cache path only where there is no flock); an output dir, by this cache path.

    A tree's lock lives in the tree, so two caches (two users, a CI cache and a
    shell) still exclude each other on it.
    """
    if kind == "tree":
        return tree_lock_path(Path(os.path.abspath(target)).resolve())
    return _cache_lock_path(kind, target)


def record_dir_ready(folder: Path) -> None:
    """FOLDER (dfbuild's own, e.g. TREE/.git/dfbuild) must be a directory: a symlink (never followed) or a
    file in its place is not dfbuild's record; replace it."""
    folder = Path(folder)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        ui.warn(f"{folder} is not a directory; replaced it with dfbuild's record directory")
        folder.unlink()
    folder.mkdir(parents=True, exist_ok=True)


def _record_dir_ready(tree: Path) -> None:
    """TREE/.git/dfbuild must be a directory: anything else in its place is not dfbuild's record; replace it."""
    record_dir_ready(git_dir(tree) / "dfbuild")


def dir_note_path(folder: Path) -> Path:
    """Who holds the flock of FOLDER (a new tree's parent): a note in the cache, since none is made beside it."""
    return _cache_lock_path("dir", folder).with_suffix(".owner")


# resolved DIR -> the lock inside a tree this process is creating (see tree_made), None until it is made
_creating: dict[str, adopt | None] = {}


@contextmanager
def _hold_tree(tree: Path, what: str, wait: bool):
    """The lock inside TREE/.git; while TREE does not exist yet, the flock of its parent directory.

    The parent's flock (no file is created beside TREE) orders the creators of
    a new TREE; the creator takes the lock inside the new tree's .git before it
    renames it into place (tree_made), so whoever comes later waits on that lock.
    """
    while True:
        if is_git_tree(tree):
            _record_dir_ready(tree)
            clear_non_file(tree_lock_path(tree), "tree lock")
            with hold(tree_lock_path(tree), what, wait=wait):
                yield
            return
        parent = tree.parent
        parent.mkdir(parents=True, exist_ok=True)
        with hold_dir(parent, what, wait=wait, note=dir_note_path(parent)):
            if is_git_tree(tree):
                continue  # made by the one we waited for: its own lock guards it now
            _creating[str(tree)] = None
            try:
                yield
            finally:
                inner = _creating.pop(str(tree), None)
                if inner is not None:
                    inner.__exit__(None, None, None)
            return


def tree_made(made: Path, dest: Path) -> None:
    """Called with a new tree MADE beside DEST, right before it is renamed to DEST: lock it from inside.

    The lock file's inode moves with the rename, so the lock then guards DEST.
    """
    key = str(Path(os.path.abspath(dest)).resolve())
    if key not in _creating or _creating[key] is not None or not (Path(made) / ".git").is_dir():
        return
    _record_dir_ready(made)
    inner = adopt(tree_lock_path(made), tree_lock_path(Path(key)))
    inner.__enter__()
    _creating[key] = inner


@contextmanager
def hold_path(kind: str, target: Path, *, wait: bool = True):
    """Hold the lock of a work tree (kind 'tree'), build dir ('build') or output dir ('out')."""
    words = {"tree": "the work tree", "build": "the build dir", "out": "the output dir"}.get(kind, kind)
    resolved = Path(os.path.abspath(target)).resolve()
    if kind == "tree" and hold_dir is not None:
        with _hold_tree(resolved, f"{words} {resolved}", wait):
            yield
        return
    if kind == "build" and hold_dir is not None:
        # the flock of the build dir itself (dfbuild makes it anyway): no file appears in it, and two
        # caches (two users, a CI cache and a shell) still exclude each other, as for a tree. An output
        # dir keeps its lock in the cache: it must not be made before there is something to put in it
        resolved.mkdir(parents=True, exist_ok=True)
        with hold_dir(resolved, f"{words} {resolved}", wait=wait, note=dir_note_path(resolved)):
            yield
        return
    with hold(_cache_lock_path(kind, target), f"{words} {resolved}", wait=wait):  # no flock (Windows)
        yield


# --- temp dirs --------------------------------------------------------------------------


def tmp_root() -> Path:
    """CACHE/tmp, dfbuild's folder of scratch dirs; a file there is refused (15), never removed: a --cache-dir
    pointed at the wrong folder may hold a file of the user's by that name."""
    folder = cache_dir() / "tmp"
    folder_ready(folder, "folder of scratch dirs")
    return folder


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists, owned by someone else
    return True


TEMP_NAME = re.compile(r"^dfbuild-[a-z]+-(\d+)-")


def sweep_temp() -> list[Path]:
    """Remove temp dirs under CACHE/tmp whose process has gone; return what was removed."""
    removed: list[Path] = []
    try:
        entries = list(tmp_root().iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = TEMP_NAME.match(entry.name)
        if not match or pid_alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            try:
                entry.unlink()
            except OSError:
                continue
        removed.append(entry)
    return removed


@contextmanager
def temp_dir(kind: str, root: Path | None = None):
    """A scratch directory named dfbuild-KIND-PID-XXXX, removed afterwards (or by a later run's sweep)."""
    sweep_temp()
    folder = Path(tempfile.mkdtemp(prefix=f"dfbuild-{kind}-{os.getpid()}-", dir=root or tmp_root()))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- fault injection (tests only) -------------------------------------------------------

STOP_AFTER_ENV = "DFBUILD_TEST_STOP_AFTER"
STOP_SIGNAL_ENV = "DFBUILD_TEST_STOP_SIGNAL"
FAULT_ENV = "DFBUILD_FAULT"  # a step's name: the process is killed when it gets there
FAULT_LOG_ENV = "DFBUILD_FAULT_LOG"  # a file: every step reached is appended to it, one name a line
_steps_done = 0


def fault_point(name: str) -> None:
    """TEST-ONLY hook: a named step of apply, checkout, the curation, record and release.

    With DFBUILD_FAULT=NAME the process is killed when it reaches the step NAME
    (the first time); with DFBUILD_TEST_STOP_AFTER=N, at the Nth step reached.
    DFBUILD_FAULT_LOG=FILE appends each step's name to FILE, so a test can list
    the steps of a run and then walk each one. DFBUILD_TEST_STOP_SIGNAL picks
    the signal: INT (the default, like Ctrl-C), KILL (like `kill -9`) or TERM.
    Unset (always, outside the tests), it does nothing.
    """
    global _steps_done
    log = os.environ.get(FAULT_LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(name + "\n")
    wanted = os.environ.get(FAULT_ENV)
    limit = os.environ.get(STOP_AFTER_ENV)
    if wanted:
        if name != wanted:
            return
    elif not limit:
        return
    else:
        _steps_done += 1
        if _steps_done != int(limit):
            return
    sig = {"INT": signal.SIGINT, "KILL": getattr(signal, "SIGKILL", signal.SIGTERM),
           "TERM": signal.SIGTERM}[os.environ.get(STOP_SIGNAL_ENV, "INT").upper()]
    os.kill(os.getpid(), sig)
    if sig == signal.SIGINT:  # the handler raises KeyboardInterrupt at the next bytecode
        time.sleep(1)
