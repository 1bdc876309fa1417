"""`dfbuild release` / `dfbuild verify` on a fake build (fast).

The fake build dir looks like llama.cpp's: bin/llama-server (a shell script that
prints the version stamp) and a shared library with CMake's version links. The
tree is a small git repo with a LICENSE, and the series section names the real
b10359 patch files. The wheel is really built through builder/ with pip and
scikit-build-core, and really installed into a fresh venv.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import private_cache

from dfbuild import series
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest, SmokeOptions
from dfbuild.cli import main
from dfbuild.core import archive, elf
from dfbuild.core.errors import ReleaseError, SmokeFailedError
from dfbuild.core.paths import sha256_file
from dfbuild.host import backends
from dfbuild.release import package as release_package
from dfbuild.release import pipeline as release
from dfbuild.smoke import fixtures
from dfbuild.source import checkout as source
from dfbuild.verify import programs as verify_run
from dfbuild.verify import release_dir as verify

posix_only = pytest.mark.skipif(os.name == "nt", reason="the fake llama-server is a shell script")

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
HOST = backends.current_host()


def _git(tree: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout.strip()


def make_tree(root: Path) -> tuple[Path, str]:
    tree = root / "src"
    (tree / "licenses").mkdir(parents=True)
    (tree / "LICENSE").write_text("MIT License\n\nCopyright (c) llama.cpp authors\n")
    (tree / "licenses" / "LICENSE-jsonhpp").write_text("MIT (json.hpp)\n")
    _git(tree.parent, "init", "-q", str(tree))
    _git(tree, "add", "-A")
    env = dict(os.environ, GIT_AUTHOR_DATE="2000-01-01T00:00:00+0000", GIT_COMMITTER_DATE="2000-01-01T00:00:00+0000")
    subprocess.run([*GIT, "-C", str(tree), "commit", "-q", "-m", "base"], check=True, env=env)
    return tree, _git(tree, "rev-parse", "HEAD")


@functools.lru_cache(maxsize=None)
def fake_libllama() -> bytes:
    """A real (tiny) shared library, built as CMake builds llama.cpp's: soname libllama.so.0, RUNPATH $ORIGIN.

    A real ELF, so the packaging checks (RUNPATH) and auditwheel (manylinux) see what they see in a release.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        return b"\x7fELF fake libllama " * 50
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "llama.c").write_text("int llama_answer(void) { return 42; }\n")
        subprocess.run([compiler, "-shared", "-fPIC", "-o", "libllama.so", "-Wl,-soname,libllama.so.0",
                        "-Wl,--enable-new-dtags,-rpath,$ORIGIN", "llama.c"], cwd=tmp, check=True)
        return (Path(tmp) / "libllama.so").read_bytes()


def make_build_dir(build_dir: Path, commit: str) -> dict:
    bin_dir = build_dir / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"
    server.write_text(f'#!/bin/sh\necho "version: 10359 (build 10359, commit {commit})"\necho "built with fake" >&2\n')
    server.chmod(0o755)
    (bin_dir / "libllama.so.0.2.0").write_bytes(fake_libllama())
    (bin_dir / "libllama.so.0.2.0").chmod(0o755)
    (bin_dir / "libimpl.so").write_bytes(b"\x7fELF fake impl")
    os.symlink("libllama.so.0.2.0", bin_dir / "libllama.so.0")
    os.symlink("libllama.so.0", bin_dir / "libllama.so")
    return {
        "backend": "cpu",
        "host": {"os": HOST.os, "arch": HOST.arch},
        "source_commit": commit,
        "build_number": 10359,
        "build_dir": str(build_dir),
        "flags": {"GGML_NATIVE": "OFF", "LLAMA_BUILD_COMMIT": commit},
        "binaries": ["bin/llama-server"],
        "libraries": ["bin/libimpl.so", "bin/libllama.so", "bin/libllama.so.0", "bin/libllama.so.0.2.0"],
        "up_to_date": False,
        "wall_time_s": 1.0,
    }


def series_section(head: str) -> dict:
    curated = series.load_series()
    concerns = []
    for concern in curated.concerns:
        variant = concern.variants["b10355"]  # pydist-0.94.0's tree is carried by its epoch, b10355's
        concerns.append({"id": concern.id, "status": "applied", "file": variant.file, "sha256": variant.sha256,
                         "detail": "", "commit": head})
    return {"base": "pydist-0.94.0", "patches_dir": str(curated.root), "concerns": concerns, "head": head, "changed": True}


def make_inputs(tmp_path: Path) -> dict:
    tree, head = make_tree(tmp_path)
    build_section = make_build_dir(tmp_path / "build-cpu", head)
    sections = {
        "source": {"kind": "sdist", "base": "pydist-0.94.0", "commit": head, "dir": str(tree)},
        "series": series_section(head),
        "build": build_section,
        "smoke": {"passed": True, "failed": [], "results": {}},
    }
    return {"tree": tree, "head": head, "sections": sections, "patches_root": series.load_series().root,
            "tmp": tmp_path}


@pytest.fixture
def inputs(tmp_path):
    return make_inputs(tmp_path)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """One real package() run (real wheel through builder/), shared by the tests that only read it."""
    tmp = tmp_path_factory.mktemp("released")
    made = make_inputs(tmp)
    out = tmp / "out"
    rel = write_full_release(made, out)
    return {**made, "rel": rel, "out": out}


@pytest.fixture
def release_copy(released, tmp_path):
    """A copy of the shared release output that a test may tamper with."""
    out = tmp_path / "out"
    shutil.copytree(released["out"], out, symlinks=True)
    return {**released, "out": out}


def fake_build_wheel(*, bin_dir, version, manifest_bytes, license_path, out_dir, work_dir, epoch, backend="cpu",
                     os_name=None):
    """Stands in for pip + scikit-build-core + auditwheel where a test is not about the wheel: same name and layout."""
    package = release.wheel_package(backend)
    plat = "manylinux_2_17_x86_64" if HOST.os == "linux" else "macosx_11_0_arm64"
    path = Path(out_dir) / f"{package}-{version}-py3-none-{plat}.whl"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    launcher = {f"{package}/{p.name}": p.read_bytes() for p in (release.builder_dir() / "src" / release.WHEEL_DIST).glob("*.py")}
    launcher[f"{package}/_version.py"] = f'__version__ = "{version}"\n'.encode()
    write_wheel(path, {**{f"{package}/bin/{file.name}": file.read_bytes() for file in sorted(Path(bin_dir).iterdir())},
                       f"{package}/manifest.json": manifest_bytes, **launcher})
    return path


def write_wheel(path: Path, files: dict[str, bytes], *, record=None, wheel=True, metadata=True) -> Path:
    """A wheel as pip installs it: FILES, and NAME-VERSION.dist-info with WHEEL, METADATA and a RECORD listing
    every file with its sha256 and size. RECORD (bytes) replaces the real one; wheel/metadata False leave one out."""
    import base64
    import hashlib

    dist, version = path.name.split("-")[:2]
    info = f"{dist}-{version}.dist-info"
    files = dict(files)
    if wheel:
        files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: dfbuild-tests\nRoot-Is-Purelib: false\nTag: x\n"
    if metadata:
        files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    rows = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}" for name, data in files.items()]
    files[f"{info}/RECORD"] = record if record is not None else ("\n".join(rows + [f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, (2000, 1, 1, 0, 0, 0)), data)
    return path


@pytest.fixture
def fake_wheel(monkeypatch):
    monkeypatch.setattr(release_package, "build_wheel", fake_build_wheel)  # where package() reads it


def run_package(inputs, out: Path, state=None) -> dict:
    return release.package(inputs["sections"], tree=inputs["tree"], patches_root=inputs["patches_root"], out_dir=out,
                           work_dir=inputs["tmp"] / "work-package", state=state)


def payload(inputs) -> list[archive.Entry]:
    s = inputs["sections"]
    return release.collect_payload(s["build"], inputs["tree"], inputs["patches_root"], s["series"])


# --- names -------------------------------------------------------------------------------


def test_tag_and_wheel_version_name_base_and_series():
    from packaging.version import Version

    section = series_section("0" * 40)
    digest = release.series_hash(section)
    assert len(digest) == 8 and int(digest, 16) >= 0
    assert release.release_tag("pydist-0.94.0", section) == f"pydist-0.94.0-dflash-{digest}"
    assert release.release_tag("5ecbe1ac17ec0484c5b44af0bd580cdc9c428ed4", section) == f"5ecbe1ac17ec-dflash-{digest}"
    assert release.release_tag("b11434", section) == f"b11434-dflash-{digest}"  # llama.cpp's tag first
    version = release.wheel_version(10359, digest, "cpu")
    assert version == f"0.0.10359+dflash.{digest}.cpu"
    assert str(Version(version)) == version  # valid, already normalised PEP 440
    # applied now or already present from an earlier run: the same series
    again = json.loads(json.dumps(section))
    for concern in again["concerns"]:
        concern["status"] = "already-present"
    assert release.series_hash(again) == digest
    # a different patch is a different series
    again["concerns"][0]["sha256"] = "f" * 64
    assert release.series_hash(again) != digest


def test_artifact_name_comes_from_the_matrix_naming_rule(released):
    rel = released["rel"]
    from dfbuild.host import matrix

    assert rel["archive"] == matrix.artifact_name(rel["tag"], HOST.os, "cpu", HOST.arch)
    label = {"linux": "ubuntu", "windows": "win-cpu", "macos": "macos-cpu"}[HOST.os]  # llama.cpp's names
    assert rel["archive"].startswith(f"llama-{rel['tag']}-bin-{label}-{HOST.arch}")


# --- archives ----------------------------------------------------------------------------


@posix_only
def test_archive_is_byte_identical_when_built_twice(released, tmp_path):
    a = released["rel"]
    b = run_package(released, tmp_path / "b")
    archive_a = (released["out"] / a["archive"]).read_bytes()
    archive_b = (tmp_path / "b" / b["archive"]).read_bytes()
    assert archive_a == archive_b
    # gzip header: no mtime, no file name
    assert archive_a[:3] == b"\x1f\x8b\x08"
    assert archive_a[4:8] == b"\0\0\0\0"
    assert not archive_a[3] & 0x08
    # the wheel is reproducible too
    wheel = next(x["name"] for x in a["artifacts"] if x["kind"] == "wheel")
    assert (released["out"] / wheel).read_bytes() == (tmp_path / "b" / wheel).read_bytes()


@posix_only
def test_archive_members_are_sorted_owned_by_root_with_fixed_time_and_modes(inputs, tmp_path):
    entries = payload(inputs)
    path = archive.write_archive(tmp_path / "x.tar.gz", "x", entries, mtime=946684800)
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert all(n == "x" or n.startswith("x/") for n in names)
    assert all(m.mtime == 946684800 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.gname == "" for m in members)
    by_name = {m.name: m for m in members}
    assert by_name["x/llama-server"].mode == 0o755  # llama.cpp's layout: the binaries at the top
    assert by_name["x/LICENSE"].mode == 0o644
    assert "x/bin" not in by_name
    assert by_name["x/libllama.so.0"].issym() and by_name["x/libllama.so.0"].linkname == "libllama.so.0.2.0"
    assert {"x/patches/0001-embedding-skip.patch", "x/patches/series.toml", "x/licenses/LICENSE-jsonhpp"} <= set(names)


@posix_only
def test_a_different_mtime_or_file_changes_the_archive(inputs, tmp_path):
    entries = payload(inputs)
    one = archive.write_archive(tmp_path / "1.tar.gz", "x", entries, mtime=946684800).read_bytes()
    two = archive.write_archive(tmp_path / "2.tar.gz", "x", entries, mtime=946684801).read_bytes()
    assert one != two


@posix_only
def test_zip_is_reproducible_with_modes_and_links_resolved(inputs, tmp_path):
    entries = payload(inputs)
    one = archive.write_archive(tmp_path / "a" / "x.zip", "x", entries, mtime=946684800)
    two = archive.write_archive(tmp_path / "b" / "x.zip", "x", entries, mtime=946684800)
    assert one.read_bytes() == two.read_bytes()
    with zipfile.ZipFile(one) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        assert list(infos) == sorted(infos)
        assert (infos["x/llama-server"].external_attr >> 16) & 0o777 == 0o755
        assert zf.read("x/libllama.so.0") == zf.read("x/libllama.so.0.2.0")
        assert infos["x/LICENSE"].date_time == (2000, 1, 1, 0, 0, 0)


def test_unsafe_member_names_are_recognised():
    for bad in ("/etc/passwd", "../x", "a/../../x", "a/..", "C:/x", "c:\\x", "..\\x", ""):
        assert archive.unsafe_member(bad), bad
    for good in ("a", "a/b", "llama-b1-dflash-bin-linux-cpu-x64/bin/llama-server", "a/..b", "a/b..c"):
        assert archive.unsafe_member(good) is None, good


def test_archiving_refuses_unsafe_names(tmp_path):
    with pytest.raises(ReleaseError, match="'..'"):
        archive.write_archive(tmp_path / "x.tar.gz", "x", [archive.Entry("../evil", data=b"x")], mtime=0)
    with pytest.raises(ReleaseError, match="absolute"):
        archive.write_archive(tmp_path / "x.zip", "x", [archive.Entry("/evil", data=b"x")], mtime=0)


@posix_only
def test_released_archive_members_are_all_safe(released):
    rel = released["rel"]
    with tarfile.open(released["out"] / rel["archive"]) as tar:
        for member in tar.getmembers():
            assert archive.unsafe_member(member.name) is None
            assert member.name.split("/")[0] == rel["root"]
            if member.issym():
                assert "/" not in member.linkname and ".." not in member.linkname


# --- SHA256SUMS, manifest, verify -----------------------------------------------------------


@posix_only
def test_sha256sums_passes_sha256sum_check(release_copy):
    out = release_copy["out"]
    rel = release_copy["rel"]
    text = (out / "SHA256SUMS").read_text()
    names = sorted(a["name"] for a in rel["artifacts"])
    assert [line.split("  ", 1)[1] for line in text.splitlines()] == names
    for artifact in rel["artifacts"]:
        assert f"{artifact['sha256']}  {artifact['name']}\n" in text
        assert hashlib.sha256((out / artifact["name"]).read_bytes()).hexdigest() == artifact["sha256"]
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        (out / rel["archive"]).write_bytes(b"tampered")
        assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out, capture_output=True).returncode != 0


@posix_only
def test_archive_manifest_holds_every_section_and_the_file_list(released):
    inputs, rel = released, released["rel"]
    with tarfile.open(released["out"] / rel["archive"]) as tar:
        embedded = json.load(tar.extractfile(f"{rel['root']}/manifest.json"))
        files = {m.name[len(rel["root"]) + 1:] for m in tar.getmembers() if not m.isdir()}
    assert set(embedded) == {"source", "series", "build", "smoke", "release"}
    assert embedded["series"]["head"] == inputs["head"]
    listed = {f["path"] for f in embedded["release"]["files"]}
    assert listed | {"manifest.json"} == files
    server = next(f for f in embedded["release"]["files"] if f["path"] == "llama-server")
    assert server["sha256"] == sha256_file(Path(inputs["sections"]["build"]["build_dir"]) / "bin/llama-server")
    assert embedded["release"]["source_date_epoch"] == 946684800  # the commit's date
    assert rel["artifacts"][0]["kind"] == "archive" and rel["artifacts"][1]["kind"] == "wheel"
    assert all(a["size"] > 0 and len(a["sha256"]) == 64 for a in rel["artifacts"])


def write_full_release(inputs, out: Path) -> dict:
    rel = run_package(inputs, out)
    full = {**{k: release.portable(v) for k, v in inputs["sections"].items()}, "release": {**rel, "stages": {}}}
    full["release"].pop("reused")
    (out / "manifest.json").write_text(json.dumps(full, indent=2, sort_keys=True))
    return rel


@posix_only
def test_verify_passes_on_good_output_and_runs_the_unpacked_binary(released):
    out = released["out"]
    report = verify.verify(out)
    assert report["ok"], report["problems"]
    assert any("names the patched commit" in note for note in report["checked"])
    result = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"] is True


@posix_only
@pytest.mark.parametrize("which", ["archive", "wheel"])
def test_verify_fails_on_a_one_byte_tamper(release_copy, which):
    out, rel = release_copy["out"], release_copy["rel"]
    name = next(a["name"] for a in rel["artifacts"] if a["kind"] == which)
    data = bytearray((out / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / name).write_bytes(bytes(data))
    report = verify.verify(out, run_binaries=False)
    assert not report["ok"]
    assert any(name in p and "sha256" in p for p in report["problems"]), report["problems"]
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 51, result.output


@posix_only
def test_verify_catches_a_rebuilt_archive_whose_contents_differ_from_its_manifest(release_copy, tmp_path):
    """Tamper inside the archive and regenerate SHA256SUMS: the file list still catches it."""
    out, rel = release_copy["out"], release_copy["rel"]
    archive = out / rel["archive"]
    root = rel["root"]
    unpacked = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(unpacked)
    server = unpacked / root / "llama-server"
    server.write_text(server.read_text().replace("commit", "commit  "))
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(unpacked / root, arcname=root)
    release.write_sha256sums(out, [rel["archive"]])
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any(": llama-server does not match its sha256 in the manifest" in p for p in problems), problems
    assert any("sha256 or size does not match manifest.json" in p for p in problems), problems


@posix_only
def test_verify_checks_the_commit_named_by_the_unpacked_binary(inputs, fake_wheel, tmp_path):
    out = tmp_path / "out"
    inputs["sections"]["series"]["head"] = "1" * 40  # the binary says another commit
    write_full_release(inputs, out)
    report = verify.verify(out)
    assert any("not the patched commit" in p for p in report["problems"]), report["problems"]


def elf_needing_glibc(tmp_path: Path, planted: bytes | None = None) -> bytes:
    """A real shared library that takes memcpy from glibc; PLANTED (e.g. b"GLIBC_2.39") rewrites every
    GLIBC_ version it needs to that one, in place (as a newer build machine would have linked it)."""
    import re

    (tmp_path / "copy.c").write_text("#include <string.h>\nvoid llama_copy(char *d, const char *s, size_t n) "
                                     "{ memcpy(d, s, n); }\n")
    subprocess.run([shutil.which("cc") or "gcc", "-O0", "-shared", "-fPIC", "-o", "libcopy.so",
                    "-Wl,--enable-new-dtags,-rpath,$ORIGIN", "copy.c"], cwd=tmp_path, check=True)
    data = (tmp_path / "libcopy.so").read_bytes()
    if planted:  # the version names in .dynstr, NUL-padded to their own length: the ELF's layout is unchanged
        data = re.sub(rb"GLIBC_2\.[0-9.]+\x00", lambda m: planted.ljust(len(m.group(0)), b"\0"), data)
    return data


@posix_only
@pytest.mark.skipif(not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="needs a C compiler on Linux")
def test_verify_reports_glibc_and_fails_a_wheel_whose_tag_promises_less(inputs, fake_wheel, tmp_path):
    """A library built against glibc 2.39 in a manylinux_2_17 wheel: the tag promises a glibc it does not start on."""
    library = Path(inputs["sections"]["build"]["build_dir"]) / "bin" / "libllama.so.0.2.0"
    honest = elf.read(elf_needing_glibc(tmp_path)).glibc
    assert honest is not None and honest < (2, 39)
    library.write_bytes(elf_needing_glibc(tmp_path, b"GLIBC_2.39"))
    assert elf.read(library).glibc == (2, 39)
    out = tmp_path / "out"
    rel = write_full_release(inputs, out)
    wheel = next(a["name"] for a in rel["artifacts"] if a["kind"] == "wheel")
    assert "manylinux_2_17" in wheel

    report = verify.verify(out, run_binaries=False)
    assert report["glibc"][rel["archive"]]["libllama.so.0.2.0"] == "2.39"
    assert report["glibc"][wheel]["bin/libllama.so.0"] == "2.39"  # the wheel carries it by its soname
    assert any(f"{rel['archive']}: needs glibc 2.39 or newer" in note for note in report["checked"]), report["checked"]
    assert report["problems"] == [f"{wheel}: bin/libllama.so.0 needs GLIBC_2.39, but the tag "
                                  f"{wheel.split('-')[-1][:-4]} promises it runs on glibc 2.17"]
    result = CliRunner().invoke(main, ["verify", str(out), "--no-run"])
    assert result.exit_code == 51, result.output
    assert "needs GLIBC_2.39" in result.output
    assert verify.manylinux_glibc("manylinux_2_39_x86_64") == (2, 39)
    assert verify.manylinux_glibc("manylinux_2_17_x86_64.manylinux2014_x86_64") == (2, 17)


@posix_only
def test_verify_checks_the_stamp_when_the_binary_cannot_run_here(inputs, fake_wheel, tmp_path):
    """A CUDA build on a machine without the driver, or a Windows zip on Linux: the commit must be stamped in."""
    server = Path(inputs["sections"]["build"]["build_dir"]) / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n# LLAMA_COMMIT = %s\n" % inputs["head"] +
                      "echo 'llama-server: error while loading shared libraries: libcuda.so.1: cannot open' >&2\n"
                      "exit 127\n")
    out = tmp_path / "out"
    write_full_release(inputs, out)
    report = verify.verify(out)
    assert report["ok"], report["problems"]
    assert any("needs libcuda.so.1 from the system" in n and "stamped into llama-server" in n
               for n in report["checked"]), report["checked"]
    foreign = backends.Host("windows" if HOST.os != "windows" else "linux", HOST.arch)
    assert any("not run on" in n for n in verify.verify(out, host=foreign)["checked"])

    # no file holds the commit: a problem, whether or not it can run
    server.write_text("#!/bin/sh\necho 'x: error while loading shared libraries: libcuda.so.1: no' >&2\nexit 127\n")
    write_full_release(inputs, tmp_path / "out2")
    problems = verify.verify(tmp_path / "out2")["problems"]
    assert any("no shipped file holds the patched commit" in p for p in problems), problems
    assert not verify.verify(tmp_path / "out2", run_binaries=False)["ok"]


@posix_only
def test_verify_rejects_unsafe_members_and_unlisted_artifacts(release_copy, tmp_path):
    out = release_copy["out"]
    evil = out / "llama-evil-dflash-1-bin-ubuntu-x64.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escape")
        data = b"x"
        info.size = len(data)
        import io

        tar.addfile(info, io.BytesIO(data))
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any("not listed in SHA256SUMS" in p for p in problems)
    release.write_sha256sums(out, [evil.name])
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any("unsafe member" in p and "'..'" in p for p in problems), problems
    assert not (tmp_path / "escape").exists()


@posix_only
def test_verify_fails_every_unlisted_entry_symlinks_too_never_followed(release_copy, tmp_path):
    """Anything in a release dir that SHA256SUMS does not list fails verify (51): a self-referencing
    `loop.tar.gz` symlink, a link to a real archive elsewhere, a directory, a stray file; a listed
    artifact that is a symlink fails too. Links are never followed (a loop would raise ELOOP)."""
    out = release_copy["out"]
    assert verify.verify(out, run_binaries=False)["ok"]
    (out / "loop.tar.gz").symlink_to("loop.tar.gz")
    report = verify.verify(out, run_binaries=False)
    assert not report["ok"]
    assert any("loop.tar.gz" in p and "not listed in SHA256SUMS" in p and "symbolic link" in p
               for p in report["problems"]), report["problems"]
    result = CliRunner().invoke(main, ["verify", str(out), "--no-run"])
    assert result.exit_code == 51, result.output
    (out / "loop.tar.gz").unlink()

    archive_name = release_copy["rel"]["archive"]
    elsewhere = tmp_path / "elsewhere.tar.gz"
    shutil.copy2(out / archive_name, elsewhere)
    for name, make in (("other.tar.gz", lambda p: p.symlink_to(elsewhere)),
                       ("notes", lambda p: p.mkdir()),
                       ("README.txt", lambda p: p.write_text("hello\n"))):
        make(out / name)
        problems = verify.verify(out, run_binaries=False)["problems"]
        assert any(p.startswith(f"{name} ") and "not listed in SHA256SUMS" in p for p in problems), (name, problems)
        shutil.rmtree(out / name) if (out / name).is_dir() and not (out / name).is_symlink() else (out / name).unlink()
    assert verify.verify(out, run_binaries=False)["ok"]

    # listed, but a link: the sum would be of whatever it points at, not of a file of this directory
    (out / archive_name).unlink()
    (out / archive_name).symlink_to(elsewhere)
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any(p.startswith(archive_name) and "symbolic link" in p for p in problems), problems


@posix_only
def test_two_backends_share_one_out_dir_and_verify(inputs, fake_wheel, tmp_path):
    """As in CI's merge job: each entry's artifacts side by side, one SHA256SUMS over all of them."""
    out = tmp_path / "out"
    first = write_full_release(inputs, out)
    first_manifest = (out / "manifest.json").read_bytes()
    inputs["sections"]["build"] = {**inputs["sections"]["build"], "backend": "vulkan"}
    second = write_full_release(inputs, out)
    names = {a["name"] for a in first["artifacts"] + second["artifacts"]}
    assert len(names) == 4  # the backend is in both the archive name and the wheel version
    assert set(release.read_sha256sums(out / "SHA256SUMS")) == names
    report = verify.verify(out)  # one out dir, two releases: manifest.json is the last one's
    assert report["ok"], report["problems"]
    (out / "manifest.json").rename(out / "manifest-vulkan.json")  # a merged dir: one manifest-ID.json per entry
    (out / "manifest-cpu.json").write_bytes(first_manifest)
    assert verify.verify(out)["ok"], verify.verify(out)["problems"]
    (out / "manifest-cpu.json").unlink()  # issue 39: one entry's manifest removed is a problem
    problems = verify.verify(out)["problems"]
    assert any(first["archive"] in p and "described by no manifest-ID.json" in p for p in problems), problems
    (out / "manifest-vulkan.json").unlink()  # none at all: something is missing
    assert not verify.verify(out)["ok"]


def test_verify_without_sha256sums_fails(tmp_path):
    report = verify.verify(tmp_path)
    assert not report["ok"] and "no SHA256SUMS" in report["problems"][0]
    assert CliRunner().invoke(main, ["verify", str(tmp_path)]).exit_code == 51


# --- the wheel ---------------------------------------------------------------------------


@posix_only
def test_wheel_tags_version_and_contents(released):
    inputs, rel = released, released["rel"]
    wheel = next(a["name"] for a in rel["artifacts"] if a["kind"] == "wheel")
    fields = release.parse_wheel_name(wheel)
    assert fields["dist"] == "llama_dflash_cpu"  # one distribution per backend
    assert fields["version"] == rel["wheel_version"] == f"0.0.10359+dflash.{release.series_hash(inputs['sections']['series'])}.cpu"
    assert (fields["python"], fields["abi"]) == ("py3", "none")
    assert fields["platform"] != "any" and HOST.os in ("linux", "macos", "windows")
    if HOST.os == "linux":
        assert fields["platform"].startswith(("linux_", "manylinux")) and fields["platform"].endswith(
            {"x64": "x86_64", "arm64": "aarch64"}[HOST.arch])
    with zipfile.ZipFile(released["out"] / wheel) as zf:
        names = set(zf.namelist())
        info = zf.getinfo("llama_dflash_cpu/bin/llama-server")
        assert (info.external_attr >> 16) & 0o111
        wheel_meta = zf.read(f"llama_dflash_cpu-{fields['version']}.dist-info/WHEEL").decode()
        entry_points = zf.read(f"llama_dflash_cpu-{fields['version']}.dist-info/entry_points.txt").decode()
        embedded = json.loads(zf.read("llama_dflash_cpu/manifest.json"))
        soname = zf.read("llama_dflash_cpu/bin/libllama.so.0")
    assert all(f"Tag: py3-none-{plat}" in wheel_meta for plat in fields["platform"].split("."))
    assert "Root-Is-Purelib: false" in wheel_meta
    assert "llama-server = llama_dflash_cpu:main" in entry_points
    # symlinks resolved: the loader's name (soname) holds the library; no dev link, no duplicate
    bins = {n for n in names if n.startswith("llama_dflash_cpu/bin/") and not n.endswith("/")}
    assert bins == {"llama_dflash_cpu/bin/llama-server", "llama_dflash_cpu/bin/libimpl.so",
                    "llama_dflash_cpu/bin/libllama.so.0"}
    assert soname == fake_libllama()  # auditwheel left the binaries as the archive has them
    assert embedded["series"]["head"] == inputs["head"]


@posix_only
def test_wheel_installs_into_a_fresh_venv_and_runs_llama_server(released, tmp_path):
    inputs, rel = released, released["rel"]
    wheel = released["out"] / next(a["name"] for a in rel["artifacts"] if a["kind"] == "wheel")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--quiet", str(wheel)], check=True)
    result = subprocess.run([str(venv / "bin" / "llama-server"), "--version"], capture_output=True, text=True,
                            env={"PATH": str(venv / "bin") + os.pathsep + os.environ["PATH"]})
    assert result.returncode == 0, result.stderr
    assert f"commit {inputs['head']}" in result.stdout


def test_wheel_platform_tags_map_to_release_hosts():
    assert verify.wheel_platform("linux_x86_64") == ("linux", "x64")
    assert verify.wheel_platform("manylinux_2_28_aarch64") == ("linux", "arm64")
    assert verify.wheel_platform("win_amd64") == ("windows", "x64")
    assert verify.wheel_platform("macosx_14_0_arm64") == ("macos", "arm64")


def test_stage_wheel_bin_keeps_regular_files_under_loader_names(tmp_path):
    entries = [
        archive.Entry("bin/llama-server", 0o755, data=b"exe"),
        archive.Entry("bin/libggml.so", 0o777, link="libggml.so.0"),
        archive.Entry("bin/libggml.so.0", 0o777, link="libggml.so.0.21.0"),
        archive.Entry("bin/libggml.so.0.21.0", 0o755, data=b"ggml"),
        archive.Entry("bin/libggml-cpu-haswell.so", 0o755, data=b"module"),
        archive.Entry("LICENSE", data=b"MIT"),
    ]
    staged = release.stage_wheel_bin(entries, tmp_path / "bin")
    assert sorted(p.name for p in staged.iterdir()) == ["libggml-cpu-haswell.so", "libggml.so.0", "llama-server"]
    assert (staged / "libggml.so.0").read_bytes() == b"ggml" and not (staged / "libggml.so.0").is_symlink()


# --- the pipeline, with the stages stood in for -----------------------------------------------


@pytest.fixture
def stub_stages(inputs, fake_wheel, monkeypatch):
    """checkout/apply/build/smoke replaced by fakes that return the fake build's sections."""
    calls = {"smoke": 0}
    s = inputs["sections"]
    private_cache(inputs["tmp"], monkeypatch)  # smoke counts: no pass remembered by another test

    def fake_checkout(base, *, pr=None, repo=None, dest=None, force=False, keep_descendants=False):
        assert keep_descendants, "release must keep the applied series"
        return {**s["source"], "dir": str(inputs["tree"])}

    def fake_apply(curated, tree, **kwargs):
        return s["series"]

    def fake_build(tree, backend, build_dir, **kwargs):
        return s["build"]

    def fake_smoke(build_dir, fixtures_dir, log_dir, backend="cpu", plan=None):
        calls["smoke"] += 1
        return {"passed": calls.get("smoke_passes", True), "failed": [] if calls.get("smoke_passes", True) else ["image/x"],
                "log_dir": str(log_dir), "results": {}}

    monkeypatch.setattr(source, "checkout", fake_checkout)
    monkeypatch.setattr(series, "apply_series", fake_apply)
    monkeypatch.setattr(build, "build_tree", fake_build)
    monkeypatch.setattr(release, "run_smoke_stage", fake_smoke)
    monkeypatch.setattr(fixtures, "ensure_fixtures", lambda d, seed=0: {"seed": 0, "files": {"t.gguf": {"sha256": "0" * 64}}})
    return calls


@posix_only
def test_a_release_builds_every_tool_unless_told_otherwise(inputs, stub_stages, tmp_path, monkeypatch):
    """As llama.cpp's release workflow, `release` builds `all`; `--target llama-server` a quicker server alone."""
    asked = []
    monkeypatch.setattr(build, "build_tree", lambda tree, request, build_dir=None: asked.append(list(request.targets))
                        or inputs["sections"]["build"])
    for extra, wanted in (([], ["all"]), (["--target", "llama-server"], ["llama-server"])):
        result = CliRunner().invoke(main, ["release", "--base", "pydist-0.94.0", "--backend", "cpu", "--skip-smoke",
                                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra])
        assert result.exit_code == 0, result.output
        assert asked[-1] == wanted
    # a release's proof builds what its smoke runs; the build stage then adds every other tool
    assert release._proof_targets(["all"]) == ["llama-server"]
    assert release._proof_targets(["all", "llama-cli"]) == ["llama-server", "llama-cli"]


@posix_only
def test_the_smoke_key_is_llama_server_and_the_libraries_not_the_other_tools(inputs):
    """A proof's llama-server build and the release's every-tool build of the same code share one smoke pass."""
    section = dict(inputs["sections"]["build"])
    bin_dir = Path(section["build_dir"]) / "bin"
    (bin_dir / "llama-cli").write_text("#!/bin/sh\necho cli\n")
    (bin_dir / "libllama-cli-impl.so").write_bytes(b"\x7fELF cli")  # llama.cpp builds each tool as lib<tool>-impl
    every = {**section, "binaries": ["bin/llama-cli", "bin/llama-server"],
             "libraries": [*section["libraries"], "bin/libllama-cli-impl.so"]}
    assert build.smoke_digest(every) == build.smoke_digest(section)
    assert build.payload_digest(every) != build.payload_digest(section)
    (bin_dir / "llama-cli").write_text("#!/bin/sh\necho other cli\n")
    assert build.smoke_digest(every) == build.smoke_digest(section)
    before = build.smoke_digest(every)
    (bin_dir / "libimpl.so").write_bytes(b"\x7fELF another impl")  # what llama-server loads: a new key
    assert build.smoke_digest(every) != before


@posix_only
def test_skip_smoke_is_recorded_in_every_manifest(inputs, stub_stages, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["release", "--base", "pydist-0.94.0", "--backend", "cpu", "--out", str(out),
                                       "--work", str(tmp_path / "work"), "--skip-smoke", "--json"])
    assert result.exit_code == 0, result.output
    full = json.loads(result.stdout)
    assert full["smoke"] == {"skipped": True}
    assert stub_stages["smoke"] == 0
    assert json.loads((out / "manifest.json").read_text())["smoke"] == {"skipped": True}
    with tarfile.open(out / full["release"]["archive"]) as tar:
        embedded = json.load(tar.extractfile(f"{full['release']['root']}/manifest.json"))
    assert embedded["smoke"] == {"skipped": True}
    assert "NOT smoke-tested" in result.stderr


@posix_only
def test_pipeline_records_stage_times_and_a_rerun_reuses_smoke_and_artifacts(inputs, stub_stages, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    first = release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=out, work=work)
    assert set(first["release"]["stages"]) == set(release.STAGES)
    assert all(isinstance(s["wall_s"], float) for s in first["release"]["stages"].values())
    assert first["smoke"]["passed"] is True and stub_stages["smoke"] == 1
    archive = out / first["release"]["archive"]
    before = archive.read_bytes()
    mtime = archive.stat().st_mtime_ns

    second = release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=out, work=work)
    assert stub_stages["smoke"] == 1, "unchanged binaries and fixtures: smoke must not run again"
    assert second["release"]["stages"]["smoke"]["reused"] and second["release"]["stages"]["package"]["reused"]
    assert archive.read_bytes() == before and archive.stat().st_mtime_ns == mtime
    assert second["release"]["artifacts"] == first["release"]["artifacts"]
    assert verify.verify(out)["ok"]

    # a changed library (the fix lives in one) means new smoke and new artifacts
    lib = Path(inputs["sections"]["build"]["build_dir"]) / "bin" / "libimpl.so"
    lib.write_bytes(b"\x7fELF changed")
    third = release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=out, work=work)
    assert stub_stages["smoke"] == 2
    assert not third["release"]["stages"]["package"]["reused"]
    assert third["release"]["artifacts"][0]["sha256"] != first["release"]["artifacts"][0]["sha256"]
    assert verify.verify(out)["ok"]


@posix_only
def test_the_same_binaries_released_from_another_work_folder_reuse_their_passed_smoke(inputs, stub_stages, tmp_path):
    first = release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=tmp_path / "a" / "out", work=tmp_path / "a" / "work")
    assert stub_stages["smoke"] == 1
    second = release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=tmp_path / "b" / "out", work=tmp_path / "b" / "work")
    assert stub_stages["smoke"] == 1, "the same binaries and fixtures passed smoke already"
    assert second["release"]["stages"]["smoke"]["reused"] and second["smoke"] == first["smoke"]
    assert second["release"]["artifacts"] == first["release"]["artifacts"]
    # other binaries are smoked again
    lib = Path(inputs["sections"]["build"]["build_dir"]) / "bin" / "libimpl.so"
    lib.write_bytes(b"\x7fELF changed")
    release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=tmp_path / "c" / "out", work=tmp_path / "c" / "work")
    assert stub_stages["smoke"] == 2


@posix_only
def test_a_tree_patched_now_or_found_patched_gives_the_same_archive(inputs, stub_stages, monkeypatch, tmp_path):
    # a fresh work folder applies the series now; the proof's work folder finds it already there
    fresh = inputs["sections"]["series"]
    found = {**fresh, "changed": False,
             "concerns": [{**{k: v for k, v in c.items() if k != "commit"}, "status": "already-present",
                           "detail": "already present"} for c in fresh["concerns"]]}
    made = []
    for name, section in (("fresh", fresh), ("found", found)):
        monkeypatch.setattr(series, "apply_series", lambda curated, tree, section=section, **kwargs: section)
        made.append(release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=tmp_path / name / "out", work=tmp_path / name / "work"))
    assert made[0]["release"]["artifacts"] == made[1]["release"]["artifacts"]  # names and sha256
    assert made[0]["series"] == made[1]["series"]
    assert {c["status"] for c in made[0]["series"]["concerns"]} == {"applied"}


@posix_only
def test_failing_smoke_stops_before_packaging(inputs, stub_stages, tmp_path):
    stub_stages["smoke_passes"] = False
    out = tmp_path / "out"
    with pytest.raises(SmokeFailedError, match="image/x"):
        release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=out, work=tmp_path / "work")
    assert not out.exists()
    result = CliRunner().invoke(main, ["release", "--base", "pydist-0.94.0", "--backend", "cpu", "--out", str(out),
                                       "--work", str(tmp_path / "work")])
    assert result.exit_code == SmokeFailedError.exit_code


def test_a_failing_stage_stops_the_pipeline_with_its_own_error(inputs, stub_stages, monkeypatch, tmp_path):
    from dfbuild.core.errors import BuildError

    def broken_build(*args, **kwargs):
        raise BuildError("build failed: x.cpp:1: error: boom", "full log: x")

    monkeypatch.setattr(build, "build_tree", broken_build)
    result = CliRunner().invoke(main, ["release", "--base", "pydist-0.94.0", "--backend", "cpu",
                                       "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert result.exit_code == BuildError.exit_code
    assert "boom" in result.stderr
    assert stub_stages["smoke"] == 0 and not (tmp_path / "out").exists()


@posix_only
def test_two_backends_wheels_in_one_folder_pip_installs_the_named_one(released, tmp_path):
    """One distribution per backend: `pip install llama-dflash-cpu` can only pick the CPU wheel."""
    rel = released["rel"]
    folder = tmp_path / "wheels"
    folder.mkdir()
    cpu = released["out"] / next(a["name"] for a in rel["artifacts"] if a["kind"] == "wheel")
    shutil.copy2(cpu, folder)
    work = tmp_path / "vulkan-work"
    staged = release.stage_wheel_bin(payload(released), work / "bin")
    vulkan = release.build_wheel(bin_dir=staged, version=rel["wheel_version"].replace(".cpu", ".vulkan"),
                                 manifest_bytes=b"{}\n", license_path=None, out_dir=folder, work_dir=work, epoch=0,
                                 backend="vulkan", os_name=HOST.os)
    assert release.parse_wheel_name(vulkan.name)["dist"] == "llama_dflash_vulkan"
    for backend in ("cpu", "vulkan"):
        target = tmp_path / f"site-{backend}"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                        "--disable-pip-version-check", "--find-links", str(folder), "--target", str(target),
                        f"llama-dflash-{backend}"], check=True)
        installed = sorted(p.name.split("-")[0] for p in target.glob("*.dist-info"))
        assert installed == [f"llama_dflash_{backend}"], installed
        assert (target / f"llama_dflash_{backend}" / "bin" / "llama-server").is_file()


def test_windows_cuda_runtime_bundle_is_named_and_laid_out_like_llama_cpps(tmp_path):
    """cudart-llama-bin-win-cuda-12.4-x64.zip (llama.cpp's own name): the runtime DLLs at the top, to unzip next
    to the .exe."""
    cuda = tmp_path / "CUDA" / "v12.4"
    (cuda / "bin").mkdir(parents=True)
    for name in ("cudart64_12.dll", "cublas64_12.dll", "cublasLt64_12.dll", "nvcc.exe", "cufft64_11.dll"):
        (cuda / "bin" / name).write_bytes(b"MZ" + name.encode())
    out = tmp_path / "out"
    bundle = release.cudart_bundle(out, "12.4", "x64", cuda_path=cuda)
    assert bundle.name == "cudart-llama-bin-win-cuda-12.4-x64.zip"
    with zipfile.ZipFile(bundle) as zf:
        assert zf.namelist() == ["cublas64_12.dll", "cublasLt64_12.dll", "cudart64_12.dll"]
    assert release.cudart_bundle(tmp_path / "again", "12.4", "x64", cuda_path=cuda).read_bytes() == bundle.read_bytes()
    with pytest.raises(ReleaseError, match="cudart64"):
        release.cudart_bundle(out, "12.4", "x64", cuda_path=tmp_path)
    # verify checks it through SHA256SUMS only (it has no manifest of its own)
    release.write_sha256sums(out, [bundle.name])
    assert not any("cudart" in p and "manifest" in p for p in verify.verify(out, run_binaries=False)["problems"])


def test_the_archived_manifest_names_no_path_of_this_machine_and_no_timing(released):
    """portable(): what goes into the archive's manifest.json is the same from any work folder."""
    with tarfile.open(released["out"] / released["rel"]["archive"]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/manifest.json"))
        text = tar.extractfile(member).read().decode()
    for local in (str(released["tmp"]), str(Path.home())):
        assert local not in text
    embedded = json.loads(text)
    assert "build_dir" not in embedded["build"] and "wall_time_s" not in embedded["build"]
    assert "dir" not in embedded["source"]
    assert release.portable({"flags": {"CMAKE_C_COMPILER_LAUNCHER": "/usr/bin/ccache"},
                             "repo": "https://github.com/ggml-org/llama.cpp", "compile_s": 3.2}) == {
        "flags": {"CMAKE_C_COMPILER_LAUNCHER": "ccache"}, "repo": "https://github.com/ggml-org/llama.cpp"}


def test_a_hip_build_made_in_the_forky_root_is_named_as_llama_cpps_rocm_build_with_no_wheel(inputs, tmp_path):
    """A hip build from dfbuild's Debian forky root (platforms/rocm_root.py, docs/hip.md): the archive only,
    named -bin-ubuntu-rocm-6.4-x64, and verify says its glibc floor is forky's. The root is not on this
    machine (the test's cache), so the binary is not run: the stamp is checked instead."""
    build_section = inputs["sections"]["build"]
    build_section.update({"backend": "hip", "toolchain": {"hip-clang": "6.4.43484-9999"},
                          "rocm_root": {"name": "debian-forky-rocm-6.4", "path": "/nowhere/debian-forky-rocm-6.4-0",
                                        "suite": "forky", "rocm": {"hipcc": "7.0.2+dfsg-3"}, "glibc": "2.43"}})
    server = Path(build_section["build_dir"]) / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n# LLAMA_COMMIT = %s\nexit 0\n" % inputs["head"])
    out = tmp_path / "out"
    rel = write_full_release(inputs, out)
    names = [a["name"] for a in rel["artifacts"]]
    assert len(names) == 1 and names[0].endswith("-bin-ubuntu-rocm-6.4-x64.tar.gz") and "-dflash-" in names[0], names
    report = verify.verify(out)
    assert report["ok"], report["problems"]
    checked = "\n".join(report["checked"])
    assert "not run: it runs only inside the Debian forky root it was built in" in checked
    assert "stamped into llama-server" in checked
    assert "its glibc floor is forky's (glibc 2.43" in checked and "Ubuntu 22.04 image" in checked


# --- where a GPU release's smoke ran (issue 31) --------------------------------------------------------------

H200 = "Vulkan0: NVIDIA H200 (NVIDIA) (143771 MiB, {free} MiB free)"


@posix_only
def test_a_gpu_release_records_its_device_and_a_cpu_pass_is_not_reused_on_the_gpu(inputs, stub_stages, monkeypatch,
                                                                                  tmp_path):
    """The H200 case: a Vulkan release whose loader saw no device passed smoke on the CPU; once the
    device was there, the rerun reused that pass. Now the first refuses (45) unless asked, says
    where it ran, and the GPU rerun runs the smoke again."""
    from dfbuild import smoke
    from dfbuild.core.errors import NoDeviceError

    inputs["sections"]["build"] = {**inputs["sections"]["build"], "backend": "vulkan"}
    listed: list[str] = []
    monkeypatch.setattr(smoke.devices, "list_devices", lambda binary, env=None, timeout=0: list(listed))

    def fake_smoke(build_dir, fixtures_dir, log_dir, backend="cpu", plan=None):
        stub_stages["smoke"] += 1
        return {"passed": True, "failed": [], "results": {}, "device": plan.device, "ran_on": plan.ran_on,
                "cpu_fallback": plan.cpu_fallback}

    monkeypatch.setattr(release, "run_smoke_stage", fake_smoke)
    out, work = tmp_path / "out", tmp_path / "work"
    with pytest.raises(NoDeviceError):
        release.release("pydist-0.94.0", request=BuildRequest("vulkan"), out=out, work=work)
    assert stub_stages["smoke"] == 0 and not out.exists()

    on_cpu = release.release("pydist-0.94.0", request=BuildRequest("vulkan", smoke=SmokeOptions(allow_cpu_fallback=True)),
                             out=out, work=work)
    assert stub_stages["smoke"] == 1
    assert on_cpu["smoke"]["cpu_fallback"] is True
    assert on_cpu["smoke"]["ran_on"] == "no Vulkan device here, ran on the CPU backend"
    notes = verify.verify(out)["checked"]
    assert any("smoke passed on the CPU backend, not on a vulkan device" in n for n in notes), notes
    said = CliRunner().invoke(main, ["release-notes", str(out), "--base", "b10359"])  # what CI's draft release says
    assert said.exit_code == 0, said.output
    assert said.stdout.startswith("Patched llama.cpp b10359 with the DFlash multimodal fix")
    assert (f"- `{on_cpu['release']['archive']}`: smoke passed on the CPU backend, not on a vulkan device "
            "(no Vulkan device here, ran on the CPU backend); 1 program") in said.stdout
    assert "laid out as llama.cpp's own of the same name" in said.stdout
    assert "did not run on a GPU" in said.stdout

    listed[:] = [H200.format(free=142000)]  # libglvnd installed: the device appears
    on_gpu = release.release("pydist-0.94.0", request=BuildRequest("vulkan"), out=out, work=work)
    assert stub_stages["smoke"] == 2, "a pass on the CPU is no pass on the GPU: smoke runs again"
    assert not on_gpu["release"]["stages"]["smoke"]["reused"]
    assert (on_gpu["smoke"]["device"], on_gpu["smoke"]["cpu_fallback"]) == ("Vulkan0: NVIDIA H200 (NVIDIA)", False)
    with tarfile.open(out / on_gpu["release"]["archive"]) as tar:
        embedded = json.load(tar.extractfile(f"{on_gpu['release']['root']}/manifest.json"))
    assert embedded["smoke"]["ran_on"] == "Vulkan0: NVIDIA H200 (NVIDIA)"
    report = verify.verify(out)
    assert report["ok"], report["problems"]
    assert any(n.endswith("smoke passed on Vulkan0: NVIDIA H200 (NVIDIA)") for n in report["checked"])
    said = CliRunner().invoke(main, ["release-notes", str(out)]).stdout
    assert f"- `{on_gpu['release']['archive']}`: smoke passed on Vulkan0: NVIDIA H200 (NVIDIA)" in said
    assert "did not run on a GPU" not in said

    listed[:] = [H200.format(free=1000)]  # the same device, busier: its pass is reused
    again = release.release("pydist-0.94.0", request=BuildRequest("vulkan"), out=out, work=work)
    assert stub_stages["smoke"] == 2 and again["release"]["stages"]["smoke"]["reused"]


def test_verify_rejects_a_smoke_device_that_is_not_text():
    assert verify.manifest_field_problem({"release": {"files": []}, "smoke": {"ran_on": 3}}) == \
        "smoke.ran_on is not text"
    assert verify.manifest_field_problem({"release": {"files": []}, "smoke": {"cpu_fallback": "yes"}}) == \
        "smoke.cpu_fallback is not true or false"


# --- llama.cpp's layout and names (issue 36) ------------------------------------------------------------


UPSTREAM_NAME = r"^llama-(?P<tag>.+)-bin-(?P<platform>.+)\.(?:tar\.gz|zip)$"   # how upstream-style parsers read one


@posix_only
def test_the_tarball_holds_the_binaries_at_the_top_of_llama_tag(released):
    """As llama.cpp's release.yml packs build/bin: tar --transform s,^\\.,llama-<tag>, -C build/bin ."""
    import re

    rel = released["rel"]
    assert rel["root"] == f"llama-{rel['tag']}" and rel["layout"] == "top"
    with tarfile.open(released["out"] / rel["archive"]) as tar:
        names = {m.name: m for m in tar.getmembers()}
    root = rel["root"]
    assert {f"{root}/llama-server", f"{root}/libllama.so.0.2.0", f"{root}/LICENSE", f"{root}/manifest.json",
            f"{root}/REQUIRES.txt", f"{root}/patches/series.toml", f"{root}/licenses/LICENSE-jsonhpp"} <= set(names)
    assert names[f"{root}/libllama.so.0"].issym()
    assert not any(n.startswith(f"{root}/bin") for n in names)
    # the tree has no release.yml: the layout is the table's, and the manifest says so
    assert "the linux layout of backends.toml" in rel["layout_from"]["note"]
    # a parser of llama-<tag>-bin-<platform> reads dfbuild's whole tag, one of llama-b<N>- the build number
    parsed = re.match(UPSTREAM_NAME, rel["archive"])
    assert parsed["tag"] == rel["tag"] and parsed["platform"] == f"ubuntu-{HOST.arch}"
    tag = release.release_tag("b11434", released["sections"]["series"])
    assert re.match(r"^llama-b(\d+)-", matrix_name := f"llama-{tag}-bin-ubuntu-x64.tar.gz")[1] == "11434"
    assert not re.match(r"^llama-(b\d+)-bin-", matrix_name)  # no parser of upstream's own builds takes it for one


@posix_only
def test_the_wheel_holds_every_tool_the_archive_has(inputs, tmp_path):
    bin_dir = Path(inputs["sections"]["build"]["build_dir"]) / "bin"
    (bin_dir / "llama-cli").write_text("#!/bin/sh\necho cli\n")
    (bin_dir / "llama-cli").chmod(0o755)
    inputs["sections"]["build"]["binaries"] = ["bin/llama-cli", "bin/llama-server"]
    staged = release.stage_wheel_bin(payload(inputs), tmp_path / "bin")
    assert {p.name for p in staged.iterdir()} == {"llama-cli", "llama-server", "libimpl.so", "libllama.so.0"}


def test_archive_layout_comes_from_the_base_s_workflow_else_the_table(tmp_path):
    from test_upstream_release import WORKFLOW, tree_with

    tree = tree_with(tmp_path, WORKFLOW)
    assert release.archive_layout(tree, "linux", "cpu", "x64", None, "b1-dflash-0") == \
        ("top", "llama-b1-dflash-0", {"file": ".github/workflows/release.yml", "job": "ubuntu-cpu"})
    assert release.archive_layout(tree, "windows", "cpu", "x64", None, "b1-dflash-0")[:2] == ("flat", None)
    (tmp_path / "odd").mkdir()
    odd = tree_with(tmp_path / "odd", WORKFLOW.replace('--transform "s,^\\.,llama-${{ steps.tag.outputs.name }},"',
                                                        '--transform "s,^\\.,../x-${{ steps.tag.outputs.name }},"'))
    layout, root, record = release.archive_layout(odd, "linux", "cpu", "x64", None, "t")
    assert (layout, root) == ("top", "llama-t") and "its tarball's folder is '../x-t'" in record["note"]
    (tmp_path / "bare").mkdir()
    bare = tree_with(tmp_path / "bare", None)
    layout, root, record = release.archive_layout(bare, "windows", "vulkan", "x64", None, "t")
    assert (layout, root) == ("flat", None) and "the windows layout of backends.toml" in record["note"]


def _old_layout(out: Path) -> str:
    """Turn OUT's release into one dfbuild packed before issue 36 (a user's existing download): the tag
    <base>-<hash>, the archive llama-<tag>-dflash-bin-..., rooted at a folder named like it, the binaries
    in bin/, a manifest without a layout; no wheel."""
    top = json.loads((out / "manifest.json").read_text())
    rel = top["release"]
    new_name, new_root = rel["archive"], rel["root"]
    old_tag = rel["tag"].replace("-dflash-", "-")
    old_name = new_name.replace(f"llama-{rel['tag']}-bin-", f"llama-{old_tag}-dflash-bin-")
    old_root = archive.archive_root(old_name)
    own = {"LICENSE", "licenses", "patches", "manifest.json", "REQUIRES.txt"}

    def moved(path: str) -> str:
        return path if path.split("/")[0] in own else f"bin/{path}"

    with tarfile.open(out / new_name) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    embedded = json.loads(next(d for m, d in members if m.name == f"{new_root}/manifest.json"))
    packed = embedded["release"]
    for key in ("layout", "layout_from"):
        packed.pop(key)
    packed.update({"tag": old_tag, "archive": old_name, "root": old_root})
    for record in packed["files"]:
        record["path"] = moved(record["path"])
    entries = []
    for member, data in members:
        rel_path = member.name[len(new_root) + 1:]
        if not rel_path or member.isdir():
            continue
        if rel_path == "manifest.json":
            data = json.dumps(embedded, indent=2, sort_keys=True).encode()
        entries.append(archive.Entry(moved(rel_path), member.mode, data=data,
                                     link=member.linkname if member.issym() else None))
    archive.write_archive(out / old_name, old_root, sorted(entries, key=lambda e: e.path), mtime=946684800)
    for artifact in rel["artifacts"]:
        (out / artifact["name"]).unlink()
    data = (out / old_name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    top["release"] = {**packed, "artifacts": [{"name": old_name, "kind": "archive", "sha256": digest,
                                               "size": len(data)}], "stages": {}, "sha256sums": "SHA256SUMS"}
    (out / "manifest.json").write_text(json.dumps(top, indent=2, sort_keys=True))
    (out / "SHA256SUMS").write_text(f"{digest}  {old_name}\n")
    return old_name


@posix_only
def test_an_archive_in_the_old_layout_still_verifies_and_its_programs_run(release_copy):
    """A user's download from before issue 36: llama-<base>-<hash>-dflash-bin-..., one folder named like it, bin/."""
    out = release_copy["out"]
    old = _old_layout(out)
    with tarfile.open(out / old) as tar:
        assert f"{archive.archive_root(old)}/bin/llama-server" in tar.getnames()
    report = verify.verify(out, run_binaries=True)
    assert report["ok"], report["problems"]
    assert any("unpacked bin/llama-server --version names the patched commit" in n for n in report["checked"]), \
        report["checked"]


@posix_only
def test_an_archive_laid_out_otherwise_than_its_manifest_says_fails(release_copy, tmp_path):
    out, rel = release_copy["out"], release_copy["rel"]
    with tarfile.open(out / rel["archive"]) as tar:
        tar.extractall(tmp_path / "x")
    with tarfile.open(out / rel["archive"], "w:gz") as tar:  # the new manifest, in a folder named like the archive
        tar.add(tmp_path / "x" / rel["root"], arcname=archive.archive_root(rel["archive"]))
    _record_rewritten_archive(out, rel["archive"])
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any(f"its members are in {archive.archive_root(rel['archive'])}/, but its manifest says in "
               f"{rel['root']}/" in p for p in problems), problems


def _record_rewritten_archive(out, name: str) -> None:
    """After a test rewrote archive NAME: the release's manifest and SHA256SUMS name its new bytes, so that
    only what the test changed inside it can fail verify."""
    data = (out / name).read_bytes()
    top = json.loads((out / "manifest.json").read_text())
    for artifact in top["release"]["artifacts"]:
        if artifact["name"] == name:
            artifact["sha256"], artifact["size"] = hashlib.sha256(data).hexdigest(), len(data)
    (out / "manifest.json").write_text(json.dumps(top))
    release.write_sha256sums(out, [name])


@posix_only
def test_an_archive_whose_members_are_split_between_its_two_folders_fails(release_copy, tmp_path):
    """Each member in a folder the name allows (llama-<tag>/ and the old llama-...-bin-...-x64/), but not all
    in one: no layout holds it, so verify names the strays and reads no further."""
    out, rel = release_copy["out"], release_copy["rel"]
    with tarfile.open(out / rel["archive"]) as tar:
        tar.extractall(tmp_path / "x")
    old_root = archive.archive_root(rel["archive"])
    with tarfile.open(out / rel["archive"], "w:gz") as tar:
        tar.add(tmp_path / "x" / rel["root"], arcname=rel["root"])
        tar.add(tmp_path / "x" / rel["root"] / "llama-server", arcname=f"{old_root}/llama-server")
    _record_rewritten_archive(out, rel["archive"])

    problems = verify.verify(out, run_binaries=False)["problems"]

    assert any("its members are not all in one folder the archive may have" in p and f"{old_root}/llama-server" in p
               for p in problems), problems


@posix_only
def test_verify_starts_every_shipped_program_and_fails_one_that_does_not_start(inputs, fake_wheel, tmp_path):
    bin_dir = Path(inputs["sections"]["build"]["build_dir"]) / "bin"
    scripts = {
        "llama-cli": 'case "$1" in --version) echo "version: 1 (cli)";; *) exit 2;; esac\n',
        "rpc-server": 'echo "usage: rpc-server [options]" >&2\nexit 1\n',        # knows neither flag: it started
        "llama-bench": 'echo "llama-bench: error while loading shared libraries: libgone.so.1: cannot open" >&2\n'
                       "exit 127\n",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    inputs["sections"]["build"]["binaries"] = ["bin/llama-bench", "bin/llama-cli", "bin/llama-server",
                                               "bin/rpc-server"]
    out = tmp_path / "out"
    rel = write_full_release(inputs, out)
    report = verify.verify(out)
    assert report["problems"] == [f"{rel['archive']}: the unpacked llama-bench does not start (--version): "
                                  "llama-bench: error while loading shared libraries: libgone.so.1: cannot open"], \
        report["problems"]
    (bin_dir / "llama-bench").write_text("#!/bin/sh\nexit 0\n")
    write_full_release(inputs, tmp_path / "out2")
    report = verify.verify(tmp_path / "out2")
    assert report["ok"], report["problems"]
    assert any("3 more programs start: llama-bench --version, llama-cli --version, rpc-server (usage, exit 1)" in n
               for n in report["checked"]), report["checked"]


@posix_only
def test_a_program_that_hangs_or_dies_does_not_start(tmp_path, monkeypatch):
    monkeypatch.setattr(verify_run, "PROGRAM_TIMEOUT_S", 2)  # where start_programs reads it
    for name, body in {"hangs": "sleep 30\n", "dies": "kill -SEGV $$\n"}.items():
        (tmp_path / name).write_text("#!/bin/sh\n" + body)
        (tmp_path / name).chmod(0o755)
    problems, notes = [], []
    verify_run.start_programs("a.tar.gz", tmp_path, ["dies", "hangs"], [], dict(os.environ), problems, notes)
    assert problems == ["a.tar.gz: the unpacked dies does not start (--version): killed by signal 11",
                        "a.tar.gz: the unpacked hangs did not exit within 2 s of --version"]
    assert notes == []


def fake_cuda_toolkit(root: Path, major: str = "13", eula: bool = True) -> Path:
    """A CUDA toolkit folder as NVIDIA lays it out: lib64/libX.so.<major> -> libX.so.<major>.<minor>.<patch>."""
    lib = root / "lib64"
    lib.mkdir(parents=True)
    for name in ("libcudart", "libcublas", "libcublasLt", "libcufft"):
        (lib / f"{name}.so.{major}.0.9").write_bytes(f"\x7fELF {name}".encode())
        os.symlink(f"{name}.so.{major}.0.9", lib / f"{name}.so.{major}")
        os.symlink(f"{name}.so.{major}", lib / f"{name}.so")
    if eula:
        (root / "EULA.txt").write_text("NVIDIA CUDA Toolkit EULA (test copy)\n")
    return root


@posix_only
def test_the_linux_cuda_runtime_archive_is_packed_as_llama_cpps(tmp_path):
    """cudart-llama-<tag>-bin-ubuntu-cuda-13.0-x64.tar.gz: a folder of that name, the three sonames as plain
    files (cp -L), the toolkit's EULA and a notice of the terms beside them."""
    toolkit = fake_cuda_toolkit(tmp_path / "cuda")
    out = tmp_path / "out"
    path, record = release.cudart_linux(out, tag="b11434-dflash-0", toolkit="13.0.88", arch="x64",
                                        archive="llama-b11434-dflash-0-bin-ubuntu-cuda-13.0-x64.tar.gz",
                                        libraries=["libcudart", "libcublas", "libcublasLt"], toolkit_root=toolkit,
                                        epoch=946684800)
    root = "cudart-llama-b11434-dflash-0-bin-ubuntu-cuda-13.0-x64"
    assert path.name == f"{root}.tar.gz"
    with tarfile.open(path) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(n for n, m in members.items() if m.isfile()) == [
            f"{root}/libcublas.so.13", f"{root}/libcublasLt.so.13", f"{root}/libcudart.so.13",
            f"{root}/licenses/CUDA-EULA.txt", f"{root}/licenses/CUDA-NOTICE.txt"]
        assert tar.extractfile(f"{root}/libcudart.so.13").read() == b"\x7fELF libcudart"
        notice = tar.extractfile(f"{root}/licenses/CUDA-NOTICE.txt").read().decode()
    assert "CUDA Toolkit 13.0.88" in notice and "licenses/CUDA-EULA.txt" in notice
    assert record["libraries"] == ["libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"] and record["eula"]
    again, _ = release.cudart_linux(tmp_path / "again", tag="b11434-dflash-0", toolkit="13.0.88", arch="x64",
                                    archive="a", libraries=["libcudart", "libcublas", "libcublasLt"],
                                    toolkit_root=toolkit, epoch=946684800)
    assert again.read_bytes() != b"" and tarfile.open(again).getnames() == tarfile.open(path).getnames()

    # no EULA in the toolkit: the notice alone says the terms; a missing library or toolkit is a clear error
    bare = fake_cuda_toolkit(tmp_path / "bare", eula=False)
    path, record = release.cudart_linux(tmp_path / "o2", tag="t", toolkit="13.0", arch="x64", archive="a",
                                        libraries=["libcudart"], toolkit_root=bare, epoch=0)
    assert not record["eula"] and "licenses/CUDA-EULA.txt" not in "".join(tarfile.open(path).getnames())
    with pytest.raises(ReleaseError, match="libnvrtc.so.13 not found under"):
        release.cudart_linux(tmp_path / "o3", tag="t", toolkit="13.0", arch="x64", archive="a",
                             libraries=["libnvrtc"], toolkit_root=bare, epoch=0)
    with pytest.raises(ReleaseError, match="CUDA_PATH"):
        release.cudart_linux(tmp_path / "o4", tag="t", toolkit="13.0", arch="x64", archive="a",
                             libraries=["libcudart"], toolkit_root=None, epoch=0)


@posix_only
def test_the_cuda_runtime_comes_from_the_toolkit_the_build_used_not_the_nvcc_wrappers_folder(tmp_path, monkeypatch):
    """A machine whose nvcc on PATH is a wrapper script (/usr/local/bin/nvcc: exec /usr/local/cuda-13.0/bin/nvcc)
    built b11434 and then looked for libcudart.so.13 under /usr/local. The build's CMake cache names the
    toolkit nvcc itself reported (CUDAToolkit_BIN_DIR); the build section records it and packing uses it."""
    from dfbuild.build import tree as build_tree

    toolkit = fake_cuda_toolkit(tmp_path / "cuda-13.0")
    wrapper = tmp_path / "usr-local" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f"#!/bin/sh\nexec {toolkit}/bin/nvcc \"$@\"\n")
    for name in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(name, raising=False)
    facts = build_tree.cuda_facts({"CMAKE_CUDA_ARCHITECTURES": "90", "CUDAToolkit_BIN_DIR": str(toolkit / "bin"),
                                   "CMAKE_CUDA_COMPILER": str(wrapper)})
    assert facts == {"cuda_architectures": "90", "cuda_toolkit_root": str(toolkit)}
    section = {"flags": {"CMAKE_CUDA_COMPILER": str(wrapper)}, **facts}
    assert release.cuda_toolkit_root(section) == toolkit
    path, record = release.cudart_linux(tmp_path / "out", tag="t", toolkit="13.0", arch="x64", archive="a",
                                        libraries=["libcudart", "libcublas", "libcublasLt"],
                                        toolkit_root=release.cuda_toolkit_root(section), epoch=0)
    assert record["libraries"] == ["libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"]


@posix_only
def test_a_linux_cuda_release_ships_the_runtime_archive_beside_it(inputs, fake_wheel, tmp_path, monkeypatch):
    toolkit = fake_cuda_toolkit(tmp_path / "cuda", major="12")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    build_section = inputs["sections"]["build"]
    build_section.update(backend="cuda", toolchain={"nvcc": "12.8.93"})
    out = tmp_path / "out"
    rel = write_full_release(inputs, out)
    assert rel["archive"].endswith("-bin-ubuntu-cuda-12.8-x64.tar.gz") if HOST.arch == "x64" else True
    cudart = next(a for a in rel["artifacts"] if a["kind"] == "cudart")
    assert cudart["name"] == f"cudart-llama-{rel['tag']}-bin-ubuntu-cuda-12.8-{HOST.arch}.tar.gz"
    assert rel["cudart"]["libraries"] == ["libcublas.so.12", "libcublasLt.so.12", "libcudart.so.12"]
    assert cudart["name"] in (out / "SHA256SUMS").read_text()
    report = verify.verify(out, run_binaries=False)
    assert report["ok"], report["problems"]
    said = CliRunner().invoke(main, ["release-notes", str(out)]).stdout
    assert f"The CUDA runtime libraries, to unpack beside the programs of the CUDA archive" in said
    assert f"`{cudart['name']}`" in said
