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
from test_crash_safety import apply_args, assert_fully_patched, fresh_copy, run_forked, wait, world  # noqa: F401
from test_curator import HAND_LINE, new_epoch, start  # noqa: F401  (new_epoch: a fixture)
from test_series import IDS, SPEC, head, syn, template  # noqa: F401  (syn, template: fixtures)

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


# --- item 1: curation keeps every byte a user typed ------------------------------------------------------

MY_EDIT = b"// half a thought, typed at 5 pm \xe2\x80\x94 keep it\n"


def _stopped_with_an_edit(syn, tree):
    """A curation stopped for a hand, with an uncommitted edit and a staged new file in the tree."""
    assert start(syn, tree).exit_code == 21
    spec = tree / SPEC
    edited = spec.read_bytes() + MY_EDIT
    spec.write_bytes(edited)
    (tree / "common" / "notes.h").write_bytes(b"// a new file, staged\n")
    run_git(tree, "add", "common/notes.h")
    return edited


def test_item1_abort_saves_the_edit_and_restore_brings_it_back_byte_for_byte(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    edited = _stopped_with_an_edit(syn, tree)
    stopped = head(tree)
    base = run_git(tree, "rev-parse", "b120^{commit}")

    result = dfbuild("series", "continue", "--dir", tree, "--abort")

    assert result.exit_code == 0, said(result)
    assert head(tree) == base and (tree / SPEC).read_bytes() != edited  # aborted, as before
    lines = [line for line in result.stderr.splitlines() if "saved your uncommitted changes" in line]
    assert len(lines) == 1, result.stderr  # one line says where, and how to get it back
    assert f"dfbuild series continue --dir {tree} --restore" in lines[0]
    assert "stash" in run_git(tree, "stash", "list")  # where git users look

    restored = dfbuild("series", "continue", "--dir", tree, "--restore")

    assert restored.exit_code == 0, said(restored)
    assert (tree / SPEC).read_bytes() == edited
    assert (tree / "common" / "notes.h").read_bytes() == b"// a new file, staged\n"
    assert "A  common/notes.h" in run_git(tree, "status", "--porcelain")  # the index too
    assert head(tree) == stopped
    # the curation goes on where it was: commit the hand-written change, continue
    spec = tree / SPEC
    spec.write_text(spec.read_text().replace('        LOG_WRN("pos_max < N-1 (upstream)");', HAND_LINE))
    run_git(tree, "reset", "-q", "common/notes.h")
    run_git(tree, "commit", "-q", "-m", "spec : downgrade", "-m", "Dfbuild-Concern: warning-downgrade", SPEC)
    done = dfbuild("series", "continue", "--dir", tree, "--patches", syn.patches)
    assert done.exit_code == 0, said(done)


def test_item1_the_printed_git_command_restores_the_edit_byte_for_byte(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    edited = _stopped_with_an_edit(syn, tree)

    done, _ = run_cli("series", "continue", "--dir", tree, "--abort")

    assert done.returncode == 0, done.stderr
    text = one_line(done.stderr + done.stdout)
    command = text[text.index("(or `git -C") + len("(or `"):]
    command = command[:command.index("`")]
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    assert (tree / SPEC).read_bytes() == edited


def test_item1_abort_keeps_the_hand_written_commit_too(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    spec = tree / SPEC
    spec.write_text(spec.read_text().replace('        LOG_WRN("pos_max < N-1 (upstream)");', HAND_LINE))
    run_git(tree, "commit", "-q", "-a", "-m", "spec : a day's work", "-m", "Dfbuild-Concern: warning-downgrade")
    mine = head(tree)

    result = dfbuild("series", "continue", "--dir", tree, "--abort")

    assert result.exit_code == 0, said(result)
    assert "refs/dfbuild/saved/" in said(result)
    refs = run_git(tree, "for-each-ref", "--format=%(objectname)", "refs/dfbuild/saved")
    assert refs.split() == [mine]
    assert dfbuild("series", "continue", "--dir", tree, "--restore").exit_code == 0
    assert head(tree) == mine


def test_item1_abort_of_a_clean_stopped_curation_saves_nothing_needless(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    result = dfbuild("series", "continue", "--dir", tree, "--abort")
    assert result.exit_code == 0, said(result)
    # the carried commits are dfbuild's own (remade by the next start): kept anyway, cheaply, as one ref
    assert "saved your uncommitted changes" not in said(result)


# --- item 4: a kill at any point of the curation leaves a state the next command finishes or undoes ------


def _steps_of(args, tmp_path, name) -> list[str]:
    log = tmp_path / f"{name}.steps"
    run_forked(args, env={"DFBUILD_FAULT_LOG": str(log)})
    return log.read_text().splitlines() if log.exists() else []


def _start_args(syn, tree):
    return ("series", "start", "--base", "b120", "--repo", syn.upstream, "--dir", tree, "--patches", syn.patches)


def _no_traceback(result) -> str:
    text = said(result)
    assert result.exception is None or isinstance(result.exception, SystemExit), (text, result.exception)
    assert "Traceback" not in text and "KeyError" not in text and "stopped at None" not in text, text
    return text


DOCUMENTED = {0, 2, 12, 13, 15, 21}


def test_item4_series_start_killed_at_every_step(syn, new_epoch, tmp_path):
    steps = _steps_of(_start_args(syn, tmp_path / "probe"), tmp_path, "start")
    curate_steps = [s for s in steps if s.startswith("curate:")]
    assert len(curate_steps) >= 5 and any(s.startswith("checkout:") for s in steps), steps
    base = run_git(syn.upstream, "rev-parse", "b120^{commit}")
    outcomes = {}
    for number, step in enumerate(dict.fromkeys(steps)):
        for then in ("continue", "abort"):
            tree = tmp_path / f"t{number}-{then}"
            code = run_forked(_start_args(syn, tree), env={"DFBUILD_FAULT": step, "DFBUILD_TEST_STOP_SIGNAL": "KILL"})
            assert code == -signal.SIGKILL, (step, code)
            args = ("series", "continue", "--dir", tree, "--patches", syn.patches,
                    *(["--abort"] if then == "abort" else []))
            result = dfbuild(*args)
            _no_traceback(result)
            assert result.exit_code in DOCUMENTED, (step, then, said(result))
            if (tree / ".git").is_dir():
                recorded = tree / ".git" / "dfbuild" / "curate.json"
                if then == "abort" and result.exit_code == 0:
                    assert head(tree) == base and not recorded.exists(), (step, said(result))
                elif result.exit_code == 21:  # stopped at the concern that needs a hand: a recorded step
                    assert json.loads(recorded.read_text())["head"] == head(tree), step
                    assert run_git(tree, "status", "--porcelain", "--untracked-files=no") == "", step
                # and whatever it said, a start over or a continue from here never meets a KeyError
                again = dfbuild(*_start_args(syn, tree))
                _no_traceback(again)
                assert again.exit_code in DOCUMENTED, (step, then, said(again))
            outcomes[f"{step} / {then}"] = result.exit_code
    assert len(outcomes) >= 2 * len(curate_steps)
    print(f"series start killed at each step, then continue or --abort: {json.dumps(outcomes, indent=1)}")


def test_item4_a_state_without_head_is_finished_or_undone(syn, new_epoch, tmp_path):
    """What an older dfbuild left when killed inside `series start`: the state before its first step."""
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    base = run_git(tree, "rev-parse", "b120^{commit}")
    path = tree / ".git" / "dfbuild" / "curate.json"
    data = json.loads(path.read_text())
    for key in ("head", "waiting", "waiting_detail"):
        data.pop(key)
    path.write_text(json.dumps(data))

    refused = dfbuild("series", "start", "--base", "b120", "--repo", syn.upstream, "--dir", tree,
                      "--patches", syn.patches)
    assert refused.exit_code == 2 and "interrupted" in _no_traceback(refused)
    cont = dfbuild("series", "continue", "--dir", tree, "--patches", syn.patches)
    assert cont.exit_code == 2 and str(path) in _no_traceback(cont) and "head" in said(cont)
    rec = dfbuild("series", "record", "--dir", tree, "--onto", "b120", "--patches", syn.patches)
    assert rec.exit_code == 2 and "interrupted" in _no_traceback(rec)
    aborted = dfbuild("series", "continue", "--dir", tree, "--abort")
    assert aborted.exit_code == 0, _no_traceback(aborted)
    assert head(tree) == base and not path.exists()


def test_item4_abort_killed_at_every_step_loses_nothing(syn, new_epoch, tmp_path):
    probe = tmp_path / "probe"
    _stopped_with_an_edit(syn, probe)
    steps = [s for s in _steps_of(("series", "continue", "--dir", probe, "--abort"), tmp_path, "abort")]
    assert {"save: kept", "abort: saved", "abort: reset"} <= set(steps), steps
    base = run_git(syn.upstream, "rev-parse", "b120^{commit}")
    for number, step in enumerate(dict.fromkeys(steps)):
        tree = tmp_path / f"a{number}"
        edited = _stopped_with_an_edit(syn, tree)
        code = run_forked(("series", "continue", "--dir", tree, "--abort"),
                          env={"DFBUILD_FAULT": step, "DFBUILD_TEST_STOP_SIGNAL": "KILL"})
        assert code == -signal.SIGKILL, (step, code)
        again = dfbuild("series", "continue", "--dir", tree, "--abort")
        assert again.exit_code == 0, (step, _no_traceback(again))
        assert head(tree) == base
        restored = dfbuild("series", "continue", "--dir", tree, "--restore")
        assert restored.exit_code == 0, (step, _no_traceback(restored))
        assert (tree / SPEC).read_bytes() == edited, step


def test_item4_series_record_killed_at_every_step_is_finished_by_the_rerun(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    spec = tree / SPEC
    spec.write_text(spec.read_text().replace('        LOG_WRN("pos_max < N-1 (upstream)");', HAND_LINE))
    run_git(tree, "commit", "-q", "-a", "-m", "spec : downgrade", "-m", "Dfbuild-Concern: warning-downgrade")
    assert dfbuild("series", "continue", "--dir", tree, "--patches", syn.patches).exit_code == 0
    args = ("series", "record", "--dir", tree, "--onto", "b120", "--patches", syn.patches)
    pristine = tmp_path / "pristine-patches"
    import shutil

    shutil.copytree(syn.patches, pristine)
    steps = _steps_of(args, tmp_path, "record")
    assert [s for s in steps if s.startswith("record:")], steps
    expected = (syn.patches / "series.toml").read_text()
    for step in dict.fromkeys(steps):
        shutil.rmtree(syn.patches)
        shutil.copytree(pristine, syn.patches)
        code = run_forked(args, env={"DFBUILD_FAULT": step, "DFBUILD_TEST_STOP_SIGNAL": "KILL"})
        assert code == -signal.SIGKILL, (step, code)
        again = dfbuild(*args)
        assert again.exit_code == 0, (step, _no_traceback(again))
        assert (syn.patches / "series.toml").read_text() == expected, step


# --- try what round three did not: two curations at once, apply on a stopped curation ----------------


def test_two_curations_of_one_tree_at_once(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    first = run_forked(_start_args(syn, tree), start=False)
    second = run_forked(_start_args(syn, tree), start=False)
    codes = sorted([wait(first), wait(second)])
    # one curates (stops for a hand, 21); the other waited for the tree's lock, then found it in progress (2)
    assert codes == [2, 21], codes
    assert json.loads((tree / ".git" / "dfbuild" / "curate.json").read_text())["waiting"] == "warning-downgrade"


def test_apply_or_checkout_while_a_curation_is_stopped_is_refused(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    stopped = head(tree)
    for args in (("apply", "--base", "b120", "--repo", syn.upstream, "--dir", tree, "--patches", syn.patches),
                 ("checkout", "--base", "b120", "--repo", syn.upstream, "--dir", tree)):
        result = dfbuild(*args)
        assert result.exit_code == 2, said(result)
        assert "curation" in said(result) and "in progress" in said(result)
        assert head(tree) == stopped
