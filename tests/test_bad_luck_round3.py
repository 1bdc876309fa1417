"""Issue 26, item by item: bad luck, round three.

Curation keeps every byte a user typed, state files (locks, journals, records)
are opened the safe way, the README's codes instead of tracebacks, and verify
reads every byte it vouches for. The synthetic llama.cpp and series come from
test_series.py, the crash world and forked runs from test_crash_safety.py, the
curation's new epoch from test_curator.py, the fake release from
test_release_unit.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dfbuild as dfbuild_package
from dfbuild import journal

from helpers import dfbuild, run_git, said
from test_crash_safety import apply_args, assert_fully_patched, fresh_copy, run_forked, world  # noqa: F401
from test_series import IDS, head, template  # noqa: F401

SRC = Path(dfbuild_package.__file__).resolve().parent.parent  # the dfbuild under test (src/ of this checkout)
IN_USE = 15  # errors.LockedError (literal, so that this file also runs against older code)

posix_only = pytest.mark.skipif(os.name != "posix", reason="symlinks, FIFOs and flock are POSIX")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    from helpers import private_cache

    return private_cache(tmp_path, monkeypatch)


def run_cli(*args, timeout: float = 60, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m dfbuild.cli ARGS` in a process of its own (a hang is a timeout, not a stuck pytest)."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    began = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"dfbuild {' '.join(map(str, args))} still running after {timeout} s") from exc
    return done, time.monotonic() - began


def one_line(text: str) -> str:
    return " ".join(text.split())


# --- item 2: the lock follows no symlink; item 3: a FIFO never hangs -------------------------------------


@posix_only
@pytest.mark.parametrize("kind", ["symlink to a user's file", "dangling symlink"])
def test_item2_a_symlink_at_the_tree_lock_touches_nothing_outside(world, tmp_path, kind):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    victim = tmp_path / "victim.txt"
    if kind == "symlink to a user's file":
        victim.write_bytes(b"a user's file, far from the tree\n")
    lock = dest / ".git" / "dfbuild" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock.exists() or lock.is_symlink():
        lock.unlink()
    lock.symlink_to(victim)

    result = dfbuild(*apply_args(syn, bare, dest))

    if kind == "symlink to a user's file":
        assert victim.read_bytes() == b"a user's file, far from the tree\n"
    else:
        assert not victim.exists() and not victim.is_symlink()
    assert result.exit_code == IN_USE, said(result)
    assert str(lock) in said(result) and "symbolic link" in said(result)
    assert head(dest) != expected  # refused before anything was done


@posix_only
def test_item2_a_fifo_at_the_tree_lock_is_refused_at_once(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    lock = dest / ".git" / "dfbuild" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock.exists():
        lock.unlink()
    os.mkfifo(lock)

    done, took = run_cli(*apply_args(syn, bare, dest), timeout=30)

    assert done.returncode == IN_USE, done.stderr
    assert "Traceback" not in done.stderr and str(lock) in one_line(done.stderr) and "FIFO" in done.stderr
    assert took < 10


@posix_only
def test_item3_a_fifo_at_the_journal_exits_with_a_code_within_10_s(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    os.mkfifo(journal.journal_path(dest))

    done, took = run_cli(*apply_args(syn, bare, dest), timeout=30)

    assert took < 10, took
    assert done.returncode == IN_USE, done.stderr
    assert "Traceback" not in done.stderr
    assert str(journal.journal_path(dest)) in one_line(done.stderr) and "FIFO" in done.stderr
    assert head(dest) != expected  # nothing was done


@posix_only
def test_item2_a_symlinked_journal_is_never_followed(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"op": "apply", "original_head": "f" * 40, "paths": []}))
    journal.journal_path(dest).symlink_to(outside)

    result = dfbuild(*apply_args(syn, bare, dest))

    assert result.exit_code == IN_USE, said(result)
    assert str(journal.journal_path(dest)) in said(result) and "symbolic link" in said(result)
    assert outside.read_text().startswith('{"op": "apply"')


@posix_only
def test_item2_a_fifo_at_the_lock_owner_note_does_not_hang_a_waiter(world, tmp_path):
    """The note saying who holds a lock is read by the one that waits: a FIFO there must not block it."""
    from dfbuild import locks

    note = tmp_path / "lock.owner"
    os.mkfifo(note)
    began = time.monotonic()
    assert locks._holder(note) == "another dfbuild process"
    assert time.monotonic() - began < 5
