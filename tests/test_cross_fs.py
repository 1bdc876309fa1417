"""Moves across filesystems (issue 47): `release --out` on a tmpfs or a mounted volume, a cache on
another disk. os.replace fails there with EXDEV ("Invalid cross-device link"); state.move copies to a
temp name beside the target, fsyncs and renames, and every move dfbuild makes goes through it.

Three layers: a unit test that makes os.replace fail with EXDEV (any machine), the same moves onto a
real second filesystem (a tmpfs this test mounts; root only), and a check on the source that no
module moves a file another way. The release itself onto a tmpfs is test_release_e2e's
test_a_release_to_another_filesystem_verifies.
"""

from __future__ import annotations

import ast
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild.core import state

SRC = Path(__file__).resolve().parents[1] / "src" / "dfbuild"
# the two modules that may call os.replace: state (move and its atomic writes: a temp file beside
# the target) and locks, below state, whose owner notes are written the same way
RENAMERS = {"core/state.py", "core/locks.py"}


@pytest.fixture
def exdev(monkeypatch):
    """os.replace as it behaves across two filesystems: EXDEV between DIR "a" and anything else."""
    real = os.replace
    calls = []

    def replace(src, dst, *args, **kwargs):
        calls.append((Path(src), Path(dst)))
        if "fs-a" in Path(src).parts and "fs-a" not in Path(dst).parts:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def tree(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "fs-a", tmp_path / "fs-b"
    a.mkdir()
    b.mkdir()
    return a, b


def test_a_file_moves_across_devices_whole_with_its_mode(tmp_path, exdev):
    a, b = tree(tmp_path)
    source = a / "llama.whl"
    source.write_bytes(b"wheel" * 1000)
    source.chmod(0o640)
    (b / "llama.whl").write_bytes(b"old")
    assert state.move(source, b / "llama.whl") == b / "llama.whl"
    assert (b / "llama.whl").read_bytes() == b"wheel" * 1000
    assert (b / "llama.whl").stat().st_mode & 0o777 == 0o640
    assert not source.exists()
    assert sorted(p.name for p in b.iterdir()) == ["llama.whl"], "a temp file was left beside the target"
    # the copy was renamed into place from beside the target: never a half file at the target's name
    assert any(src.parent == b and dst == b / "llama.whl" for src, dst in exdev)


def test_a_directory_and_a_link_move_across_devices(tmp_path, exdev):
    a, b = tree(tmp_path)
    (a / "dist" / "assets").mkdir(parents=True)
    (a / "dist" / "index.html").write_text("<html>")
    (a / "dist" / "assets" / "app.js").write_text("js")
    (a / "dist" / "latest").symlink_to("index.html")
    (a / "link").symlink_to("elsewhere")
    state.move(a / "dist", b / "dist")
    state.move(a / "link", b / "link")
    assert (b / "dist" / "assets" / "app.js").read_text() == "js"
    assert os.readlink(b / "dist" / "latest") == "index.html"
    assert os.readlink(b / "link") == "elsewhere"
    assert list(a.iterdir()) == []
    assert sorted(p.name for p in b.iterdir()) == ["dist", "link"]


def test_a_failed_copy_leaves_the_target_and_the_source_as_they_were(tmp_path, exdev, monkeypatch):
    a, b = tree(tmp_path)
    (a / "new").write_bytes(b"new")
    (b / "new").write_bytes(b"old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state.shutil, "copy2", full)
    with pytest.raises(OSError):
        state.move(a / "new", b / "new")
    assert (b / "new").read_bytes() == b"old" and (a / "new").read_bytes() == b"new"
    assert sorted(p.name for p in b.iterdir()) == ["new"]


def test_a_directory_copy_that_fails_half_way_leaves_no_half_copy(tmp_path, exdev, monkeypatch):
    a, b = tree(tmp_path)
    (a / "dist").mkdir()
    for name in "xyz":
        (a / "dist" / name).write_text(name)
    copied = []

    def copy_then_full(source, target):
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device")
        copied.append(target)
        return shutil.copyfile(source, target)

    monkeypatch.setattr(state, "_copy_file_durably", copy_then_full)
    with pytest.raises(OSError) as caught:
        state.move(a / "dist", b / "dist")
    assert caught.value.errno == errno.ENOSPC  # what cli.exits turns into exit 16, naming the file
    assert list(b.iterdir()) == [] and sorted(p.name for p in (a / "dist").iterdir()) == ["x", "y", "z"]


def test_other_errors_are_not_taken_for_another_device(tmp_path):
    with pytest.raises(FileNotFoundError):
        state.move(tmp_path / "nothing", tmp_path / "there")


# --- a real second filesystem -----------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs mounted for this test (the second filesystem); skipped where it cannot be mounted."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux; the EXDEV unit tests above cover the move")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (a container without CAP_SYS_ADMIN?): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_moves_onto_a_real_tmpfs(tmp_path, tmpfs):
    assert os.stat(tmp_path).st_dev != os.stat(tmpfs).st_dev
    with pytest.raises(OSError) as raw:  # what dfbuild did before state.move
        (tmp_path / "probe").write_bytes(b"x")
        os.replace(tmp_path / "probe", tmpfs / "probe")
    assert raw.value.errno == errno.EXDEV
    (tmp_path / "w.whl").write_bytes(b"w" * 4096)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "f").write_text("f")
    state.move(tmp_path / "w.whl", tmpfs / "w.whl")
    state.move(tmp_path / "d", tmpfs / "d")
    assert (tmpfs / "w.whl").read_bytes() == b"w" * 4096 and (tmpfs / "d" / "sub" / "f").read_text() == "f"
    assert not (tmp_path / "w.whl").exists() and not (tmp_path / "d").exists()
    assert sorted(p.name for p in tmpfs.iterdir()) == ["d", "w.whl"]


# --- no other way to move a file --------------------------------------------------------------------


def raw_moves(root: Path) -> list[str]:
    """Calls that rename or move a path without state.move: os.replace/os.rename, shutil.move, X.rename()."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in RENAMERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if (owner == "os" and node.func.attr in {"replace", "rename", "renames"}
                    or owner == "shutil" and node.func.attr == "move" or node.func.attr == "rename"):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_move_goes_through_state_move():
    assert raw_moves(SRC) == [], "move files with state.move (it works across filesystems)"


def test_a_raw_move_is_found(tmp_path):
    (tmp_path / "mod.py").write_text("import os, shutil\nos.replace('a', 'b')\nshutil.move('a', 'b')\n"
                                     "from pathlib import Path\nPath('a').rename('b')\n'x'.replace('a', 'b')\n")
    assert raw_moves(tmp_path) == ["mod.py:2", "mod.py:3", "mod.py:5"]

