"""Issue 39, class by class: verify and the state readers under a fuzzer.

Nothing outside the work dir or the cache is removed or written whatever a state
file says; every reader ends in a documented code, never a traceback; verify
passes only what GNU tar, unzip and `sha256sum -c` read the same way. The
synthetic llama.cpp, series and crash world come from test_crash_safety.py, the
fake release from test_release_unit.py (as in test_bad_luck_round3.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dfbuild import journal

from helpers import dfbuild, said
from test_crash_safety import apply_args, assert_fully_patched, fresh_copy, world  # noqa: F401
from test_series import head, template  # noqa: F401  (template: the module fixture world uses)

IN_USE = 15  # errors.LockedError / StateFileError (literal, so that this file also runs against older code)
posix_only = pytest.mark.skipif(os.name != "posix", reason="symlinks and FIFOs are POSIX")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    from helpers import private_cache

    return private_cache(tmp_path, monkeypatch)


def no_traceback(result) -> str:
    text = said(result)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text, text
    return text


# --- a crafted journal: nothing outside the tree is removed, and apply refuses it ------------------------------


@posix_only
@pytest.mark.parametrize("op", ["stash", "apply", "checkout"])
def test_a_crafted_journal_branch_never_unlinks_a_file_outside(world, tmp_path, op):
    """The issue's journal: a stash journal whose branch climbs out of .git/refs/heads to a user's file."""
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    victim = tmp_path / "x" / "victim.lock"
    victim.parent.mkdir()
    victim.write_text("a user's file\n")
    climb = os.path.relpath(victim.with_suffix(""), dest / ".git" / "refs" / "heads")
    record = {"op": op, "pid": 999999, "branch": climb}
    if op == "apply":
        record.update(original_head=head(dest), paths=[])
    elif op == "checkout":
        record.update(commit=head(dest))
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps(record))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert victim.read_text() == "a user's file\n"
    assert result.exit_code == IN_USE, text
    assert str(journal.journal_path(dest)) in text and "branch" in text
    assert journal.journal_path(dest).exists()  # refused, never acted on: the user looks at it
    assert head(dest) != expected


@posix_only
def test_a_300_character_journal_branch_is_refused_not_a_traceback(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps({"op": "checkout", "commit": head(dest), "branch": "b" * 300}))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == IN_USE, text
    assert "branch" in text


@posix_only
@pytest.mark.parametrize("field", ["foreign_locks outside", "unknown key", "stash with paths"])
def test_every_name_a_journal_holds_is_checked_for_every_op(world, tmp_path, field):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    record = {"op": "stash", "pid": 999999}
    if field == "foreign_locks outside":
        record["foreign_locks"] = ["../../../outside.lock"]
    elif field == "unknown key":
        record["rm"] = "-rf /"
    else:
        record["paths"] = ["../outside"]
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps(record))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == IN_USE, text
    assert "journal" in text


@posix_only
def test_after_the_user_removes_a_refused_journal_apply_goes_on(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps({"op": "stash", "branch": "../../x"}))
    assert dfbuild(*apply_args(syn, bare, dest)).exit_code == IN_USE
    journal.journal_path(dest).unlink()  # what the hint says

    result = dfbuild(*apply_args(syn, bare, dest))

    assert result.exit_code == 0, said(result)
    assert_fully_patched(dest, syn, expected)
