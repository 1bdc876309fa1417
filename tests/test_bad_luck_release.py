"""Issue 13, the release side: verify never runs a binary it should not, and output dirs are not clobbered.

Uses the fake build, fake wheel and stubbed stages of test_release_unit.py.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import zeros
from test_release_unit import fake_wheel, inputs, posix_only, run_package, stub_stages, write_full_release  # noqa: F401

from dfbuild.build import tree as build
from dfbuild.cli import main
from dfbuild.core import owned, paths
from dfbuild.core.errors import BuildDirMismatchError, FixtureError, ReleaseError
from dfbuild.release import pipeline as release
from dfbuild.verify import release_dir as verify


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def said(result) -> str:
    """What the user read: the result (stdout) and the talk (stderr)."""
    return " ".join((result.stdout + "\n" + result.stderr).split())


def _repack(archive: Path, root: str, tmp: Path, server_script: str) -> None:
    """Rewrite ARCHIVE with another llama-server, as an attacker would."""
    unpacked = tmp / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    server = unpacked / root / "llama-server"
    server.write_text(server_script)
    server.chmod(0o755)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(unpacked / root, arcname=root)


@pytest.fixture
def out_dir(inputs, fake_wheel, tmp_path):
    out = tmp_path / "out"
    rel = write_full_release(inputs, out)
    return out, rel


# --- item 4: verify runs nothing from an archive that failed a check ----------------------------------


@posix_only
@pytest.mark.parametrize("sums", ["stale", "regenerated"])
def test_item4_tampered_archive_is_never_executed(out_dir, tmp_path, sums):
    out, rel = out_dir
    ran = tmp_path / "it-ran"
    _repack(out / rel["archive"], rel["root"], tmp_path,
            f'#!/bin/sh\ntouch "{ran}"\necho "version: 1 (build 1, commit {rel["files"][0]["sha256"][:12]})"\n')
    if sums == "regenerated":  # the attacker also fixed SHA256SUMS: the archive's own manifest still catches it
        release.write_sha256sums(out, [rel["archive"]])
    for flags in ((), ("--run",)):
        result = invoke("verify", out, *flags)
        assert result.exit_code == 51
        assert not ran.exists(), f"verify {' '.join(flags)} ran the tampered llama-server"
    report = verify.verify(out, run_binaries=True)
    assert any("not run: " in n for n in report["checked"] + report["problems"])
    assert not ran.exists()


@posix_only
def test_item4_an_archive_dfbuild_did_not_package_is_run_only_on_request(out_dir, tmp_path, monkeypatch):
    out, rel = out_dir
    foreign = tmp_path / "downloaded"
    shutil.copytree(out, foreign)
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "another-users-cache"))

    report = verify.verify(foreign)
    assert report["ok"], report["problems"]
    assert any("dfbuild did not package this archive here (pass --run" in n for n in report["checked"])
    assert not any("--version names the patched commit" in n for n in report["checked"])

    result = invoke("verify", foreign, "--run")
    assert result.exit_code == 0, said(result)
    assert "--version names the patched commit" in said(result)


# --- item 6: output dirs -----------------------------------------------------------------------------


def test_item6_fixtures_never_replace_a_users_file(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "image-small-32x32.png").write_bytes(b"my holiday photo")
    result = invoke("fixtures", "--out", out)
    assert result.exit_code == FixtureError.exit_code
    assert "was not written by dfbuild; refusing to overwrite it" in said(result)
    assert (out / "image-small-32x32.png").read_bytes() == b"my holiday photo"
    assert sorted(p.name for p in out.iterdir()) == ["image-small-32x32.png"]


def test_item6_sha256sums_of_the_user_is_not_rewritten(tmp_path):
    out = tmp_path / "dist"
    out.mkdir()
    (out / "SHA256SUMS").write_text(f"{'a' * 64}  my-other-file.iso\n")
    (out / "x.tar.gz").write_bytes(b"x")
    with pytest.raises(ReleaseError) as caught:
        release.write_sha256sums(out, ["x.tar.gz"])
    assert "SHA256SUMS exists and was not written by dfbuild" in caught.value.message
    assert (out / "SHA256SUMS").read_text() == f"{'a' * 64}  my-other-file.iso\n"


@posix_only
def test_item6_release_refuses_a_users_manifest_before_building(inputs, stub_stages, tmp_path):
    out = tmp_path / "dist"
    out.mkdir()
    (out / "manifest.json").write_text('{"mine": true}\n')
    result = invoke("release", "--base", "b10359", "--backend", "cpu", "--out", out, "--work", tmp_path / "work",
                    "--skip-smoke")
    assert result.exit_code == ReleaseError.exit_code
    assert "manifest.json exists and was not written by dfbuild" in said(result)
    assert (out / "manifest.json").read_text() == '{"mine": true}\n'
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


@posix_only
def test_item6_release_reruns_into_its_own_out_dir(inputs, stub_stages, tmp_path):
    out, work = tmp_path / "dist", tmp_path / "work"
    for _ in range(2):
        result = invoke("release", "--base", "b10359", "--backend", "cpu", "--out", out, "--work", work,
                        "--skip-smoke")
        assert result.exit_code == 0, said(result)
    assert "SHA256SUMS" in owned.owned_names(out) and "manifest.json" in owned.owned_names(out)


def test_item6_fresh_deletes_only_a_build_dir_dfbuild_stamped(tmp_path):
    theirs = tmp_path / "other-project-build"
    theirs.mkdir()
    (theirs / "CMakeCache.txt").write_text("CMAKE_HOME_DIRECTORY:INTERNAL=/home/me/other\n")
    (theirs / "weeks-of-work.o").write_text("x")
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    with pytest.raises(BuildDirMismatchError) as caught:
        build.claim_build_dir(theirs, "cpu", source_dir, reconfigure=False, fresh=True)
    assert "no dfbuild stamp" in caught.value.message
    assert (theirs / "weeks-of-work.o").exists()


# --- items 10 and 12, verify's side ----------------------------------------------------------------------


def _sums_for(out: Path, *names: str) -> None:
    (out / "SHA256SUMS").write_text("".join(f"{paths.sha256_file(out / n)}  {n}\n" for n in names))


def test_item10_verify_does_not_read_a_huge_member_into_memory(tmp_path):
    out = tmp_path / "dist"
    out.mkdir()
    archive = out / "llama-b1-dflash-bin-ubuntu-cpu-x64.tar.gz"
    size = 80 << 20
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("llama-b1-dflash-bin-ubuntu-cpu-x64/zeros")
        info.size = size

        tar.addfile(info, zeros(size))
    _sums_for(out, archive.name)
    report = verify.verify(out, run_binaries=False)
    assert any("times its size" in p for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("case", ["list", "artifacts-not-dicts", "release-a-string", "sums-not-utf8"])
def test_item12_verify_wrong_shapes_are_51(tmp_path, case):
    out = tmp_path / "dist"
    out.mkdir()
    (out / "a.whl").write_bytes(b"not really")
    _sums_for(out, "a.whl")
    manifests = {"list": [1, 2], "artifacts-not-dicts": {"release": {"artifacts": ["a.whl"]}},
                 "release-a-string": {"release": "yes"}}
    if case == "sums-not-utf8":
        (out / "SHA256SUMS").write_bytes(b"\xff\xfe  a.whl\n")
    else:
        (out / "manifest.json").write_text(json.dumps(manifests[case]))
    result = invoke("verify", out, "--no-run")
    assert result.exit_code == 51, result.output
    assert "Traceback" not in result.output
