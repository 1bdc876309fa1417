"""Linux arm64 from Linux x64 (`--arch arm64`): the target table, the toolchain file, the CPU variants,
the ELF checks and qemu as the runner (fast).

The real cross build of a release, its smoke under qemu-aarch64 and its `verify` are in
test_arm64_real.py (slow). Here, with the cross compiler installed, one check is real: the
toolchain file dfbuild writes configures and builds a tiny CMake project into an AArch64
program (skipped, saying why, without the compiler: scripts/test.sh installs it on Debian).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild import smoke
from dfbuild.build import tree as build
from dfbuild.core import elf
from dfbuild.core.errors import BuildError, ToolchainMissingError, UnsupportedBackendError
from dfbuild.host import backends, doctor, matrix, platforms
from dfbuild.host.backends import Host
from dfbuild.host.platforms import linux_arm64
from dfbuild.release import package as release_package
from dfbuild.release import pipeline as release
from dfbuild.verify import release_dir as verify

LINUX = Host("linux", "x64", "debian", "12")
ARM64_ON_LINUX = Host("linux", "arm64", "debian", "12", build_os="linux", build_arch="x64")
CROSS_GXX = shutil.which("aarch64-linux-gnu-g++")
needs_cross = pytest.mark.skipif(CROSS_GXX is None or shutil.which("aarch64-linux-gnu-gcc") is None
                                 or not sys.platform.startswith("linux"),
                                 reason="the arm64 cross compilers are not installed "
                                        "(apt-get install g++-aarch64-linux-gnu gcc-aarch64-linux-gnu)")
on_x64_linux = pytest.mark.skipif(not sys.platform.startswith("linux") or elf.host_machine() != "x86-64",
                                  reason="--arch arm64 is a cross build on Linux x64")


# --- the target table ------------------------------------------------------------------------


def test_arch_defaults_to_the_host_and_arm64_is_a_cross_target_on_linux_x64():
    assert platforms.target_host(None, LINUX) == LINUX
    assert platforms.target_host(None, LINUX, arch="x64") == LINUX
    target = platforms.target_host(None, LINUX, arch="arm64")
    assert target == platforms.target_host("linux", LINUX, arch="arm64") == ARM64_ON_LINUX
    assert target.cross and target.exe_suffix == "" and platforms.cross(target) is linux_arm64
    assert platforms.cross(LINUX) is None
    # the Windows cross target is unchanged: not an arch cross
    windows = platforms.target_host("windows", LINUX)
    assert (windows.os, windows.arch, windows.build_arch, windows.cross) == ("windows", "x64", None, True)


def test_unknown_or_unbuildable_arch_is_refused_before_any_work():
    with pytest.raises(UnsupportedBackendError, match="unknown target arch 'riscv64'") as caught:
        platforms.target_host(None, LINUX, arch="riscv64")
    assert caught.value.exit_code == 33
    with pytest.raises(UnsupportedBackendError, match="windows for x64 only"):
        platforms.target_host("windows", LINUX, arch="arm64")
    # an arm64 Linux machine has no cross toolchain for x64, and macOS none for another arch
    with pytest.raises(UnsupportedBackendError, match="no cross toolchain for linux x64"):
        platforms.target_host(None, Host("linux", "arm64", "debian", "12"), arch="x64")
    with pytest.raises(UnsupportedBackendError, match="no cross toolchain for macos x64"):
        platforms.target_host(None, Host("macos", "arm64"), arch="x64")


def test_the_cross_build_gets_its_own_build_dir_and_the_archive_llama_cpps_name():
    assert build.dir_label("cpu", ARM64_ON_LINUX) == "cpu-arm64"
    assert build.dir_label("cpu", platforms.target_host("windows", LINUX)) == "cpu-windows"  # unchanged
    assert build.dir_label("cpu", LINUX) == "cpu"
    assert matrix.artifact_name("b11401-dflash-1a2b3c4d", "linux", "cpu", "arm64") == \
        "llama-b11401-dflash-1a2b3c4d-bin-ubuntu-arm64.tar.gz"
    # the build section's host, read back: a cross build (no wheel, no host libraries bundled)
    section = {"host": {"os": "linux", "arch": "arm64", "build_os": "linux", "build_arch": "x64"}}
    made = release_package._cross_host(section)
    assert (made.os, made.arch, made.build_os, made.build_arch, made.cross) == ("linux", "arm64", "linux", "x64", True)
    assert release_package._cross_host({"host": {"os": "linux", "arch": "x64"}}) is None


def test_flags_and_variants_are_llama_cpps_ubuntu_arm64_release():
    flags = backends.cmake_flags("cpu", "linux", arch="arm64")
    assert flags["GGML_BACKEND_DL"] == flags["GGML_CPU_ALL_VARIANTS"] == "ON" and flags["GGML_NATIVE"] == "OFF"
    assert flags["LLAMA_OPENSSL"] == "ON" and flags["CMAKE_INSTALL_RPATH"] == "$ORIGIN"
    variants = backends.host_cpu_variants(ARM64_ON_LINUX)
    assert variants == ["armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1", "armv8.6_2",
                        "armv9.2_1", "armv9.2_2"]
    assert set(backends.table()["common"]["cpu_variant_march"]) == set(variants)
    assert build.parse_cpu_variants("armv8.2_2,armv8.0_1", ARM64_ON_LINUX) == ["armv8.0_1", "armv8.2_2"]
    with pytest.raises(BuildError, match="unknown variant"):
        build.parse_cpu_variants("haswell", ARM64_ON_LINUX)


# --- the toolchain ------------------------------------------------------------------------------


def test_toolchain_file_names_the_cross_compilers_and_the_cross_root():
    text = linux_arm64.toolchain_text(ARM64_ON_LINUX)
    for line in ("set(CMAKE_SYSTEM_NAME Linux)", "set(CMAKE_SYSTEM_PROCESSOR aarch64)",
                 "set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)", "set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)",
                 "set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)", "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
                 "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)"):
        assert line in text.splitlines(), line


def _fake_compiler(tmp_path: Path, rejects: str) -> str:
    """A 'compiler' that rejects any -march containing REJECTS, as GCC 12 rejects armv9.2-a."""
    path = tmp_path / "fake-gcc"
    path.write_text("#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in -march=*" + rejects + "*) "
                    "echo \"cc1: error: unknown value '${a#-march=}' for '-march'\" >&2; exit 1;; esac; done\n"
                    "exit 0\n")
    path.chmod(0o755)
    return str(path)


def test_variants_the_compiler_cannot_build_are_left_out_and_said(tmp_path):
    compiler = _fake_compiler(tmp_path, "armv9.2-a")
    left_out = build.unbuildable_variants(compiler, backends.host_cpu_variants(ARM64_ON_LINUX))
    assert set(left_out) == {"armv9.2_1", "armv9.2_2"}
    assert "rejects -march=armv9.2-a+dotprod+fp16+sve+i8mm+sme" in left_out["armv9.2_1"]
    assert build.unbuildable_variants(compiler, ["x64", "haswell"]) == {}   # x64 variants: no -march test
    assert build.unbuildable_variants(None, ["armv9.2_1"]) == {}


@needs_cross
def test_gcc_12_knows_no_armv9_2_so_the_sme_variants_are_left_out():
    left_out = build.unbuildable_variants(shutil.which("aarch64-linux-gnu-gcc"),
                                          backends.host_cpu_variants(ARM64_ON_LINUX))
    major = int(subprocess.run([CROSS_GXX, "-dumpversion"], capture_output=True, text=True).stdout.split(".")[0])
    assert ("armv8.0_1" not in left_out) and ("armv8.6_2" not in left_out)
    if major < 13:
        assert set(left_out) == {"armv9.2_1", "armv9.2_2"}


def test_tls_is_the_arm64_openssl_or_the_toolchain_missing_code(monkeypatch, tmp_path):
    entry = dict(linux_arm64.entry(ARM64_ON_LINUX))
    entry.update(tls_libdir=str(tmp_path / "lib"), tls_include=str(tmp_path / "include"))
    monkeypatch.setattr(linux_arm64, "entry", lambda host: entry)
    with pytest.raises(ToolchainMissingError, match="arm64 OpenSSL") as caught:
        linux_arm64.tls_args(ARM64_ON_LINUX)
    assert caught.value.exit_code == 30 and "libssl-dev:arm64" in caught.value.hint
    (tmp_path / "lib").mkdir()
    (tmp_path / "include" / "openssl").mkdir(parents=True)
    for name in ("lib/libssl.so", "lib/libcrypto.so", "include/openssl/opensslv.h"):
        (tmp_path / name).write_text("")
    args = linux_arm64.tls_args(ARM64_ON_LINUX)
    assert f"-DOPENSSL_SSL_LIBRARY={tmp_path / 'lib' / 'libssl.so'}" in args
    assert f"-DOPENSSL_INCLUDE_DIR={tmp_path / 'include'}" in args and args[0] == "-UOPENSSL_*"


# --- doctor and the CLI without the toolchain ------------------------------------------------------


@pytest.fixture
def no_tools(monkeypatch, tmp_path):
    from helpers import isolate_probes

    return isolate_probes(monkeypatch, tmp_path)[1]


def test_doctor_without_the_cross_toolchain_names_the_packages(no_tools):
    entry = doctor.check_backend("cpu", ARM64_ON_LINUX)
    assert not entry["can_build"]
    assert entry["missing"][:2] == ["aarch64-gcc", "aarch64-gxx"]
    assert entry["missing_to_run"] == ["qemu-aarch64"]
    line = entry["install"][0]
    for package in ("g++-aarch64-linux-gnu", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user",
                    "libssl-dev:arm64", "dpkg --add-architecture arm64"):
        assert package in line, package
    with pytest.raises(ToolchainMissingError) as caught:
        doctor.require("cpu", ARM64_ON_LINUX)
    assert caught.value.exit_code == 30 and "g++-aarch64-linux-gnu" in (caught.value.hint or "")
    assert doctor.check_backend("cuda", ARM64_ON_LINUX)["reason"].startswith("CUDA for arm64")


def _cli(*args):
    from helpers import dfbuild

    return dfbuild(*args)


@on_x64_linux
def test_cli_arch_arm64_without_the_toolchain_exits_30_with_the_apt_line(no_tools, tmp_path):
    from helpers import said, write_fake_llama

    result = _cli("doctor", "--backend", "cpu", "--arch", "arm64")
    assert result.exit_code == 30, result.output
    assert "g++-aarch64-linux-gnu" in said(result) and "qemu-user" in said(result)
    report = json.loads(_cli("doctor", "--backend", "cpu", "--arch", "arm64", "--json").stdout)
    assert report["target"] == {"os": "linux", "arch": "arm64"} and report["host"]["arch"] == "x64"

    tree = tmp_path / "src"
    write_fake_llama(tree)
    (tree / "tools" / "server").mkdir(parents=True)
    built = _cli("build", "--dir", tree, "--backend", "cpu", "--arch", "arm64")
    assert built.exit_code == 30, built.output
    assert "g++-aarch64-linux-gnu" in said(built) and "Traceback" not in built.output
    assert not list((tmp_path / "build-cpu-arm64").glob("*.cmake"))   # refused before configure: no toolchain file


def test_cli_unknown_arch_is_a_usage_error_before_any_work(tmp_path):
    for args in (("doctor",), ("build", "--dir", tmp_path / "src", "--backend", "cpu"),
                 ("release", "--base", "b11401", "--backend", "cpu", "--work", tmp_path / "w", "--out", tmp_path / "o"),
                 ("prove", "--base", "b11401", "--work", tmp_path / "w")):
        result = _cli(*args, "--arch", "riscv64")
        assert result.exit_code == 2 and "'riscv64' is not one of 'x64', 'arm64'" in result.output, args
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_cpu_variants_help_names_the_arm64_variants_not_x64_only():
    # --cpu-variants takes the arm64 names with --arch arm64 (the fewer-variants build of docs/arm64.md)
    for command in ("build", "release", "prove"):
        result = _cli(command, "--help")
        text = " ".join(result.output.split())
        assert result.exit_code == 0 and "x64 only" not in text and "x64 CPU variants" not in text, command
        assert "armv8.0_1,armv8.2_2" in text and "--arch arm64" in text, command


# --- ELF machine, and qemu as the runner ----------------------------------------------------------


def _elf_header(machine: int) -> bytes:
    """A 64-bit little-endian ELF header (an executable with no sections) for MACHINE."""
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    return ident + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0)


def test_elf_machine_is_read_from_the_header():
    assert elf.machine(_elf_header(183)) == "AArch64" and elf.machine(_elf_header(62)) == "x86-64"
    assert elf.machine(b"MZ" + bytes(100)) is None
    assert elf.read(_elf_header(183)).machine == "AArch64"


def test_verify_flags_an_elf_file_of_another_machine():
    problems: list[str] = []
    assert verify._elf_problems("a.tar.gz", "bin/libggml-base.so", _elf_header(62), problems, {}, "AArch64") == 1
    assert problems == ["a.tar.gz: bin/libggml-base.so is an ELF file for x86-64, not AArch64"]
    problems.clear()
    verify._elf_problems("a.tar.gz", "bin/llama-server", _elf_header(183), problems, {}, "AArch64")
    assert problems == []
    assert verify._elf_problems("a.tar.gz", "LICENSE", b"MIT License", problems, {}, "AArch64") == 0


@on_x64_linux
def test_an_arm64_program_runs_through_qemu_with_the_cross_root(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_bytes(_elf_header(183))
    native = tmp_path / "native"
    native.write_bytes(_elf_header(62))
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/opt/q/qemu-aarch64" if name == "qemu-aarch64"
                        else real_which(name, *a, **k))
    assert smoke.launcher_for(binary) == (["/opt/q/qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", "-E",
                                           "LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib", "-cpu", "max"], {})
    assert smoke.exe_start_timeout(binary) == 600
    assert smoke.launcher_for(native) == ([], {}) and smoke.exe_start_timeout(native) is None
    # verify runs an arm64 archive's llama-server here when qemu is installed
    packed = {"os": "linux", "arch": "arm64"}
    assert verify._runs_here(packed, LINUX)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name.startswith("qemu")
                        else real_which(name, *a, **k))
    assert not verify._runs_here(packed, LINUX)   # no qemu: the stamp is checked instead
    with pytest.raises(ToolchainMissingError, match="qemu-aarch64 is not installed") as caught:
        smoke.launcher_for(binary)
    assert "qemu-user" in caught.value.hint


# --- the toolchain file, for real (the fast check .ci/run keeps) -----------------------------------


@needs_cross
def test_the_toolchain_file_configures_and_builds_an_aarch64_program(tmp_path):
    """dfbuild's toolchain file and TLS arguments configure a tiny project that links OpenSSL; the
    program is an AArch64 ELF with RUNPATH $ORIGIN, and runs under qemu-aarch64 when that is installed,
    a thread included (a loader and a libc of two builds hang there: targets.toml's runner)."""
    project = tmp_path / "project"
    project.mkdir()
    tls = Path(linux_arm64.entry(ARM64_ON_LINUX)["tls_libdir"], "libssl.so").exists()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(t C)\nfind_package(Threads REQUIRED)\n"
        + ("find_package(OpenSSL 3 REQUIRED)\n" if tls else "")
        + "add_executable(t t.c)\ntarget_link_libraries(t Threads::Threads)\n"
        + ("target_link_libraries(t OpenSSL::SSL)\ntarget_compile_definitions(t PRIVATE T_TLS)\n" if tls else ""))
    (project / "t.c").write_text(
        "#include <stdio.h>\n#include <pthread.h>\n#ifdef T_TLS\n#include <openssl/ssl.h>\n#endif\n"
        "static void * run(void * arg) { return arg; }\n"
        "int main(void) {\n#ifdef T_TLS\n  printf(\"%s\\n\", OpenSSL_version(OPENSSL_VERSION));\n#endif\n"
        "  pthread_t t; void * back = 0;\n"
        "  if (pthread_create(&t, 0, run, (void *) 7) || pthread_join(t, &back) || back != (void *) 7) return 2;\n"
        "  printf(\"arm64 ok\\n\"); return 0; }\n")
    build_dir = tmp_path / "build"
    setup = linux_arm64.configure(ARM64_ON_LINUX, build_dir) if tls else {
        "cmake_args": [f"-DCMAKE_TOOLCHAIN_FILE={build_dir / linux_arm64.TOOLCHAIN_NAME}"]}
    if not tls:
        build_dir.mkdir()  # as configure() does before it writes the file
        linux_arm64.write_if_changed(build_dir / linux_arm64.TOOLCHAIN_NAME, linux_arm64.toolchain_text(ARM64_ON_LINUX))
    cmake = doctor.find_pypi_program("cmake")
    ninja = doctor.find_pypi_program("ninja")
    configured = subprocess.run([cmake, "-S", str(project), "-B", str(build_dir), "-G", "Ninja",
                                 f"-DCMAKE_MAKE_PROGRAM={ninja}", *setup["cmake_args"],
                                 "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN"],
                                capture_output=True, text=True)
    assert configured.returncode == 0, configured.stdout[-2000:] + configured.stderr[-2000:]
    assert "aarch64-linux-gnu-gcc" in "".join(p.read_text() for p in build_dir.glob("CMakeFiles/*/CMakeCCompiler.cmake"))
    built = subprocess.run([cmake, "--build", str(build_dir)], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    program = build_dir / "t"
    info = elf.read(program)
    assert info.machine == "AArch64" and info.runpath == "$ORIGIN"
    if tls:
        assert "libcrypto.so.3" in info.needed   # OpenSSL_version: libcrypto (libssl dropped as unneeded)
    if shutil.which("qemu-aarch64") and elf.host_machine() == "x86-64":
        prefix, env = smoke.launcher_for(program)
        ran = subprocess.run([*prefix, str(program)], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0 and "arm64 ok" in ran.stdout, ran.stderr
        if tls:
            assert ran.stdout.startswith("OpenSSL 3")
