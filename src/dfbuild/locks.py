"""Inter-process locks that say who holds them; the lowest floor (errors and ui only).

`hold` is a filelock held for a whole command. A second command waits and says
who holds it (pid, command, since when), or fails at once with LockedError
(exit 15) when it was asked not to wait. Locks are re-entrant within one
process, so a command may take the lock of a stage it calls. Where a lock
lives is decided above (state.lock_path_for, paths.locked).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from . import ui
from .errors import LockedError


def atomic_note(path: Path, text: str) -> None:
    """A best-effort note (a lock's owner): temp file and rename, no fsync; may be lost."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


# path -> [FileLock, depth]: locks this process holds (re-entrant per process)
_held: dict[str, list] = {}


def _command_line() -> str:
    args = [Path(sys.argv[0]).name if sys.argv else "dfbuild", *sys.argv[1:]]
    if args and args[0] in ("cli.py", "__main__.py", "-m", "-c"):
        args[0] = "dfbuild"
    return " ".join(args)[:200]


def _holder(info_path: Path) -> str:
    try:
        data = json.loads(info_path.read_text(encoding="utf-8"))
        return f"pid {data['pid']} ({data['command']}, since {data['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another dfbuild process"


@contextmanager
def hold(lock_file: Path, what: str, *, wait: bool = True, timeout: float = -1, timeout_error=None):
    """Hold LOCK_FILE for the duration of the block; WHAT names the thing locked in messages.

    Waiting prints who holds the lock. wait=False raises LockedError at once;
    running out of TIMEOUT raises TIMEOUT_ERROR (a DfbuildError) or LockedError.
    """
    key = str(Path(lock_file).resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    Path(lock_file).parent.mkdir(parents=True, exist_ok=True)
    info_path = Path(key + ".owner")
    lock = FileLock(key, thread_local=False)
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
        self.lock = FileLock(str(lock_file), thread_local=False)
        self.key = str(final_path)

    def __enter__(self):
        self.lock.acquire(timeout=0)
        _held[self.key] = [self.lock, 1]
        return self

    def __exit__(self, *exc):
        _held.pop(self.key, None)
        self.lock.release()
        return False


try:
    import fcntl
except ImportError:  # Windows: no flock of a directory; state falls back to a lock in the cache
    fcntl = None


def _hold_dir(folder: Path, what: str, *, wait: bool = True, note: Path | None = None):
    """flock FOLDER itself (no file is made in it) for the duration of the block; WHAT names it in messages.

    NOTE (a file elsewhere, e.g. in the cache) tells a waiter who holds it.
    """
    fd = os.open(folder, os.O_RDONLY)
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
