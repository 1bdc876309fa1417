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
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import LockedError

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
    """PATH's JSON object, or {} when it is missing; an unreadable one is {} with a warning."""
    from . import ui

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        ui.warn(f"ignoring the unreadable {what} {path} ({type(exc).__name__}); it is treated as absent")
        return {}
    if not isinstance(data, dict):
        ui.warn(f"ignoring the {what} {path}: it is not a JSON object; it is treated as absent")
        return {}
    return data


# --- locks ------------------------------------------------------------------------------

# path -> [FileLock, depth]: locks this process holds (re-entrant per process)
_held: dict[str, list] = {}


def lock_dir() -> Path:
    from .paths import cache_dir

    folder = cache_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def lock_path_for(kind: str, target: Path) -> Path:
    """The lock of a work tree, build dir or output dir: one file per resolved path, in the cache.

    The lock lives in dfbuild's cache, not in TARGET, so a DIR that does not
    exist yet (a first checkout or import) is locked the same way as one that does.
    """
    resolved = str(Path(target).resolve())
    stem = re.sub(r"[^A-Za-z0-9]+", "-", resolved).strip("-")[-40:]
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:16]
    return lock_dir() / f"{kind}-{stem}-{digest}.lock"


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
        from . import ui

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
        try:
            atomic_write_text(info_path, json.dumps({
                "pid": os.getpid(), "command": _command_line(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n", durable=False)
        except OSError:
            pass
        yield
    finally:
        del _held[key]
        lock.release()


@contextmanager
def hold_path(kind: str, target: Path, *, wait: bool = True):
    """Hold the lock of a work tree (kind 'tree'), build dir ('build') or output dir ('out')."""
    words = {"tree": "the work tree", "build": "the build dir", "out": "the output dir"}.get(kind, kind)
    with hold(lock_path_for(kind, target), f"{words} {Path(target).resolve()}", wait=wait):
        yield


# --- temp dirs --------------------------------------------------------------------------


def tmp_root() -> Path:
    from .paths import cache_dir

    folder = cache_dir() / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
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


_TEMP_NAME = re.compile(r"^dfbuild-[a-z]+-(\d+)-")


def sweep_temp() -> list[Path]:
    """Remove temp dirs under CACHE/tmp whose process has gone; return what was removed."""
    removed = []
    try:
        entries = list(tmp_root().iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
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
_steps_done = 0


def fault_point(name: str) -> None:
    """TEST-ONLY hook. With DFBUILD_TEST_STOP_AFTER=N, the Nth call kills this process.

    DFBUILD_TEST_STOP_SIGNAL picks the signal: INT (the default, like Ctrl-C)
    or KILL (like `kill -9`). The fault-injection tests use it to interrupt
    `dfbuild apply` deterministically between any two of its state changes.
    Unset (always, outside the tests), it does nothing.
    """
    global _steps_done
    limit = os.environ.get(STOP_AFTER_ENV)
    if not limit:
        return
    _steps_done += 1
    if _steps_done != int(limit):
        return
    sig = {"INT": signal.SIGINT, "KILL": getattr(signal, "SIGKILL", signal.SIGTERM),
           "TERM": signal.SIGTERM}[os.environ.get(STOP_SIGNAL_ENV, "INT").upper()]
    os.kill(os.getpid(), sig)
    if sig == signal.SIGINT:  # the handler raises KeyboardInterrupt at the next bytecode
        time.sleep(1)
