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
from helpers import GIT_ENV, dfbuild, run_git, said
from test_crash_safety import apply_args, assert_fully_patched, fresh_copy, run_forked, wait, world  # noqa: F401
from test_curator import hand_edit, new_epoch, start  # noqa: F401  (new_epoch: a fixture)
from test_series import IDS, SPEC, head, syn, template  # noqa: F401  (syn, template: fixtures)

import dfbuild as dfbuild_package
from dfbuild.core import journal

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
    from dfbuild.core import locks

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
    lines = [line for line in result.stdout.splitlines() if "saved your uncommitted changes" in line]
    assert len(lines) == 1, result.stdout  # one line (of the result) says where, and how to get it back
    assert f"dfbuild series continue --dir {tree} --restore" in lines[0]
    assert "stash" in run_git(tree, "stash", "list")  # where git users look

    restored = dfbuild("series", "continue", "--dir", tree, "--restore")

    assert restored.exit_code == 0, said(restored)
    assert (tree / SPEC).read_bytes() == edited
    assert (tree / "common" / "notes.h").read_bytes() == b"// a new file, staged\n"
    assert "A  common/notes.h" in run_git(tree, "status", "--porcelain")  # the index too
    assert head(tree) == stopped
    # the curation goes on where it was: commit the hand-written change, continue
    hand_edit(tree)
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
    hand_edit(tree)
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
    hand_edit(tree)
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


# --- item 5: every promised code, no traceback ------------------------------------------------------------

LONG = "x" * 300


def _clean_exit(result, code: int, *words: str) -> str:
    text = said(result)
    assert result.exit_code == code, (result.exit_code, text, result.exception)
    assert "Traceback" not in text + result.stdout
    for word in words:
        assert word in text, (word, text)
    return text


@pytest.mark.parametrize("how", ["missing", "not git"])
@pytest.mark.parametrize("command", [("series", "continue"), ("series", "continue", "--abort"),
                                     ("series", "record", "--onto", "b1")])
def test_item5_curation_on_a_missing_or_non_git_dir_is_13(tmp_path, how, command):
    folder = tmp_path / "nowhere"
    if how == "not git":
        folder.mkdir()
    result = dfbuild(*command, "--dir", folder)
    _clean_exit(result, 13, str(folder))
    assert not folder.exists() or how == "not git"  # nothing made


@pytest.mark.parametrize("command", [("series", "continue"), ("series", "continue", "--abort"),
                                     ("series", "start", "--base", "b1"), ("apply", "--base", "b1"),
                                     ("checkout", "--base", "b1"), ("import", "x.tar.gz", "--tag", "t")])
@pytest.mark.parametrize("where", ["a 300-byte name", "under a file"])
def test_item5_a_dir_no_file_system_can_hold_is_2(tmp_path, command, where):
    (tmp_path / "file").write_text("a file, not a directory\n")
    folder = tmp_path / LONG if where == "a 300-byte name" else tmp_path / "file" / "sub"
    result = dfbuild(*command, "--dir", folder)
    _clean_exit(result, 2, "--dir")
    assert (LONG[:40] if where == "a 300-byte name" else str(tmp_path / "file")) in said(result)


@posix_only
def test_item5_ctrl_c_in_the_first_tenth_of_a_second_exits_130(tmp_path):
    """A Ctrl-C in the first 0.1 s: 130 once any line of dfbuild has run.

    Before that the interpreter is still starting (site, the editable install's finder, runpy: about 30-40 ms
    here) and Python prints its own traceback; no program can catch a signal there. Such runs are counted
    apart, and no traceback may pass through a dfbuild frame.
    """
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    ours, pythons = [], []
    for delay in (0.01, 0.03, 0.05, 0.07, 0.1):
        proc = subprocess.Popen([sys.executable, "-m", "dfbuild", "track", "--repo", str(tmp_path / "none")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        text = err.decode(errors="replace")
        in_dfbuild = f"{os.sep}dfbuild{os.sep}" in text
        if ("Traceback" in text and not in_dfbuild) or (proc.returncode == -signal.SIGINT and not text.strip()):
            # the interpreter's own start-up, before dfbuild's first line (killed before Python even had its
            # SIGINT handler: -2 and not a word)
            pythons.append((delay, proc.returncode))
            continue
        ours.append((delay, proc.returncode))
        assert "Traceback" not in text and "Aborted!" not in text, (delay, text)
        assert proc.returncode == 130, (delay, proc.returncode, text)
    assert ours, "every Ctrl-C landed in the interpreter's start-up"
    print(f"Ctrl-C in the first 0.1 s: dfbuild's {ours}, the interpreter's own start-up {pythons}")


# --- items 5 and 6: verify reads what it vouches for, and never raises ---------------------------------------

import base64  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import struct  # noqa: E402
import tarfile  # noqa: E402
import zipfile  # noqa: E402

from test_release_unit import fake_wheel, inputs, write_full_release, write_wheel  # noqa: E402, F401

from dfbuild.verify import release_dir as verify  # noqa: E402


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _resign(out: Path) -> None:
    """SHA256SUMS and manifest.json's artifacts made true again after a test changed an artifact, as a forger
    would: so the checks behind them are the ones tested."""
    top = out / "manifest.json"
    full = json.loads(top.read_text())
    for artifact in full["release"]["artifacts"]:
        data = (out / artifact["name"]).read_bytes()
        artifact["sha256"], artifact["size"] = _sha(data), len(data)
    top.write_text(json.dumps(full, indent=2, sort_keys=True))
    (out / "SHA256SUMS").write_text("".join(f"{a['sha256']}  {a['name']}\n" for a in full["release"]["artifacts"]))


def _artifact(out: Path, suffix: str) -> Path:
    return next(p for p in out.iterdir() if p.name.endswith(suffix))


def _edit_release(out: Path, *, members=None, manifest=None) -> None:
    """Rewrite the archive (MEMBERS: a function of [(TarInfo, bytes|None)]) and its manifest (MANIFEST: a function
    of the dict), carry the manifest into manifest.json and the wheel, and re-sign."""
    path = _artifact(out, ".tar.gz")
    with tarfile.open(path) as tar:
        items = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    embedded = None
    if manifest is not None:
        for number, (info, data) in enumerate(items):
            if info.name.endswith("/manifest.json") and info.name.count("/") == 1:
                embedded = json.loads(data)
                manifest(embedded)
                data = json.dumps(embedded, indent=2, sort_keys=True).encode()
                info.size = len(data)
                items[number] = (info, data)
    if members is not None:
        items = members(items)
    with tarfile.open(path, "w:gz") as tar:
        for info, data in items:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    if embedded is not None:
        top = out / "manifest.json"
        full = json.loads(top.read_text())
        for key, value in embedded.items():
            if key != "release":
                full[key] = value
        full["release"].update({k: v for k, v in embedded["release"].items()})
        top.write_text(json.dumps(full, indent=2, sort_keys=True))
        wheel = _artifact(out, ".whl")
        with zipfile.ZipFile(wheel) as zf:
            files = {n: zf.read(n) for n in zf.namelist() if ".dist-info/" not in n}
        for name in files:
            if name.endswith("/manifest.json"):
                files[name] = json.dumps(embedded, indent=2, sort_keys=True).encode()
        write_wheel(wheel, files)
    _resign(out)


@pytest.fixture
def release_dir(inputs, fake_wheel, tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_full_release(inputs, out)
    ran: list[str] = []
    monkeypatch.setattr(verify, "_run_version", lambda path, *args, **kwargs: ran.append(path.name))
    report = verify.verify(out, run_binaries=True)
    assert report["ok"] and ran, report["problems"]  # the positive control: it passes and runs
    ran.clear()
    return out, ran


def _verify_fails(out: Path, ran: list, *words: str) -> str:
    result = dfbuild("verify", out, "--run")
    text = _clean_exit(result, 51, *words)
    assert ran == [], f"verify --run ran {ran} after a failed check"
    return text


@posix_only
@pytest.mark.parametrize("field", ["wheel_dist an int", "wheel_bundled a string", "wheel_bundled of ints",
                                   "build a list", "binaries an int", "files[0].sha256 a list"])
def test_item5_verify_on_crafted_manifest_fields_is_51(release_dir, field):
    out, ran = release_dir

    def craft(manifest):
        rel = manifest["release"]
        if field == "wheel_dist an int":
            rel["wheel_dist"] = 5
        elif field == "wheel_bundled a string":
            rel["wheel_bundled"] = "libssl.so.3"
        elif field == "wheel_bundled of ints":
            rel["wheel_bundled"] = [1, 2]
        elif field == "build a list":
            manifest["build"] = ["bin/llama-server"]
        elif field == "binaries an int":
            manifest["build"]["binaries"] = 7
        else:
            rel["files"][0]["sha256"] = ["0" * 64]

    _edit_release(out, manifest=craft)
    key = {"wheel_dist an int": "wheel_dist", "build a list": "build", "binaries an int": "binaries",
           "files[0].sha256 a list": "sha256"}.get(field, "wheel_bundled")
    _verify_fails(out, ran, key)


def _patch_zip_headers(path: Path, *, flag: int = 0, method: int | None = None) -> None:
    """Set FLAG bits and/or the compression METHOD in every local and central header of a zip (a forgery)."""
    data = bytearray(path.read_bytes())
    for signature, flag_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        at = data.find(signature)
        while at != -1:
            old = struct.unpack_from("<H", data, at + flag_at)[0]
            struct.pack_into("<H", data, at + flag_at, old | flag)
            if method is not None:
                struct.pack_into("<H", data, at + method_at, method)
            at = data.find(signature, at + 4)
    path.write_bytes(bytes(data))


@posix_only
@pytest.mark.parametrize("how", ["encrypted", "deflate64"])
def test_item5_verify_on_an_encrypted_or_deflate64_wheel_is_51(release_dir, how):
    out, ran = release_dir
    wheel = _artifact(out, ".whl")
    _patch_zip_headers(wheel, flag=0x1 if how == "encrypted" else 0, method=9 if how == "deflate64" else None)
    _resign(out)
    _verify_fails(out, ran, "encrypted" if how == "encrypted" else "deflate64")


@posix_only
@pytest.mark.parametrize("how", ["encrypted", "deflate64"])
def test_item5_verify_on_an_encrypted_or_deflate64_zip_archive_is_51(tmp_path, how):
    out = tmp_path / "out"
    out.mkdir()
    archive = out / "llama-t-dflash-bin-win-cpu-x64.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("llama-t-dflash-bin-win-cpu-x64/manifest.json", b"{}")
    _patch_zip_headers(archive, flag=0x1 if how == "encrypted" else 0, method=9 if how == "deflate64" else None)
    (out / "SHA256SUMS").write_text(f"{_sha(archive.read_bytes())}  {archive.name}\n")
    result = dfbuild("verify", out, "--run")
    _clean_exit(result, 51, "encrypted" if how == "encrypted" else "deflate64")


def _wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist() if ".dist-info/" not in n}


@posix_only
@pytest.mark.parametrize("broken", ["garbage RECORD", "RECORD misses a file", "RECORD with a wrong hash",
                                    "RECORD with a wrong size", "RECORD lists a file not there", "no WHEEL",
                                    "no METADATA", "METADATA of another version"])
def test_item6_verify_checks_the_wheel_as_pip_installs_it(release_dir, broken):
    out, ran = release_dir
    wheel = _artifact(out, ".whl")
    files = _wheel_files(wheel)
    dist, version = wheel.name.split("-")[:2]
    info = f"{dist}-{version}.dist-info"

    def row(name, data, size=None, digest=None):
        digest = digest or base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data) if size is None else size}"

    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    whl = b"Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: false\nTag: x\n"
    every = {**files, f"{info}/WHEEL": whl, f"{info}/METADATA": meta}
    first = sorted(files)[0]
    rows = {name: row(name, data) for name, data in every.items()}
    kwargs = {}
    if broken == "garbage RECORD":
        kwargs["record"] = b"\x00\xff garbage, not a CSV \xfe\n\"unterminated"
    elif broken == "RECORD misses a file":
        rows.pop(first)
    elif broken == "RECORD with a wrong hash":
        rows[first] = row(first, files[first], digest="A" * 43)
    elif broken == "RECORD with a wrong size":
        rows[first] = row(first, files[first], size=len(files[first]) + 1)
    elif broken == "RECORD lists a file not there":
        rows["llama_dflash_cpu/bin/not-there"] = row("llama_dflash_cpu/bin/not-there", b"x")
    elif broken == "no WHEEL":
        kwargs["wheel"] = False
        rows.pop(f"{info}/WHEEL")
    elif broken == "no METADATA":
        kwargs["metadata"] = False
        rows.pop(f"{info}/METADATA")
    if "record" not in kwargs and broken != "METADATA of another version":
        kwargs["record"] = ("\n".join([*rows.values(), f"{info}/RECORD,,"]) + "\n").encode()
    write_wheel(wheel, files, **kwargs)
    if broken == "METADATA of another version":  # a consistent RECORD, but METADATA says another version
        with zipfile.ZipFile(wheel) as zf:
            content = {n: zf.read(n) for n in zf.namelist()}
        content[f"{info}/METADATA"] = meta.replace(version.encode(), b"9.9.9")
        write_wheel(wheel, {n: d for n, d in content.items() if ".dist-info/" not in n or n.endswith("METADATA")},
                    metadata=False)
    _resign(out)
    word = {"no WHEEL": "WHEEL", "no METADATA": "METADATA", "METADATA of another version": "METADATA"}.get(broken,
                                                                                                          "RECORD")
    _verify_fails(out, ran, word)


@posix_only
@pytest.mark.parametrize("order", ["a bad copy first, the vetted one last", "the vetted one first, a bad copy last"])
def test_item6_a_tar_with_a_member_twice_fails(release_dir, order):
    out, ran = release_dir

    def doubled(items):
        number, (info, data) = next((n, item) for n, item in enumerate(items)
                                    if item[0].name.endswith("/llama-server"))
        bad = tarfile.TarInfo(info.name)
        bad.size, bad.mode, bad.mtime = len(b"#!/bin/sh\necho evil\n"), info.mode, info.mtime
        item = (bad, b"#!/bin/sh\necho evil\n")
        return [item, *items] if order.startswith("a bad") else [*items, item]

    _edit_release(out, members=doubled)
    _verify_fails(out, ran, "more than once")


@posix_only
def test_item6_a_tar_with_a_symlink_loop_fails(release_dir):
    out, ran = release_dir
    root = []

    def loop(items):
        root.append(items[0][0].name.split("/")[0])
        links = []
        for name, target in (("bin/loop-a", "loop-b"), ("bin/loop-b", "loop-a")):
            info = tarfile.TarInfo(f"{root[0]}/{name}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            links.append((info, None))
        return [*items, *links]

    def listed(manifest):  # the manifest lists the links too, as a forger would
        manifest["release"]["files"] += [{"path": "bin/loop-a", "link": "loop-b"},
                                         {"path": "bin/loop-b", "link": "loop-a"}]

    _edit_release(out, members=loop, manifest=listed)
    _verify_fails(out, ran, "loop")


# --- try what round three did not ---------------------------------------------------------------------------

from test_release_unit import stub_stages  # noqa: E402, F401  (a fixture)


@posix_only
def test_release_killed_at_every_named_step_is_finished_by_the_rerun(inputs, stub_stages, tmp_path):
    def args(n):
        return ("release", "--base", "pydist-0.94.0", "--backend", "cpu", "--out", tmp_path / f"out{n}",
                "--work", tmp_path / f"work{n}", "--skip-smoke")

    steps = [s for s in _steps_of(args("probe"), tmp_path, "release") if s.startswith("release:")]
    assert len(steps) >= 6, steps
    for number, step in enumerate(dict.fromkeys(steps)):
        code = run_forked(args(number), env={"DFBUILD_FAULT": step, "DFBUILD_TEST_STOP_SIGNAL": "KILL"})
        assert code == -signal.SIGKILL, (step, code)
        again = dfbuild(*args(number))
        assert again.exit_code == 0, (step, _no_traceback(again))
        report = verify.verify(tmp_path / f"out{number}", run_binaries=False)
        assert report["ok"], (step, report["problems"])
        assert not [p.name for p in (tmp_path / f"out{number}").iterdir() if p.name.endswith(".tmp")], step


def test_apply_on_a_git_worktree_keeps_its_lock_in_the_worktrees_git_dir(world, tmp_path):
    syn, bare, expected, prepared = world
    main_tree = fresh_copy(prepared, tmp_path / "main")
    worktree = tmp_path / "wt"
    run_git(main_tree, "worktree", "add", "-q", "--detach", str(worktree))

    result = dfbuild(*apply_args(syn, bare, worktree))

    assert result.exit_code == 0, _no_traceback(result)
    assert head(worktree) == expected
    git_dir = Path(run_git(worktree, "rev-parse", "--absolute-git-dir"))
    assert (git_dir / "dfbuild" / "lock").is_file() and (git_dir / "dfbuild" / "manifest.json").is_file()
    assert not (worktree / ".git").is_dir()  # still git's worktree file
    assert dfbuild("series", "check", "--dir", worktree, "--patches", syn.patches).exit_code == 0


def test_apply_on_a_bare_repo_is_13_and_on_a_detached_head_patches(world, tmp_path):
    syn, bare, expected, prepared = world
    result = dfbuild(*apply_args(syn, bare, bare))
    _clean_exit(result, 13, str(bare))
    detached = fresh_copy(prepared, tmp_path / "det")
    run_git(detached, "checkout", "-q", "--detach")
    result = dfbuild(*apply_args(syn, bare, detached))
    assert result.exit_code == 0, _no_traceback(result)
    assert head(detached) == expected


@pytest.mark.parametrize("operation", ["rebase", "merge"])
def test_apply_in_the_middle_of_a_git_rebase_or_merge_is_12_and_touches_nothing(world, tmp_path, operation):
    syn, bare, expected, prepared = world
    tree = fresh_copy(prepared, tmp_path / "mid")
    run_git(tree, "checkout", "-q", "-b", "mine")
    (tree / "CMakeLists.txt").write_text("# mine\n")
    run_git(tree, "commit", "-q", "-am", "mine")
    run_git(tree, "checkout", "-q", "-b", "theirs", "HEAD~1")
    (tree / "CMakeLists.txt").write_text("# theirs\n")
    run_git(tree, "commit", "-q", "-am", "theirs")
    # the tests' git identity: without one (a fresh CI machine) git merge refuses before it starts
    stopped = subprocess.run(["git", "-C", str(tree), *(["rebase", "mine"] if operation == "rebase" else
                                                        ["merge", "mine"])], capture_output=True, text=True,
                             env={**os.environ, **GIT_ENV})
    assert stopped.returncode != 0 and "CONFLICT" in stopped.stdout, stopped  # stopped at the conflict
    before = (run_git(tree, "rev-parse", "HEAD"), (tree / "CMakeLists.txt").read_bytes())

    result = dfbuild(*apply_args(syn, bare, tree, "--force"))

    _clean_exit(result, 12, f"in the middle of a git {operation}")
    assert (run_git(tree, "rev-parse", "HEAD"), (tree / "CMakeLists.txt").read_bytes()) == before
    assert "rebase" not in operation or (tree / ".git" / "rebase-merge").is_dir()


SERIES_CASES = {
    "not TOML": b"garbage = [",
    "not UTF-8": b"\xff\xfe",
    "no bug": b'[bases]\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\n',
    "concern a string": b'bug = "b"\nconcern = "x"\n[bases]\n',
    "id a number": b'bug = "b"\n[bases]\n[[concern]]\nid = 5\ntitle = "t"\nrationale = "r"\n',
    "variants a number": b'bug = "b"\n[bases]\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\nvariants = 3\n',
    "file outside": (b'bug = "b"\n[bases.x]\nblob = "0"\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\n'
                     b'[concern.variants.x]\nfile = "../../../etc/passwd"\nsha256 = "' + b"0" * 64 + b'"\n'),
    "sha256 a number": (b'bug = "b"\n[bases.x]\nblob = "0"\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\n'
                        b'[concern.variants.x]\nfile = "x/1.patch"\nsha256 = 5\n'),
    "a directory": None,
}


@pytest.mark.parametrize("case", sorted(SERIES_CASES))
def test_a_malformed_series_toml_given_with_patches_is_23(world, tmp_path, case):
    syn, bare, expected, prepared = world
    patches = tmp_path / "patches"
    patches.mkdir()
    if SERIES_CASES[case] is None:
        (patches / "series.toml").mkdir()
    else:
        (patches / "series.toml").write_bytes(SERIES_CASES[case])
    tree = fresh_copy(prepared, tmp_path / "llama")
    before = head(tree)
    for args in (("apply", "--base", syn.base_commit, "--repo", bare, "--dir", tree, "--patches", patches),
                 ("series", "list", "--patches", patches),
                 ("series", "check", "--dir", tree, "--patches", patches)):
        result = dfbuild(*args)
        _clean_exit(result, 23, str(patches / "series.toml"))
    assert head(tree) == before


@posix_only
def test_a_fifo_as_series_toml_is_23_at_once(world, tmp_path):
    syn, bare, expected, prepared = world
    patches = tmp_path / "patches"
    patches.mkdir()
    os.mkfifo(patches / "series.toml")
    done, took = run_cli("series", "list", "--patches", patches, timeout=30)
    assert done.returncode == 23 and took < 10, (done.returncode, took, done.stderr)
    assert "Traceback" not in done.stderr


def _python_for_nobody() -> str | None:
    """A Python of this one's version that the user nobody may run (this venv's may sit under /root)."""
    import shutil

    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("runuser"):
        return None
    for candidate in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        probe = subprocess.run(["runuser", "-u", "nobody", "--", candidate, "-c", "import sys"],
                               capture_output=True)
        if probe.returncode == 0:
            return candidate
    return None


# What dfbuild imports from site-packages, found by importing every dfbuild module in a fresh Python.
_FIND_THIRD_PARTY = """
import importlib, pkgutil, site, sys
import dfbuild
for info in pkgutil.walk_packages(dfbuild.__path__, "dfbuild."):
    if not info.name.endswith(".__main__"):  # that one runs the command
        importlib.import_module(info.name)
roots = [p for p in site.getsitepackages() + [site.getusersitepackages()] if p]
seen = set()
for module in list(sys.modules.values()):
    origin = getattr(module, "__file__", None) or ""
    for root in roots:
        if origin.startswith(root + "/"):
            top = origin[len(root) + 1:].split("/", 1)[0]
            if top not in seen:
                seen.add(top)
                print(root + "/" + top)
"""


def _packages_for_nobody(dest: Path) -> Path:
    """A world-readable copy of dfbuild and of the packages it imports from this venv's site-packages.

    CI's venv lives under /root (0700), where nobody cannot read it: pointing PYTHONPATH at it made every
    command a ModuleNotFoundError (exit 1) instead of the exit 16 under test; a clone under /root is the same.
    """
    import shutil

    found = subprocess.run([sys.executable, "-c", _FIND_THIRD_PARTY], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    dest.mkdir(parents=True)
    for line in found.stdout.split():
        source = Path(line)
        if source.name == "dfbuild":  # installed with `pip install .`: dfbuild itself is copied below, once
            continue
        if source.is_dir():
            shutil.copytree(source, dest / source.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest / source.name)
    shutil.copytree(SRC / "dfbuild", dest / "dfbuild", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_a_read_only_cwd_as_a_non_root_user_is_16(world, tmp_path):
    """As nobody, in a directory nobody may not write: every command that makes a DIR there says 16, naming it."""
    import shutil
    import tempfile

    python = _python_for_nobody()
    if python is None:
        pytest.skip("needs root, runuser and a Python the user nobody can run")
    syn, bare, expected, prepared = world
    # outside pytest's 0700 tmp dirs: what nobody reads is copied world-readable, the cwd is root's (0755)
    shared = Path(tempfile.mkdtemp(prefix="dfbuild-round3-"))
    try:
        shared.chmod(0o755)
        shutil.copytree(bare, shared / "upstream.git")
        shutil.copytree(syn.patches, shared / "patches")
        read_only = shared / "read-only"
        read_only.mkdir(mode=0o755)
        home = shared / "home"
        home.mkdir()
        shutil.chown(home, "nobody")
        packages = _packages_for_nobody(shared / "site")
        subprocess.run(["chmod", "-R", "a+rX", str(shared)], check=True)
        path = str(packages)
        env = ["env", f"HOME={home}", f"DFBUILD_CACHE_DIR={home / 'cache'}", f"PYTHONPATH={path}",
               "GIT_CONFIG_NOSYSTEM=1", f"GIT_CONFIG_GLOBAL={home / 'gitconfig'}"]
        (home / "gitconfig").write_text("[safe]\n\tdirectory = *\n")
        common = ["--base", syn.base_commit, "--repo", str(shared / "upstream.git")]
        outcomes = {}
        for args in (["apply", *common, "--patches", str(shared / "patches")],
                     ["apply", *common, "--dir", "rel", "--patches", str(shared / "patches")],
                     ["checkout", *common], ["checkout", *common, "--dir", "rel"],
                     ["series", "start", *common, "--dir", "rel", "--patches", str(shared / "patches")]):
            done = subprocess.run(["runuser", "-u", "nobody", "--", *env, python, "-m", "dfbuild", *args],
                                  capture_output=True, text=True, cwd=read_only, timeout=120)
            outcomes[" ".join(args[:2]) + (" --dir rel" if "rel" in args else "")] = done.returncode
            assert done.returncode == 16, (args, done.returncode, done.stderr[-800:])
            assert "Traceback" not in done.stderr and str(read_only) in one_line(done.stderr), done.stderr
        assert list(read_only.iterdir()) == []
        print(f"read-only cwd as nobody: {outcomes}")
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_full_disk_where_a_new_dir_is_made_is_16(world, tmp_path, monkeypatch):
    import errno

    syn, bare, expected, prepared = world
    real = Path.mkdir

    def no_room(self, *args, **kwargs):
        if self.name.endswith(".dfbuild-partial"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", no_room)
    for args in (apply_args(syn, bare, tmp_path / "new"),
                 ("series", "start", "--base", syn.base_commit, "--repo", bare, "--dir", tmp_path / "cur",
                  "--patches", syn.patches)):
        result = dfbuild(*args)
        _clean_exit(result, 16, "disk is full", ".dfbuild-partial")


@posix_only
def test_item2_a_symlink_at_kept_never_sends_a_users_bytes_outside(world, tmp_path):
    from dfbuild.core import state

    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    code = run_forked(apply_args(syn, bare, dest), env={state.STOP_AFTER_ENV: "4", state.STOP_SIGNAL_ENV: "KILL"})
    assert code == -signal.SIGKILL  # the first concern committed, the journal still there
    edited = json.loads(journal.journal_path(dest).read_text())["paths"][0]
    mine = (dest / edited).read_bytes() + b"// MY EDIT\n"
    (dest / edited).write_bytes(mine)
    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / ".git" / "dfbuild" / "kept").symlink_to(outside)

    result = dfbuild(*apply_args(syn, bare, dest))

    assert result.exit_code == 0, said(result)
    assert list(outside.iterdir()) == []
    kept = list((dest / ".git" / "dfbuild" / "kept").rglob(Path(edited).name))
    assert len(kept) == 1 and kept[0].read_bytes() == mine


def test_apply_killed_at_every_named_step_is_finished_by_the_rerun(world, tmp_path):
    """DFBUILD_FAULT walks apply by name (the crash tests of round one count steps instead)."""
    syn, bare, expected, prepared = world
    steps = _steps_of(apply_args(syn, bare, fresh_copy(prepared, tmp_path / "probe")), tmp_path, "apply")
    assert len([s for s in steps if s.startswith("apply:")]) >= 2 + 2 * len(IDS), steps
    for number, step in enumerate(dict.fromkeys(steps)):
        dest = fresh_copy(prepared, tmp_path / f"d{number}")
        code = run_forked(apply_args(syn, bare, dest), env={"DFBUILD_FAULT": step, "DFBUILD_TEST_STOP_SIGNAL": "KILL"})
        assert code == -signal.SIGKILL, (step, code)
        again = dfbuild(*apply_args(syn, bare, dest))
        assert again.exit_code == 0, (step, _no_traceback(again))
        assert_fully_patched(dest, syn, expected)


def test_item1_abort_never_overwrites_an_untracked_file_in_the_way(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    run_git(tree, "rm", "-q", "CMakeLists.txt")  # the curation deleted a file of the base ...
    run_git(tree, "commit", "-q", "-m", "spec : x", "-m", "Dfbuild-Concern: warning-downgrade")
    (tree / "CMakeLists.txt").write_bytes(b"# the user's own, untracked\n")  # ... and the user made one there

    result = dfbuild("series", "continue", "--dir", tree, "--abort")

    _clean_exit(result, 12, "CMakeLists.txt")
    assert (tree / "CMakeLists.txt").read_bytes() == b"# the user's own, untracked\n"


def test_item1_two_aborts_in_one_second_keep_two_saves(syn, new_epoch, tmp_path, monkeypatch):
    from dfbuild.series import curate

    monkeypatch.setattr(curate.time, "strftime", lambda fmt, *args: "20261202-120000")  # one and the same second
    tree = tmp_path / "curate"
    edits = []
    for number in range(2):
        assert start(syn, tree).exit_code == 21
        spec = tree / SPEC
        spec.write_bytes(spec.read_bytes() + f"// edit {number}\n".encode())
        edits.append(spec.read_bytes())
        assert dfbuild("series", "continue", "--dir", tree, "--abort").exit_code == 0
    refs = run_git(tree, "for-each-ref", "--format=%(refname)", "refs/dfbuild/saved").split()
    assert len(refs) == 2, refs  # neither save overwrote the other
    assert dfbuild("series", "continue", "--dir", tree, "--restore").exit_code == 0
    assert (tree / SPEC).read_bytes() == edits[1]  # the newest first


def test_item5_the_ctrl_c_handler_is_set_before_dfbuild_imports_anything_slow(tmp_path):
    """Deterministic: when the command's first import of the `signal` module begins (its enums take milliseconds,
    and a Ctrl-C there was a traceback through dfbuild's frames), dfbuild's own handler is already in place."""
    probe = (
        "import sys, _signal\n"
        "seen = []\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'signal' and not seen:\n"
        "            seen.append(getattr(_signal.getsignal(_signal.SIGINT), '__name__', '?'))\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "sys.modules.pop('signal', None)\n"
        "sys.argv = ['dfbuild']\n"
        "import dfbuild\n"
        "print(seen[0] if seen else 'signal never imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("_interrupted_early", "signal never imported"), done.stdout
