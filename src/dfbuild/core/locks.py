"""Inter-process locks that say who holds them; the lowest floor (errors and ui only).

`hold` is a filelock held for a whole command. A second command waits and says
who holds it (pid, command, since when), or fails at once with LockedError
(exit 15) when it was asked not to wait. Locks are re-entrant within one
process, so a command may take the lock of a stage it calls. Where a lock
lives is decided above (state.lock_path_for, paths.locked).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from dfbuild.core import readers, ui
from dfbuild.core.errors import LockedError, StateFileError

# the platform test, not a try/except ImportError, so mypy knows which of the two fcntl is (as typeshed does)
if sys.platform == "win32":  # no flock: locks fall back to filelock, and a dir's lock to a file in the cache
    fcntl = None
else:
    import fcntl

# --- opening dfbuild's own state files: never through a symlink, never blocking on a FIFO or a device -----

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SAFE_FLAGS = _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def kind_of(mode: int) -> str:
    """What a file of MODE is, in words (for a refusal)."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return words
    return "not a regular file"


def open_state_file(path: Path, flags: int, what: str, mode: int = 0o644) -> int:
    """A descriptor of dfbuild's own state file PATH (a lock, a journal, a record), opened the safe way.

    The last component is never followed when it is a symlink (O_NOFOLLOW), a
    FIFO or a device never blocks the open (O_NONBLOCK), and anything but a
    regular file is refused with StateFileError (exit 15, naming PATH). A
    directory raises IsADirectoryError, for the caller to treat as it always did.
    O_CREAT makes the file when nothing is there; nothing is ever truncated.
    """
    path = Path(path)
    if not _NOFOLLOW and os.path.islink(path):  # no O_NOFOLLOW (Windows): look first
        raise StateFileError(path, "a symbolic link", what)
    try:
        fd = os.open(path, flags | _SAFE_FLAGS, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise StateFileError(path, "a symbolic link", what) from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, opened to write; or a device with none behind it
            try:
                kind = kind_of(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise StateFileError(path, kind, what) from None
        raise
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if stat.S_ISREG(info.st_mode):
        return fd
    os.close(fd)
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    raise StateFileError(path, kind_of(info.st_mode), what)


def folder_ready(folder: Path, what: str) -> None:
    """Make FOLDER (and its parents); a file, FIFO or device where it (or a parent) belongs is refused with
    StateFileError (exit 15) naming it, never a FileExistsError traceback."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = Path(folder)
        for candidate in (Path(folder), *Path(folder).parents):
            if os.path.lexists(candidate) and not candidate.is_dir():
                blocker = candidate
                break
        try:
            kind = kind_of(os.lstat(blocker).st_mode)
        except OSError:
            kind = "not a directory"
        raise StateFileError(blocker, kind if kind != "not a regular file" else "a file", what) from None


def read_state_bytes(path: Path, what: str) -> bytes:
    """The bytes of dfbuild's state file PATH, opened the safe way (see open_state_file)."""
    fd = open_state_file(path, os.O_RDONLY, what)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def atomic_note(path: Path, text: str) -> None:
    """A best-effort note (a lock's owner): temp file and rename, no fsync; may be lost.

    The temp file is made new (O_EXCL, no symlink followed) and the rename replaces
    whatever sits at PATH (a symlink there is replaced, never followed).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_FLAGS, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


class _Flock:
    """An flock on a regular lock file that is opened the safe way and never truncated (POSIX).

    A symlink, FIFO or device where the lock file belongs is refused (StateFileError).
    Quacks like filelock's lock where dfbuild uses it: acquire(timeout), release().
    """

    def __init__(self, path: str, what: str = "lock file"):
        self.path, self.what = path, what
        self.fd: int | None = None

    def acquire(self, timeout: float = -1) -> None:
        try:
            fd = open_state_file(Path(self.path), os.O_RDWR | os.O_CREAT, self.what)
        except IsADirectoryError:  # a folder where the lock file belongs: maybe someone's, never removed here
            raise StateFileError(Path(self.path), "a directory", self.what) from None
        try:
            if timeout is not None and timeout < 0:
                fcntl.flock(fd, fcntl.LOCK_EX)  # Ctrl-C interrupts it (KeyboardInterrupt)
            else:
                deadline = time.monotonic() + (timeout or 0)
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise Timeout(self.path) from None
                        time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the descriptor releases the flock


def _new_lock(path: str):
    return _Flock(path) if fcntl is not None else FileLock(path, thread_local=False)


# path -> [FileLock, depth]: locks this process holds (re-entrant per process)
_held: dict[str, list] = {}


def _command_line() -> str:
    args = [Path(sys.argv[0]).name if sys.argv else "dfbuild", *sys.argv[1:]]
    if args and args[0] in ("cli.py", "__main__.py", "-m", "-c"):
        args[0] = "dfbuild"
    return " ".join(args)[:200]


def _holder(info_path: Path) -> str:
    try:
        data = readers.loads_json(read_state_bytes(info_path, "lock owner note"))
        return f"pid {int(data['pid'])} ({str(data['command'])[:200]}, since {str(data['since'])[:40]})"
    except (OSError, ValueError, KeyError, TypeError, LockedError):
        return "another dfbuild process"


@contextmanager
def hold(lock_file: Path, what: str, *, wait: bool = True, timeout: float = -1, timeout_error=None):
    """Hold LOCK_FILE for the duration of the block; WHAT names the thing locked in messages.

    Waiting prints who holds the lock. wait=False raises LockedError at once;
    running out of TIMEOUT raises TIMEOUT_ERROR (a DfbuildError) or LockedError.
    """
    # the lock file's own name is never resolved: a symlink there is refused, never followed
    key = str(Path(lock_file).parent.resolve() / Path(lock_file).name)
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    folder_ready(Path(lock_file).parent, "folder of lock files")
    info_path = Path(key + ".owner")
    lock = _new_lock(key)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = _holder(info_path)
        if not wait:
            raise LockedError(f"{what} is in use by {holder}; --no-wait given, so nothing was done",
                              "wait for that command to finish, or run again without --no-wait") from None
        ui.info(f"waiting for {what}: it is in use by {holder} (Ctrl-C to stop waiting)")
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            if timeout_error is not None:
                raise timeout_error from None
            raise LockedError(f"{what} is still in use by {_holder(info_path)} after {timeout:.0f}s",
                              "wait for that command to finish; the lock is released when it ends") from None
    _held[key] = [lock, 1]
    try:
        atomic_note(info_path, json.dumps({
            "pid": os.getpid(), "command": _command_line(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        yield
    finally:
        del _held[key]
        lock.release()




class adopt:
    """Take the lock file LOCK_FILE (in a tree about to be renamed) and count it as held under FINAL_PATH.

    A context manager; entering it cannot wait: nobody else knows the new tree yet.
    """

    def __init__(self, lock_file: Path, final_path: Path):
        self.lock = _new_lock(str(lock_file))
        self.key = str(final_path)

    def __enter__(self):
        self.lock.acquire(timeout=0)
        _held[self.key] = [self.lock, 1]
        return self

    def __exit__(self, *exc):
        _held.pop(self.key, None)
        self.lock.release()
        return False


def _hold_dir(folder: Path, what: str, *, wait: bool = True, note: Path | None = None):
    """flock FOLDER itself (no file is made in it) for the duration of the block; WHAT names it in messages.

    NOTE (a file elsewhere, e.g. in the cache) tells a waiter who holds it.
    """
    # a directory only (a FIFO or a device there must neither block nor be locked instead)
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(note) if note else "another dfbuild process"
            if not wait:
                raise LockedError(f"{what} is in use by {holder}; --no-wait given, so nothing was done",
                                  "wait for that command to finish, or run again without --no-wait") from None
            ui.info(f"waiting for {what}: it is in use by {holder} (Ctrl-C to stop waiting)")
            fcntl.flock(fd, fcntl.LOCK_EX)
        if note:
            note.parent.mkdir(parents=True, exist_ok=True)
            atomic_note(note, json.dumps({"pid": os.getpid(), "command": _command_line(),
                                          "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


hold_dir = contextmanager(_hold_dir) if fcntl is not None else None
