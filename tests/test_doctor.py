"""`dfbuild doctor`: toolchain probes against fake toolchains, and what users see."""

from __future__ import annotations

import json
import shutil
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfbuild.cli import main
from dfbuild.core.errors import ToolchainMissingError
from dfbuild.host import backends, doctor, probes
from dfbuild.host.backends import Host

LINUX = Host("linux", "x64", "debian", "12")
posix_only = pytest.mark.skipif(sys.platform.startswith("win"), reason="fake tools are shell scripts")


def fake_program(directory: Path, name: str, output: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    # only shell builtins: the tests run it with a PATH that holds nothing else
    path.write_text(f"#!/bin/sh\necho '{output}'\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """A PATH and a probe table that see only what the test puts under tmp_path."""
    from helpers import isolate_probes

    return isolate_probes(monkeypatch, tmp_path)


@posix_only
def test_nvcc_without_cublas_cannot_build_cuda(isolated, tmp_path):
    table, bin_dir = isolated
    cuda = tmp_path / "cuda"
    fake_program(cuda / "bin", "nvcc", "Cuda compilation tools, release 13.0, V13.0.88")
    (cuda / "include").mkdir()
    (bin_dir / "nvcc").symlink_to(cuda / "bin" / "nvcc")

    nvcc = doctor.probe("nvcc", LINUX)
    assert nvcc.ok and nvcc.version == "13.0"
    cublas = doctor.probe("cublas-headers", LINUX)
    assert not cublas.found
    assert "cublas" in cublas.install.lower()
    # the hint names the packages of the nvcc that is installed, not another toolkit's
    assert "libcublas-dev-13-0" in cublas.install and "12-8" not in cublas.install

    (cuda / "include" / "cublas_v2.h").write_text("/* fake */\n")
    found = doctor.probe("cublas-headers", LINUX)
    assert found.ok and found.path == str(cuda / "include")


@posix_only
def test_a_toolkit_without_libcuda_cannot_build_cuda(isolated, tmp_path, monkeypatch):
    """A CUDA toolkit made of PyPI's nvidia-* wheels (nvcc, cudart, cuBLAS) has no lib64/stubs/libcuda.so, and
    b11434's configure then fails on CUDA::cuda_driver; doctor says so before anything is built. The
    toolkit's stub, or a driver's libcuda.so where CMake also looks (beside a PATH entry's bin), is enough."""
    _, bin_dir = isolated
    cuda = tmp_path / "cuda"
    fake_program(cuda / "bin", "nvcc", "Cuda compilation tools, release 13.0, V13.0.88")
    (cuda / "include").mkdir()
    (cuda / "include" / "cublas_v2.h").write_text("/* fake */\n")
    (bin_dir / "nvcc").symlink_to(cuda / "bin" / "nvcc")

    entry = doctor.check_backend("cuda", LINUX)  # (the isolated PATH has no C compiler either)
    assert not entry["can_build"] and "cuda-driver" in entry["missing"] and "cublas-headers" not in entry["missing"]
    missing = doctor.probe("cuda-driver", LINUX)
    assert "cuda-driver-dev-13-0" in missing.install  # the package of the nvcc that is installed

    stubs = cuda / "targets" / "x86_64-linux" / "lib" / "stubs"
    stubs.mkdir(parents=True)
    (stubs / "libcuda.so").write_bytes(b"")
    found = doctor.probe("cuda-driver", LINUX)
    assert found.ok and found.path == str(stubs / "libcuda.so")
    assert "cuda-driver" not in doctor.check_backend("cuda", LINUX)["missing"]

    (stubs / "libcuda.so").unlink()
    driver = tmp_path / "driver"
    fake_program(driver / "bin", "nvidia-smi", "")
    (driver / "lib64").mkdir()
    (driver / "lib64" / "libcuda.so").write_bytes(b"")
    monkeypatch.setenv("PATH", f"{bin_dir}:{driver / 'bin'}")
    assert doctor.probe("cuda-driver", LINUX).path == str(driver / "lib64" / "libcuda.so")


@posix_only
def test_too_old_tools_are_reported_with_the_minimum(isolated):
    table, bin_dir = isolated
    fake_program(bin_dir, "nvcc", "Cuda compilation tools, release 11.0, V11.0.1")
    result = doctor.probe("nvcc", LINUX)
    assert result.found and not result.ok
    assert "11.0 is too old (need >= 11.7)" in result.problem
    fake_program(bin_dir, "hipconfig", "5.7.31921-d1770ee1b")
    hip = doctor.probe("hip-clang", LINUX)
    assert not hip.ok and "need >= 6.1" in hip.problem
    assert "6.1" in hip.install  # Debian's own hipcc is too old: say where ROCm >= 6.1 comes from


def write_vulkan_headers(root: Path, minor: int, patch: int) -> Path:
    include = root / "include"
    (include / "vulkan").mkdir(parents=True)
    (include / "vulkan" / "vulkan_core.h").write_text(
        f"#define VK_HEADER_VERSION {patch}\n"
        f"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, {minor}, VK_HEADER_VERSION)\n")
    (include / "vulkan" / "vulkan.hpp").write_text("// fake\n")
    return include


def test_vulkan_headers_version_and_minimum(isolated, tmp_path):
    old = write_vulkan_headers(tmp_path / "old", 3, 239)   # Debian 12
    new = write_vulkan_headers(tmp_path / "new", 4, 309)   # Debian 13
    assert doctor.vulkan_header_version(old / "vulkan" / "vulkan_core.h") == "1.3.239"

    too_old = doctor.probe("vulkan-headers", LINUX, extra_include_dirs=[old])
    assert too_old.found and not too_old.ok
    assert "1.3.239 is too old (need >= 1.3.272)" in too_old.problem
    assert "--vulkan-include-dir" in too_old.install  # the Debian 12 way out

    fine = doctor.probe("vulkan-headers", LINUX, extra_include_dirs=[new])
    assert fine.ok and fine.version == "1.4.309"


def test_metal_and_hip_say_plainly_where_they_build(isolated):
    report = doctor.doctor(host=LINUX)
    metal = report["backends"]["metal"]
    assert not metal["can_build"]
    assert "only on macOS" in metal["reason"]
    assert metal["toolchain"] == []  # nothing probed for a host it can never build on
    assert not report["backends"]["hip"]["can_build"]  # no ROCm on an isolated PATH


def test_require_raises_with_what_to_install(isolated):
    with pytest.raises(ToolchainMissingError) as exc:
        doctor.require("vulkan", LINUX)
    assert exc.value.exit_code == 30
    assert "glslc" in exc.value.message
    assert "apt-get install glslc" in exc.value.hint


def test_missing_compiler_blocks_every_backend(isolated):
    report = doctor.doctor(host=LINUX)
    for name in ("cpu", "cuda", "vulkan", "hip"):
        assert "c-compiler" in report["backends"][name]["missing"]
    assert "build-essential" in " ".join(report["backends"]["cpu"]["install"])


def test_this_machine_cannot_build_cuda_for_want_of_cublas():
    """The documented state of the dev machine: nvcc 13 without cuBLAS headers."""
    entry = doctor.check_backend("cuda")
    nvcc = next(p for p in entry["toolchain"] if p["name"] == "nvcc")
    if not nvcc["found"] or any(p["name"] == "cublas-headers" and p["ok"] for p in entry["toolchain"]):
        pytest.skip("this machine is not the nvcc-without-cuBLAS dev box")
    assert not entry["can_build"]
    assert entry["missing"][0] == "cublas-headers"  # (then cuda-driver: no libcuda.so there either)
    assert "cuBLAS" in entry["reason"]


# --- Windows ----------------------------------------------------------------------------


@posix_only
def test_find_msvc_through_vswhere(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("VCINSTALLDIR", raising=False)
    program_files = tmp_path / "Program Files (x86)"
    install = tmp_path / "VS" / "2022" / "BuildTools"
    vcvars = install / "VC" / "Auxiliary" / "Build" / "vcvars64.bat"
    vcvars.parent.mkdir(parents=True)
    vcvars.write_text("@echo off\n")
    vswhere_dir = program_files / "Microsoft Visual Studio" / "Installer"
    vswhere = vswhere_dir / "vswhere.exe"
    vswhere_dir.mkdir(parents=True)
    vswhere.write_text(
        "#!/bin/sh\ncase \"$*\" in *installationVersion*) echo 17.14.36310.24;; *) echo '%s';; esac\n" % install)
    vswhere.chmod(0o755)
    monkeypatch.setenv("ProgramFiles(x86)", str(program_files))

    found = doctor.find_msvc("x64")
    assert found == {"cl": None, "vcvars": str(vcvars), "version": "17.14.36310.24"}
    probe = doctor.probe("cxx-compiler", Host("windows", "x64"))
    assert probe.ok and probe.path == str(vcvars)


def test_no_msvc_says_how_to_open_a_developer_prompt(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("ProgramFiles(x86)", str(tmp_path / "nowhere"))
    probe = doctor.probe("c-compiler", Host("windows", "x64"))
    assert not probe.found
    assert "Native Tools Command Prompt" in probe.install


def test_active_developer_prompt_is_used_as_is(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor.shutil, "which", lambda name, path=None: r"C:\VS\cl.exe" if name == "cl" else None)
    monkeypatch.setenv("VCINSTALLDIR", r"C:\VS\VC")
    monkeypatch.setenv("VCToolsVersion", "14.44.35207")
    assert doctor.find_msvc() == {"cl": r"C:\VS\cl.exe", "vcvars": None, "version": "14.44.35207"}


def test_msvc_environment_reads_back_set(monkeypatch):
    calls = []

    class Result:
        returncode = 0
        stdout = "INCLUDE=C:\\VS\\include\nPATH=C:\\VS\\bin;C:\\Windows\nnot a variable\n"

    def fake_run(args, **kwargs):
        calls.append((args, Path(args[3]).read_text()))
        return Result()

    monkeypatch.setattr(doctor.proc, "run", fake_run)
    env = doctor.msvc_environment(r"C:\Program Files\VS\vcvars64.bat")
    assert env == {"INCLUDE": "C:\\VS\\include", "PATH": "C:\\VS\\bin;C:\\Windows"}
    args, script = calls[0]
    assert args[:3] == ["cmd", "/d", "/c"] and args[3].endswith(".bat")
    assert 'call "C:\\Program Files\\VS\\vcvars64.bat"' in script and "\nset" in script


# --- the command ---------------------------------------------------------------------


def test_doctor_command_shows_every_backend():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    for name in backends.names():
        assert name in result.output
    assert "Metal builds only on macOS" in result.output


def test_doctor_json_is_the_report():
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert set(report["backends"]) == set(backends.names())
    cpu = report["backends"]["cpu"]
    assert {p["name"] for p in cpu["toolchain"]} >= {"c-compiler", "cxx-compiler", "cmake", "ninja"}


def test_doctor_for_a_backend_this_host_never_builds_exits_33():
    if sys.platform == "darwin":
        pytest.skip("metal builds on macOS")
    result = CliRunner().invoke(main, ["doctor", "--backend", "metal"])
    assert result.exit_code == 33
    assert "only on macOS" in result.output
    assert CliRunner().invoke(main, ["doctor", "--backend", "metal", "--json"]).exit_code == 33


def test_doctor_for_a_backend_missing_its_toolchain_exits_30(isolated):
    result = CliRunner().invoke(main, ["doctor", "--backend", "vulkan"])
    assert result.exit_code == 30
    assert "apt-get install glslc" in result.output
    assert CliRunner().invoke(main, ["doctor", "--backend", "cpu"]).exit_code == 30  # no compiler on PATH


def test_doctor_unknown_backend():
    result = CliRunner().invoke(main, ["doctor", "--backend", "opencl"])
    assert result.exit_code == 2  # a choice, as --os is
    assert "'opencl' is not one of" in result.stderr


# --- Vulkan headers on Debian 12 ------------------------------------------------------------


def test_debian_mirror_from_deb822_and_one_line_sources(tmp_path):
    deb822 = tmp_path / "a"
    (deb822 / "sources.list.d").mkdir(parents=True)
    (deb822 / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n")
    assert doctor.debian_mirror(deb822) == "http://mirror.example/debian"

    one_line = tmp_path / "b"
    one_line.mkdir()
    (one_line / "sources.list").write_text("# comment\ndeb [arch=amd64] http://other.example/debian/ bookworm main\n")
    assert doctor.debian_mirror(one_line) == "http://other.example/debian"
    assert doctor.debian_mirror(tmp_path / "none") is None


def test_the_debian_12_hint_is_one_command():
    hint = probes._install_hint(backends.table()["probes"]["vulkan-headers"], LINUX)
    assert "--vulkan-include-dir" in hint and "dfbuild doctor --fetch-vulkan-headers" in hint


@pytest.mark.integration
def test_fetch_debian_13_vulkan_headers_passes_the_probe():
    if not (shutil.which("apt-get") and doctor.debian_mirror()):
        pytest.skip("not a Debian/Ubuntu machine")
    include = doctor.fetch_debian_vulkan_headers()
    probe = doctor.probe("vulkan-headers", LINUX, extra_include_dirs=[include])
    assert probe.ok, probe
    assert doctor.version_tuple(probe.version) >= (1, 3, 272)
    result = CliRunner().invoke(main, ["doctor", "--fetch-vulkan-headers"])
    assert result.exit_code == 0 and result.stdout.strip() == str(include)


@posix_only
def test_linux_builds_need_the_openssl_headers(isolated, tmp_path):
    """TLS for -hf: doctor asks for libssl-dev before a build would silently lose HTTPS."""
    table, _ = isolated
    include = tmp_path / "include"
    table["probes"]["openssl-headers"]["dirs"] = [str(include)]
    entry = doctor.check_backend("cpu", LINUX)
    assert "openssl-headers" in entry["missing"]
    assert "apt-get install libssl-dev" in entry["install"]
    assert not any(p["name"] == "openssl-headers" for p in doctor.check_backend("cpu", Host("windows", "x64"))["toolchain"])
    (include / "openssl").mkdir(parents=True)
    for header in ("ssl.h", "opensslv.h"):
        (include / "openssl" / header).write_text("/* fake */\n")
    assert doctor.probe("openssl-headers", LINUX).ok
