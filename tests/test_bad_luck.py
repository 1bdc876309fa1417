"""Issue 13, item by item: what an interrupted, doubled or careless run used to break.

Each test names its item. They run the CLI the way a user would, on the
synthetic llama.cpp and four-patch series of test_series.py; the fault
injection and concurrency sweeps are in test_crash_safety.py.
"""

from __future__ import annotations

import json
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock
from helpers import dfbuild, private_cache, run_git, said, write_fake_llama, zeros
from test_crash_safety import run_forked, wait
from test_series import SPEC, bare_upstream, head, snapshot, syn, template, tree  # noqa: F401

from dfbuild import series
from dfbuild.core import gitrun, journal, locks, manifest, paths, state
from dfbuild.core.errors import (
    ArchiveError,
    DirtyTreeError,
    LockedError,
    NotLlamaTreeError,
    PatchConflictError,
    SeriesFileError,
    SourceError,
    UsageError,
)
from dfbuild.source import checkout as source


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


def apply_cmd(syn, bare, dest, *extra):
    return ("apply", "--base", syn.base_commit, "--repo", bare, "--dir", dest, "--patches", syn.patches, *extra)


@pytest.fixture
def applied(syn, tmp_path):
    """A checkout with the series applied through the CLI, and the args that made it."""
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    args = apply_cmd(syn, bare, dest)
    result = dfbuild(*args)
    assert result.exit_code == 0, said(result)
    return dest, args


# --- item 1: the tree's record ---------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b'{"source": {"dir": '])
def test_item1_unreadable_record_is_absent_with_a_warning(applied, content):
    dest, args = applied
    record = manifest.tree_manifest_path(dest)
    record.write_bytes(content)

    for command in (args, ("checkout", *args[1:7]), ("checkout", *args[1:7], "--force")):
        result = dfbuild(*command)
        assert result.exit_code == 0, said(result)
        assert "unreadable manifest" in said(result) or "not a JSON object" in said(result)
        record.write_bytes(content)
    result = dfbuild(*args, "--json")
    assert result.exit_code == 0
    assert json.loads(record.read_text())["series"]["head"] == head(dest)


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b"{", b""])
def test_item1_any_unreadable_record_reads_as_absent(tmp_path, content, capsys):
    path = tmp_path / "manifest.json"
    path.write_bytes(content)
    assert manifest.load(path) == {}
    assert manifest.update_tree_manifest(tmp_path, "source", {"n": 1}) == {"source": {"n": 1}}


def test_item1_record_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    manifest.save({"source": {"n": 1}}, path)

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        manifest.save({"source": {"n": 2}}, path)
    assert json.loads(path.read_text()) == {"source": {"n": 1}}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp file left either


# --- item 2: one lock per tree -----------------------------------------------------------------


def _other_run_holds(dest: Path, seconds: float) -> threading.Thread:
    """Another dfbuild holds DEST's tree lock for SECONDS (from another thread, as if another process)."""
    lock_file = state.lock_path_for("tree", dest)
    taken = threading.Event()
    owner = json.dumps({"pid": 4242, "command": "dfbuild apply --base b10359", "since": "2026-01-01 00:00:00"})

    def other_run():
        if not (dest / ".git").is_dir():  # a DIR not made yet: its maker holds the flock of the parent dir
            with locks.hold_dir(dest.parent, "the parent", note=state.dir_note_path(dest.parent)):
                state.dir_note_path(dest.parent).write_text(owner)
                taken.set()
                time.sleep(seconds)
            return
        lock = FileLock(str(lock_file), thread_local=False)
        with lock.acquire(timeout=5):
            Path(str(lock_file) + ".owner").write_text(owner)
            taken.set()
            time.sleep(seconds)

    thread = threading.Thread(target=other_run)
    thread.start()
    assert taken.wait(5)
    return thread


def test_item2_no_wait_fails_at_once_saying_who_holds_the_tree(syn, tmp_path):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    other = _other_run_holds(dest, 2.0)
    result = dfbuild(*apply_cmd(syn, bare, dest, "--no-wait"))
    other.join()
    assert result.exit_code == LockedError.exit_code == 15
    assert "pid 4242 (dfbuild apply --base b10359" in said(result)
    assert not dest.exists()


def test_item2_a_second_run_waits_and_says_who_holds_the_tree(syn, tmp_path):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    other = _other_run_holds(dest, 1.0)
    result = dfbuild(*apply_cmd(syn, bare, dest))
    other.join()
    assert result.exit_code == 0, said(result)
    assert f"waiting for the work tree {dest}: it is in use by pid 4242" in said(result)
    assert len(run_git(dest, "rev-list", f"{syn.base_commit}..HEAD").split()) == 4


# --- item 3: an interrupted first checkout or a stale index.lock ------------------------------------


@pytest.mark.parametrize("step", [1, 2])
def test_item3_checkout_killed_before_dir_is_complete_does_not_block_a_rerun(syn, tmp_path, step):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    args = ("checkout", "--base", syn.base_commit, "--repo", bare, "--dir", dest)
    code = run_forked(args, env={state.STOP_AFTER_ENV: str(step), state.STOP_SIGNAL_ENV: "KILL"})
    assert code == -9
    assert not dest.exists()  # the half-made tree sits beside it, under dfbuild's own name
    for command in (args, (*args, "--force")):
        result = dfbuild(*command)
        assert result.exit_code == 0, said(result)
    assert head(dest) == syn.base_commit
    assert not source.staging_dir(dest).exists()


def test_item3_stale_index_lock_and_half_applied_series_are_dfbuilds_own(applied, syn, tmp_path):
    dest, args = applied
    fresh = tmp_path / "again"
    again = apply_cmd(syn, args[4], fresh)
    assert dfbuild("checkout", *again[1:7]).exit_code == 0
    code = run_forked(again, env={state.STOP_AFTER_ENV: "4", state.STOP_SIGNAL_ENV: "KILL"})
    assert code == -9
    (fresh / ".git" / "index.lock").write_text("")  # what a git killed with us leaves

    result = dfbuild(*again)
    assert result.exit_code == 0, said(result)
    assert "local changes" not in said(result) and "regenerate" not in said(result)
    assert "was interrupted" in said(result)
    assert head(fresh) == head(dest)


# --- item 5: rollback restores only what dfbuild changed ---------------------------------------------


def test_item5_rollback_keeps_files_the_user_made_during_the_apply(syn, tree, monkeypatch):
    before = snapshot(tree)
    real_git = gitrun.run

    def user_works_meanwhile(where, *args, **kwargs):
        if "apply" in args and "--index" in args and args[-1].endswith("0003-noise-block-base.patch"):
            (Path(where) / "mine").mkdir()
            (Path(where) / "mine" / "draft.txt").write_text("my work\n")
            (Path(where) / SPEC).write_text("// not what the patch expects\n")
        return real_git(where, *args, **kwargs)

    monkeypatch.setattr(gitrun, "run", user_works_meanwhile)
    with pytest.raises(PatchConflictError):
        series.apply_series(series.load_series(syn.patches), tree)
    assert (tree / "mine" / "draft.txt").read_text() == "my work\n"
    (tree / "mine" / "draft.txt").unlink()
    (tree / "mine").rmdir()
    assert snapshot(tree) == before
    assert not journal.journal_path(tree).exists()


# --- item 7: names --------------------------------------------------------------------------


def _tiny_archive(tmp_path: Path) -> Path:
    src = tmp_path / "pkg-src" / "pkg-1.0" / "vendor" / "llama.cpp"
    write_fake_llama(src)
    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(tmp_path / "pkg-src" / "pkg-1.0", arcname="pkg-1.0")
    return archive


@pytest.mark.parametrize("tag", ["x/../../../evil_tag", "a..b", "ok.lock", "x/.hidden", "a//b", "-rf", "a b"])
def test_item7_bad_tag_refused_before_anything_is_written(tag, tmp_path, monkeypatch):
    archive = _tiny_archive(tmp_path)
    work = tmp_path / "deep" / "er" / "cwd"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = sorted(p for p in tmp_path.rglob("*") if "cache" not in p.parts)
    result = dfbuild("import", archive, "--tag", tag)
    assert result.exit_code == ArchiveError.exit_code
    assert "is not a valid tag name" in said(result)
    assert sorted(p for p in tmp_path.rglob("*") if "cache" not in p.parts) == before


def test_item7_tag_with_a_slash_makes_one_dir_here(tmp_path, monkeypatch):
    archive = _tiny_archive(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = dfbuild("import", archive, "--tag", "release/b1")
    assert result.exit_code == 0, said(result)
    assert (tmp_path / "llama.cpp-release-b1" / ".git").is_dir()


@pytest.mark.parametrize("base", ["HEAD~3", "main^", "a..b", "x.lock", "@{-1}"])
def test_item7_base_that_cannot_name_a_branch_is_refused_before_cloning(base, syn, tmp_path, own_cache):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", base, "--repo", bare, "--dir", dest)
    assert result.exit_code == UsageError.exit_code == 2
    assert "cannot name a branch" in said(result)
    assert not dest.exists() and not source.staging_dir(dest).exists()
    assert not (own_cache / "repos").exists()


# --- item 8: backup refs ---------------------------------------------------------------------


def test_item8_two_backups_in_one_second_keep_both_commits(syn, tmp_path, monkeypatch):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    checkout = ("checkout", "--base", syn.base_commit, "--repo", bare, "--dir", dest)
    monkeypatch.setattr(time, "time", lambda: 1767225600.5)
    kept = []
    for n in range(2):
        assert dfbuild(*checkout).exit_code == 0
        (dest / f"user{n}.txt").write_text(f"user commit {n}\n")
        run_git(dest, "add", "-A")
        run_git(dest, "commit", "-q", "-m", f"mine {n}")
        kept.append(head(dest))
    assert dfbuild(*checkout).exit_code == 0
    refs = run_git(dest, "for-each-ref", "--format=%(objectname)", "refs/dfbuild/backup/").split()
    assert sorted(refs) == sorted(kept)


# --- item 9: ignored files in the way ----------------------------------------------------------------


@pytest.fixture
def ignored_then_tracked(tmp_path):
    """An upstream whose first commit ignores local.cfg and whose second tracks it."""
    work = tmp_path / "up"
    work.mkdir()
    run_git(work, "init", "-q", "-b", "main")
    write_fake_llama(work)
    (work / ".gitignore").write_text("local.cfg\n")
    run_git(work, "add", "-A")
    run_git(work, "commit", "-q", "-m", "one")
    first = head(work)
    (work / "local.cfg").write_text("upstream default\n")
    run_git(work, "add", "-f", "local.cfg")
    run_git(work, "commit", "-q", "-m", "two")
    return work, first, head(work)


def test_item9_checkout_refuses_to_overwrite_an_ignored_local_file(ignored_then_tracked, tmp_path):
    up, first, second = ignored_then_tracked
    dest = tmp_path / "llama"
    assert dfbuild("checkout", "--base", first, "--repo", up, "--dir", dest).exit_code == 0
    (dest / "local.cfg").write_text("my settings\n")

    result = dfbuild("checkout", "--base", second, "--repo", up, "--dir", dest)
    assert result.exit_code == DirtyTreeError.exit_code
    assert "would overwrite your ignored file local.cfg" in said(result)
    assert (dest / "local.cfg").read_text() == "my settings\n"
    assert head(dest) == first

    forced = dfbuild("checkout", "--base", second, "--repo", up, "--dir", dest, "--force")
    assert forced.exit_code == 0, said(forced)
    assert head(dest) == second
    assert "my settings" in run_git(dest, "show", "stash@{0}^3:local.cfg")


# --- item 10: bounded extraction -------------------------------------------------------------


def _bomb(tmp_path: Path, size: int) -> Path:
    archive = tmp_path / "bomb-1.0.tar.gz"
    src = tmp_path / "bomb-src"
    write_fake_llama(src)
    with tarfile.open(archive, "w:gz", compresslevel=1) as tf:
        tf.add(src, arcname="bomb-1.0")
        info = tarfile.TarInfo("bomb-1.0/zeros.bin")
        info.size = size

        tf.addfile(info, zeros(size))
    return archive


def test_item10_archive_bomb_is_refused_before_unpacking(tmp_path):
    archive = _bomb(tmp_path, 80 << 20)
    assert archive.stat().st_size < 1 << 20
    dest = tmp_path / "llama"
    result = dfbuild("import", archive, "--tag", "t", "--dir", dest)
    assert result.exit_code == ArchiveError.exit_code
    assert "times its size" in said(result) and "--max-unpacked-size" in said(result)
    assert not dest.exists() and not source.staging_dir(dest).exists()


def test_item10_the_cap_can_be_set(tmp_path):
    archive = _tiny_archive(tmp_path)
    dest = tmp_path / "llama"
    small = dfbuild("import", archive, "--tag", "t", "--dir", dest, "--max-unpacked-size", "10")
    assert small.exit_code == ArchiveError.exit_code
    assert "more than the cap of 10" in said(small)
    assert dfbuild("import", archive, "--tag", "t", "--dir", dest, "--max-unpacked-size", "1M").exit_code == 0
    assert dfbuild("import", archive, "--tag", "t", "--dir", tmp_path / "x", "--max-unpacked-size", "lots").exit_code == 2


# --- item 11: temp dirs ---------------------------------------------------------------------------


def test_item11_temp_dirs_of_dead_runs_are_swept(applied, own_cache):
    dest, args = applied
    dead = own_cache / "tmp" / "dfbuild-import-999999999-abcd"
    (dead / "tree").mkdir(parents=True)
    alive = own_cache / "tmp" / f"dfbuild-index-{os.getpid()}-abcd"
    alive.mkdir()
    assert dfbuild(*args).exit_code == 0
    assert not dead.exists()
    assert alive.exists()


def test_item11_import_leaves_nothing_beside_the_tree(tmp_path):
    archive = _tiny_archive(tmp_path)
    parent = tmp_path / "trees"
    parent.mkdir()
    assert dfbuild("import", archive, "--tag", "t", "--dir", parent / "llama").exit_code == 0
    assert [p.name for p in parent.iterdir()] == ["llama"]


# --- item 12: one line and a code, never a traceback ----------------------------------------------------


@pytest.mark.parametrize("case", ["not-utf8", "directory", "base-not-a-table"])
def test_item12_broken_series_toml_is_23(case, tmp_path):
    patches = tmp_path / "patches"
    patches.mkdir()
    if case == "not-utf8":
        (patches / "series.toml").write_bytes(b'bug = "\xff\xfe"\n')
    elif case == "directory":
        (patches / "series.toml").mkdir()
    else:
        (patches / "series.toml").write_text('bug = "x"\n[bases]\nb1 = "blob"\n[[concern]]\nid = "a"\n'
                                             'title = "t"\nrationale = "r"\n')
    result = dfbuild("series", "list", "--patches", patches)
    assert result.exit_code == SeriesFileError.exit_code


def test_item12_ext_transport_is_11(tmp_path):
    marker = tmp_path / "pwned"
    result = dfbuild("checkout", "--base", "abc1234", "--repo", f"ext::sh -c touch% {marker}",
                     "--dir", tmp_path / "llama")
    assert result.exit_code == SourceError.exit_code
    assert not marker.exists()


def test_item12_cache_dir_that_is_a_file(syn, tmp_path, monkeypatch):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    monkeypatch.setenv(paths.CACHE_ENV, str(not_a_dir))
    result = dfbuild("checkout", "--base", syn.base_commit, "--repo", syn.upstream, "--dir", tmp_path / "l")
    assert result.exit_code == UsageError.exit_code
    assert "cannot use" in said(result) and paths.CACHE_ENV in said(result)


def test_item12_series_check_on_a_repo_without_commits(syn, tmp_path):
    empty = tmp_path / "empty"
    write_fake_llama(empty)
    run_git(empty, "init", "-q")
    result = dfbuild("series", "check", "--dir", empty, "--patches", syn.patches)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert "without any commit" in said(result)


def test_item12_two_imports_into_one_new_dir(tmp_path):
    archive = _tiny_archive(tmp_path)
    dest = tmp_path / "llama"
    args = ("import", archive, "--tag", "t", "--dir", dest)
    codes = sorted(wait(p) for p in [run_forked(args, start=False), run_forked(args, start=False)])
    assert codes == [0, NotLlamaTreeError.exit_code]
    assert run_git(dest, "tag") == "t"


# --- item 13: mistakes that passed silently -------------------------------------------------------


def test_item13_duplicate_concern_id_is_23(syn):
    text = (syn.patches / "series.toml").read_text()
    (syn.patches / "series.toml").write_text(text.replace('id = "zero-fill"', 'id = "embedding-skip"'))
    result = dfbuild("series", "list", "--patches", syn.patches)
    assert result.exit_code == SeriesFileError.exit_code
    assert "listed twice" in said(result)


def test_item13_unknown_skip_id_is_refused(syn, tmp_path):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "llama"
    result = dfbuild(*apply_cmd(syn, bare, dest, "--skip", "zero-fil"))
    assert result.exit_code == UsageError.exit_code
    assert "--skip zero-fil" in said(result) and "zero-fill" in said(result)
    assert not dest.exists()


def test_item13_waiting_on_the_cache_lock_says_so(syn, tmp_path, own_cache):
    bare = bare_upstream(syn, tmp_path)
    assert dfbuild("checkout", "--base", syn.base_commit, "--repo", bare, "--dir", tmp_path / "one").exit_code == 0
    (lock_file,) = (own_cache / "repos").glob("*.lock")
    other = FileLock(str(lock_file), thread_local=False)
    other.acquire(timeout=1)
    threading.Timer(1.0, other.release).start()
    result = dfbuild("checkout", "--base", syn.base_commit, "--repo", bare, "--dir", tmp_path / "two")
    assert result.exit_code == 0, said(result)
    assert f"waiting for the cache lock {lock_file}" in said(result)


def test_item13_ctrl_c_exits_130(syn, tmp_path, monkeypatch):
    bare = bare_upstream(syn, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(source, "checkout", interrupted)
    result = dfbuild(*apply_cmd(syn, bare, tmp_path / "llama"))
    assert result.exit_code == 130
    assert "interrupted" in said(result)
