"""State that survives bad luck: atomic files, locks that say who holds them, owned temp dirs.

- `atomic_write_*`: temp file in the same directory, fsync, rename. A reader
  sees the old file or the new one, never half of one, whatever kills us. The
  file's mode follows the umask, as open()'s does (0644 under 022).
- `move`: os.replace that also works across filesystems (a `--out` on a tmpfs,
  a cache on another volume): a rename where one is possible, else a copy to a
  temp name beside the target, fsync, rename, then the source removed. Every
  move dfbuild makes goes through it.
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

import errno
import hashlib
import os
import re
import secrets
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


def _create_beside(path: Path, mode: int = 0o666) -> tuple[int, Path]:
    """A new, empty temp file beside PATH, opened for writing: (fd, its path).

    Made with os.open's MODE, so the umask applies as it does to any file the user's
    programs make (tempfile.mkstemp's 0600 would hide SHA256SUMS from a web server).
    """
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode), tmp
        except FileExistsError:
            continue


@contextmanager
def naming(path: Path):
    """An OSError inside the block that names no file names PATH: write() on a full disk (ENOSPC) names
    none, and cli.exits would say "cannot write a file" where docs/exit-codes.md promises the file."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


fsync_dir = _fsync_dir  # for a file a stage renames into place itself (draft_fix's streamed copy)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> Path:
    """Write DATA to PATH so that PATH is always either the old file or the new one.

    durable=False skips the fsyncs (for notes that may be lost, like a lock's owner).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_beside(path)
    try:
        with naming(path), os.fdopen(fd, "wb") as handle:
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


def _copy_file_durably(source: str, target: str) -> str:
    """shutil.copy2, then fsync: the copy is on disk before it is renamed into place."""
    shutil.copy2(source, target, follow_symlinks=False)
    if not os.path.islink(target):
        with open(target, "rb+") as handle:
            os.fsync(handle.fileno())
    return target


def _copy_tree(source: Path, dest: Path) -> None:
    """SOURCE's tree at DEST, links as links; the first error stops it, with its errno (shutil.copytree
    would go on past a full disk and raise one shutil.Error without an errno: exit 1, not 16)."""
    for root, dirs, files in os.walk(source):  # links to directories are listed in dirs, never followed
        here = dest / Path(root).relative_to(source)
        here.mkdir()
        shutil.copymode(root, here)
        for name in dirs + files:
            item = Path(root) / name
            if item.is_symlink():
                os.symlink(os.readlink(item), here / name)
            elif name in files:
                _copy_file_durably(str(item), str(here / name))


def _copy_beside(source: Path, target: Path) -> Path:
    """A complete, fsync'd copy of SOURCE (a file, a link or a tree) under a temp name beside TARGET."""
    if source.is_dir() and not source.is_symlink():
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            _copy_tree(source, tmp)
        except BaseException:  # a full disk half-way: no half copy left beside TARGET
            _remove(tmp)
            raise
        return tmp
    fd, tmp = _create_beside(target)
    os.close(fd)
    try:
        if source.is_symlink():
            tmp.unlink()
            os.symlink(os.readlink(source), tmp)
        else:
            _copy_file_durably(str(source), str(tmp))
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def _remove(path: Path) -> bool:
    """Remove PATH (a tree, a file or a link, never followed); False when a file or link could not be."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return True
    try:
        path.unlink()
    except OSError:
        return False
    return True


def move(source: Path, target: Path) -> Path:
    """Move SOURCE (a file, a link or a directory) to TARGET as os.replace does, across filesystems too.

    A rename where SOURCE and TARGET share a filesystem (atomic, and all it costs).
    Across filesystems (EXDEV: a `--out` on a tmpfs or a mounted volume, a cache on
    another disk) SOURCE is copied to a temp name beside TARGET, fsync'd, and renamed
    into place, so TARGET is the old one or the whole new one, never half of it;
    SOURCE is removed only then. A directory TARGET must be absent or empty, as for
    os.replace.
    """
    source, target = Path(source), Path(target)
    try:
        os.replace(source, target)
        return target
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    with naming(target):
        tmp = _copy_beside(source, target)
    try:
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(target.parent)
    _remove(source)
    return target


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
        if _remove(entry):
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
