"""`dfbuild build`: configure-once, ninja no-ops, build-dir ownership, errors, Ctrl-C.

Most tests build a tiny stand-in for llama.cpp (one shared library, one
`llama-server` that prints the version stamp) with the real cmake and ninja, so
they exercise the same code path as a real build in seconds. The last test
builds a real llama.cpp tree, realtrees.REAL_BASE (integration + slow).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.cli import main
from dfbuild.core.errors import BuildDirMismatchError, BuildError, SourceError, ToolchainMissingError
from dfbuild.host import doctor, probes
from dfbuild.host.backends import Host

posix_only = pytest.mark.skipif(sys.platform.startswith("win"), reason="POSIX signals and shared-library layout")

FAKE_CMAKE = """\
cmake_minimum_required(VERSION 3.16)
project(fakellama C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_library(llama SHARED src/llama.c)
add_executable(llama-server tools/server/server.c)
target_link_libraries(llama-server PRIVATE llama)
target_compile_definitions(llama-server PRIVATE
    BUILD_COMMIT="${LLAMA_BUILD_COMMIT}" BUILD_NUMBER=${LLAMA_BUILD_NUMBER})
# a slow step, to interrupt a build in the middle
add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/slow.txt
    COMMAND ${CMAKE_COMMAND} -E sleep 4
    COMMAND ${CMAKE_COMMAND} -E touch ${CMAKE_BINARY_DIR}/slow.txt)
add_custom_target(slow DEPENDS ${CMAKE_BINARY_DIR}/slow.txt)
"""

FAKE_SERVER = """\
#include <stdio.h>
#include <string.h>
int llama_answer(void);
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("version: %d (%s)\\n", BUILD_NUMBER, BUILD_COMMIT);
        return 0;
    }
    return llama_answer() == 42 ? 0 : 1;
}
"""

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]


def git(tree: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout.strip()


def make_fake_tree(root: Path, tag: str = "b4242") -> Path:
    src = root / "src"
    (src / "src").mkdir(parents=True)
    (src / "tools" / "server").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(FAKE_CMAKE)
    (src / "src" / "llama.c").write_text("int llama_answer(void) { return 42; }\n")
    (src / "tools" / "server" / "server.c").write_text(FAKE_SERVER)
    git(src, "init", "-q")
    git(src, "add", "-A")
    git(src, "commit", "-q", "-m", "fake llama.cpp")
    git(src, "tag", tag)
    return src


def commit_change(src: Path, path: str, text: str) -> str:
    (src / path).write_text(text)
    git(src, "commit", "-q", "-am", f"change {path}")
    return git(src, "rev-parse", "HEAD")


@pytest.fixture
def tree(tmp_path) -> Path:
    return make_fake_tree(tmp_path / "fake")


def run_build(src: Path, build_dir: Path | None = None, **kwargs) -> dict:
    kwargs.setdefault("use_ccache", False)  # keep the toy objects out of the shared ccache
    return build.build_tree(src, BuildRequest("cpu", **kwargs), build_dir)


def version_of(binary: Path) -> str:
    return subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True).stdout


# --- the happy path -----------------------------------------------------------------------


@posix_only
def test_build_configures_once_then_is_a_noop(tree):
    head = git(tree, "rev-parse", "HEAD")
    first = run_build(tree)
    build_dir = tree.parent / "build-cpu"  # X/src -> X/build-cpu
    assert first["build_dir"] == str(build_dir)
    assert first["configured"] and not first["up_to_date"]
    assert first["binaries"] == ["bin/llama-server"]
    assert first["libraries"] == ["bin/libllama.so"] if sys.platform.startswith("linux") else first["libraries"]
    assert first["source_commit"] == head
    assert first["build_number"] == 4242  # from the b4242 tag
    assert first["flags"]["LLAMA_BUILD_COMMIT"] == head
    assert first["flags"].get("LLAMA_OPENSSL") == ("ON" if sys.platform.startswith("linux") else None)
    assert first["cpu_variants"] == []  # not a ggml tree
    assert version_of(build_dir / "bin" / "llama-server").strip() == f"version: 4242 ({head})"
    assert (build_dir / build.LOG_NAME).is_file()
    stamp = build.read_stamp(build_dir)
    assert stamp["backend"] == "cpu" and stamp["source_dir"] == str(tree)

    second = run_build(tree)
    assert not second["configured"]  # CMake is not re-run for unchanged flags
    assert second["up_to_date"]       # and ninja has nothing to do
    assert "ninja: no work to do." in (build_dir / build.LOG_NAME).read_text()


@posix_only
def test_a_new_commit_restamps_and_rebuilds_only_what_changed(tree):
    run_build(tree)
    build_dir = tree.parent / "build-cpu"
    library = build_dir / "bin" / "libllama.so"
    before = library.stat().st_mtime_ns if library.exists() else None
    head = commit_change(tree, "tools/server/server.c", FAKE_SERVER.replace("version:", "version: "))
    again = run_build(tree)
    assert again["configured"]  # the commit is a flag: CMake re-runs
    assert again["source_commit"] == head
    assert head in version_of(build_dir / "bin" / "llama-server")
    if before is not None:
        assert library.stat().st_mtime_ns == before  # the library did not change, so it was not rebuilt


@posix_only
def test_binaries_are_relocatable(tree, tmp_path):
    """$ORIGIN rpath: a copy of bin/ runs after the build dir is gone."""
    section = run_build(tree)
    moved = tmp_path / "unpacked"
    shutil.copytree(Path(section["build_dir"]) / "bin", moved)
    shutil.rmtree(section["build_dir"])
    assert subprocess.run([str(moved / "llama-server")]).returncode == 0
    if sys.platform.startswith("linux"):  # RUNPATH exactly $ORIGIN: never the build dir, never the current dir
        from dfbuild.core import elf

        for name in ("llama-server", "libllama.so"):
            assert elf.read(moved / name).runpath == "$ORIGIN", name


def build_naming_its_file(root: Path, **kwargs) -> bytes:
    """A fake tree whose libllama holds __FILE__ (ggml's asserts print theirs), built; the library's bytes."""
    src = make_fake_tree(root)
    (src / "src" / "llama.c").write_text('const char * llama_source = __FILE__;\nint llama_answer(void) { return 42; }\n')
    git(src, "commit", "-q", "-am", "llama.c names its file")
    build.build_tree(src, BuildRequest("cpu", **kwargs))
    return next((src.parent / "build-cpu" / "bin").glob("libllama.so*")).read_bytes()


@posix_only
def test_binaries_carry_no_build_folder(tmp_path):
    """CMake hands the compiler absolute paths; __FILE__ must come out relative to the tree."""
    data = build_naming_its_file(tmp_path / "one", use_ccache=False)
    assert b"\0src/llama.c\0" in data
    assert str(tmp_path).encode() not in data


@posix_only
@pytest.mark.skipif(shutil.which("ccache") is None, reason="needs ccache")
def test_trees_in_two_folders_share_ccache_and_neither_path_is_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "ccache"))
    libraries = [build_naming_its_file(tmp_path / name) for name in ("first", "second")]
    stats = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True).stdout
    hits = {k: int(v) for k, v in (line.split("\t") for line in stats.splitlines() if "\t" in line)}
    # llama.c of the second tree is a hit (server.c is not: the version stamp names another commit)
    assert hits.get("direct_cache_hit", 0) + hits.get("preprocessed_cache_hit", 0) >= 1, stats
    # (ccache's base_dir hands the compiler a path relative to the build dir: ../src/src/llama.c)
    assert libraries[0] == libraries[1]
    for data in libraries:
        assert b"src/llama.c\0" in data and str(tmp_path).encode() not in data


@posix_only
def test_dirty_tree_says_so_in_the_version(tree):
    (tree / "src" / "llama.c").write_text("int llama_answer(void) { return 42; } /* edited */\n")
    section = run_build(tree)
    assert section["source_dirty"]
    assert section["flags"]["LLAMA_BUILD_COMMIT"].endswith("-dirty")


@posix_only
def test_build_number_prefers_the_manifest_base(tree):
    from dfbuild.core import manifest

    manifest.update_tree_manifest(tree, "source", {"base": "b10359"})
    assert build.build_number(tree) == 10359


# --- build-dir ownership --------------------------------------------------------------------


@posix_only
def test_build_dir_of_another_source_is_refused_then_reconfigured(tree, tmp_path):
    run_build(tree)
    build_dir = tree.parent / "build-cpu"
    other = make_fake_tree(tmp_path / "other")
    with pytest.raises(BuildDirMismatchError) as exc:
        run_build(other, build_dir=build_dir)
    assert exc.value.exit_code == 32
    assert str(tree) in exc.value.message and "--reconfigure" in exc.value.hint
    assert build.read_stamp(build_dir)["source_dir"] == str(tree)  # refused: untouched

    section = run_build(other, build_dir=build_dir, reconfigure=True)
    assert section["configured"]
    assert build.read_stamp(build_dir)["source_dir"] == str(other)
    assert build.read_cmake_cache(build_dir)["CMAKE_HOME_DIRECTORY"] == str(other)


@posix_only
def test_build_dir_of_another_backend_is_refused(tree):
    run_build(tree)
    build_dir = tree.parent / "build-cpu"
    stamp = build.read_stamp(build_dir)
    stamp["backend"] = "vulkan"
    build.write_stamp(build_dir, stamp)
    with pytest.raises(BuildDirMismatchError) as exc:
        run_build(tree, build_dir=build_dir)
    assert "vulkan" in exc.value.message


@posix_only
def test_fresh_starts_over(tree):
    run_build(tree)
    build_dir = tree.parent / "build-cpu"
    marker = build_dir / "leftover.o"
    marker.write_text("x")
    section = run_build(tree, fresh=True)
    assert section["configured"] and not marker.exists()


def test_a_directory_that_is_not_a_build_dir_is_never_touched(tree, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    for kwargs in ({}, {"fresh": True}, {"reconfigure": True}):
        with pytest.raises(BuildDirMismatchError):
            run_build(tree, build_dir=precious, **kwargs)
    assert (precious / "thesis.tex").read_text() == "do not delete"
    assert not (precious / build.STAMP_NAME).exists()


def test_owner_of_a_plain_cmake_dir_comes_from_its_cache(tmp_path):
    (tmp_path / "CMakeCache.txt").write_text("CMAKE_HOME_DIRECTORY:INTERNAL=/x/src\nGGML_VULKAN:BOOL=ON\n")
    assert build.build_dir_owner(tmp_path) == {"backend": "vulkan", "source_dir": "/x/src"}


# --- failures ---------------------------------------------------------------------------------


@posix_only
@posix_only
def test_missing_toolchain_fails_fast_with_what_to_install(tree, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))  # no compiler, no glslc
    with pytest.raises(ToolchainMissingError) as exc:
        build.build_tree(tree, BuildRequest("cpu"))
    assert exc.value.exit_code == 30
    assert "C compiler" in exc.value.message
    assert not (tree.parent / "build-cpu").exists()


@posix_only
def test_compile_error_names_the_log_and_the_first_error(tree):
    commit_change(tree, "src/llama.c", "int llama_answer(void) { return 42 }\n")
    with pytest.raises(BuildError) as exc:
        run_build(tree)
    log = tree.parent / "build-cpu" / build.LOG_NAME
    assert exc.value.exit_code == 31
    assert "llama.c:1:" in exc.value.message and "error:" in exc.value.message
    assert str(log) in exc.value.hint


@posix_only
def test_configure_error_quotes_cmake(tree):
    commit_change(tree, "CMakeLists.txt", FAKE_CMAKE + "message(FATAL_ERROR \"no such toolkit\")\n")
    with pytest.raises(BuildError) as exc:
        run_build(tree)
    assert exc.value.message.startswith("CMake configure failed: CMake Error")
    assert "no such toolkit" in exc.value.message


@posix_only
def test_unknown_target(tree):
    with pytest.raises(BuildError) as exc:
        run_build(tree, targets=["llama-nonesuch"])
    assert "unknown target 'llama-nonesuch'" in exc.value.message


def test_not_a_llama_tree(tmp_path):
    from dfbuild.core.errors import NotLlamaTreeError

    with pytest.raises(NotLlamaTreeError):
        run_build(tmp_path)


@posix_only
def test_tree_without_a_commit_is_refused(tmp_path):
    src = make_fake_tree(tmp_path / "t")
    shutil.rmtree(src / ".git")
    with pytest.raises(SourceError) as exc:
        run_build(src)
    assert "no git commit" in exc.value.message


def test_unknown_backend_before_anything_else(tree):
    from dfbuild.core.errors import UnsupportedBackendError

    with pytest.raises(UnsupportedBackendError):
        build.build_tree(tree, BuildRequest("opencl"))
    assert not (tree.parent / "build-opencl").exists()


def test_backend_this_host_cannot_build_fails_fast(tree):
    """metal on Linux: refused by doctor before any build dir is made."""
    if sys.platform == "darwin":
        pytest.skip("metal can build on macOS")
    from dfbuild.core.errors import UnsupportedBackendError

    with pytest.raises(UnsupportedBackendError) as exc:
        build.build_tree(tree, BuildRequest("metal"))
    assert exc.value.exit_code == 33
    assert "only on macOS" in exc.value.message
    assert not (tree.parent / "build-metal").exists()


@pytest.mark.parametrize("lines, expected", [
    (["[1/3] Building C object x.o", "FAILED: x.o", "/s/ggml.c:12:5: error: 'y' undeclared",
      "/s/ggml.c:13:1: error: later"], "/s/ggml.c:12:5: error: 'y' undeclared"),
    (["In file included from a.h:1,", "b.cpp:3:10: fatal error: cublas_v2.h: No such file or directory"],
     "b.cpp:3:10: fatal error: cublas_v2.h: No such file or directory"),
    (["C:\\s\\ggml.cpp(42): error C2065: 'x': undeclared identifier"],
     "C:\\s\\ggml.cpp(42): error C2065: 'x': undeclared identifier"),
    (["/s/ggml-cuda/mmq.cu(7): error: identifier \"foo\" is undefined"],
     "/s/ggml-cuda/mmq.cu(7): error: identifier \"foo\" is undefined"),
    (["CMake Error at ggml/src/ggml-vulkan/CMakeLists.txt:9 (find_package):", "",
      "  Could NOT find Vulkan (missing: glslc)"],
     "CMake Error at ggml/src/ggml-vulkan/CMakeLists.txt:9 (find_package): Could NOT find Vulkan (missing: glslc)"),
    # b11434's CUDA configure on a toolkit without libcuda.so (a toolkit made of pip wheels): the target's
    # name is on the message's second line
    (["CMake Error at ggml/src/ggml-cuda/CMakeLists.txt:181 (target_link_libraries):",
      "  Target \"ggml-cuda\" links to:", "", "    CUDA::cuda_driver", "",
      "  but the target was not found.  Possible reasons include:", "", "    * There is a typo in the target name.",
      "-- Generating done"],
     "CMake Error at ggml/src/ggml-cuda/CMakeLists.txt:181 (target_link_libraries): Target \"ggml-cuda\" links "
     "to: CUDA::cuda_driver but the target was not found."),
    (["CMake Error: The source directory \"/x\" does not exist.", "Specify --help for usage."],
     "CMake Error: The source directory \"/x\" does not exist."),
    (["ninja: error: unknown target 'x'"], "ninja: error: unknown target 'x'"),
    (["all good"], None),
])
def test_first_error(lines, expected):
    assert build.first_error(lines) == expected


# --- Ctrl-C ---------------------------------------------------------------------------------


@posix_only
def test_interrupted_build_resumes(tree):
    cmd = [sys.executable, "-m", "dfbuild.cli", "build", "--dir", str(tree), "--backend", "cpu",
           "--no-ccache", "--target", "slow", "--target", "llama-server"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    build_dir = tree.parent / "build-cpu"
    deadline = time.monotonic() + 120
    # wait until configure is done and ninja is inside the slow step
    while time.monotonic() < deadline and not (build.read_stamp(build_dir) or {}).get("configured_args"):
        time.sleep(0.2)
    time.sleep(1.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not (build_dir / "slow.txt").exists()
    json.loads((build_dir / build.STAMP_NAME).read_text())  # the stamp survived whole
    assert "interrupted" in (build_dir / build.LOG_NAME).read_text()

    section = run_build(tree, targets=["slow", "llama-server"])
    assert not section["configured"]  # resumes: no reconfigure
    assert (build_dir / "slow.txt").exists()
    assert section["binaries"] == ["bin/llama-server"]


# --- flags for hosts that cannot run here --------------------------------------------------------


def fake_entry(**found) -> dict:
    """A doctor entry as check_backend returns it, with the given probes found."""
    toolchain = [{"name": name, "found": True, "ok": True, "optional": name == "ccache",
                  "path": path, "version": version} for name, (path, version) in found.items()]
    return {"toolchain": toolchain}


def test_cuda_flags_on_a_linux_gpu_host():
    entry = fake_entry(nvcc=("/usr/local/cuda/bin/nvcc", "13.0"), ccache=("/usr/bin/ccache", "4.9"))
    flags = build.build_flags("cuda", Host("linux", "x64"), commit="c0ffee", number=10359, entry=entry,
                              cuda_arch="90")
    assert flags["CMAKE_CUDA_ARCHITECTURES"] == "90"
    assert flags["GGML_CUDA"] == "ON" and flags["GGML_CUDA_NCCL"] == "OFF"
    assert flags["CMAKE_CUDA_COMPILER_LAUNCHER"] == "/usr/bin/ccache"
    assert flags["LLAMA_BUILD_NUMBER"] == "10359" and flags["LLAMA_BUILD_COMMIT"] == "c0ffee"
    with pytest.raises(Exception) as exc:  # nvcc 13 cannot build Pascal
        build.build_flags("cuda", Host("linux", "x64"), commit="c", number=1, entry=entry, cuda_arch="61")
    assert "sm_61" in str(exc.value)


def test_windows_cuda_flags_for_the_reporter():
    """Windows 11, MSVC 19.44, CUDA 12.4, RTX 30xx (sm_86)."""
    entry = fake_entry(nvcc=(r"C:\CUDA\v12.4\bin\nvcc.exe", "12.4"))
    flags = build.build_flags("cuda", Host("windows", "x64"), commit="c", number=1, entry=entry, cuda_arch="86")
    assert flags["CMAKE_CUDA_ARCHITECTURES"] == "86"
    assert "CMAKE_INSTALL_RPATH" not in flags
    assert "CMAKE_C_COMPILER_LAUNCHER" not in flags  # no ccache found


def test_metal_flags_on_macos():
    flags = build.build_flags("metal", Host("macos", "arm64"), commit="c", number=1, entry=fake_entry())
    assert flags["GGML_METAL"] == "ON" and flags["GGML_METAL_EMBED_LIBRARY"] == "ON"
    assert flags["CMAKE_INSTALL_RPATH"] == "@loader_path"


@posix_only
def test_hip_flags_use_rocm_clang(tmp_path):
    hipconfig = tmp_path / "hipconfig"
    hipconfig.write_text("#!/bin/sh\n[ \"$1\" = -l ] && echo /opt/rocm/llvm/bin\n")
    hipconfig.chmod(0o755)
    entry = fake_entry(**{"hip-clang": (str(hipconfig), "6.4"), "ccache": ("/usr/bin/ccache", "4.9")})
    flags = build.build_flags("hip", Host("linux", "x64"), commit="c", number=1, entry=entry, gpu_targets="rdna4")
    assert flags["GPU_TARGETS"] == "gfx1200;gfx1201"
    assert flags["CMAKE_HIP_COMPILER"] == "/opt/rocm/llvm/bin/clang"
    assert flags["CMAKE_HIP_COMPILER_LAUNCHER"] == "/usr/bin/ccache"


def test_windows_without_msvc_says_how_to_get_a_developer_prompt(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "find_msvc", lambda arch="x64": None)
    with pytest.raises(ToolchainMissingError) as exc:
        build.build_env("cpu", Host("windows", "x64"), tmp_path / "src", tmp_path / "build-cpu")
    assert "Native Tools Command Prompt" in exc.value.hint


def test_windows_with_vcvars_loads_the_msvc_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "find_msvc", lambda arch="x64": {"cl": None, "vcvars": "C:/vcvars64.bat",
                                                                 "version": "17.14"})
    monkeypatch.setattr(probes, "msvc_environment", lambda vcvars: {"INCLUDE": "C:/VS/include"})
    env = build.build_env("cpu", Host("windows", "x64"), tmp_path / "src", tmp_path / "build-cpu")
    assert env["INCLUDE"] == "C:/VS/include"


def test_windows_binaries_are_exe(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server.exe").write_text("")
    (tmp_path / "bin" / "llama.dll").write_text("")
    binaries, libraries = build._binaries(tmp_path, ["llama-server"], Host("windows", "x64"))
    assert binaries == ["bin/llama-server.exe"] and libraries == ["bin/llama.dll"]


def test_ccache_env_hits_across_copies(tmp_path):
    env = build.build_env("cpu", Host("linux", "x64"), tmp_path / "X" / "src", tmp_path / "X" / "build-cpu")
    if "CCACHE_BASEDIR" not in os.environ:
        assert env["CCACHE_BASEDIR"] == str((tmp_path / "X").resolve())
    assert env["CCACHE_NOHASHDIR"] == "true"


def test_source_date_epoch_never_reaches_cmake(monkeypatch, tmp_path):
    """ggml turns AVX2/FMA/... defaults off when SOURCE_DATE_EPOCH is set: reproducible builds must keep them."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "946684800")
    env = build.build_env("cpu", Host("linux", "x64"), tmp_path / "X" / "src", tmp_path / "X" / "build-cpu")
    assert "SOURCE_DATE_EPOCH" not in env


def test_targets_accept_lists_and_all():
    assert build.parse_targets(()) == ["llama-server"]
    assert build.parse_targets(("llama-server,llama-cli", "rpc-server", "llama-cli")) == [
        "llama-server", "llama-cli", "rpc-server"]
    assert build.parse_targets("all") == ["all"]


def test_cpu_variants_default_to_all_and_accept_a_subset():
    x64 = Host("linux", "x64")
    everything = build.parse_cpu_variants(None, x64)
    assert everything[0] == "x64" and {"sse42", "haswell", "skylakex", "zen4", "sapphirerapids"} <= set(everything)
    assert build.parse_cpu_variants("all", x64) == everything
    assert build.parse_cpu_variants("haswell,x64", x64) == ["x64", "haswell"]  # ggml's order, baseline first
    assert "sapphirerapids" not in build.parse_cpu_variants(None, Host("windows", "x64"))  # MSVC builds fewer
    with pytest.raises(BuildError, match="unknown variant"):
        build.parse_cpu_variants("x64,pentium", x64)
    with pytest.raises(BuildError, match="no runtime-dispatched"):
        build.parse_cpu_variants("x64", Host("macos", "arm64"))
    assert build.parse_cpu_variants(None, Host("macos", "arm64")) == []
    # Linux arm64: ggml's armv8.x/armv9.x variants, as llama.cpp's ubuntu-arm64 release
    arm64 = Host("linux", "arm64")
    assert build.parse_cpu_variants(None, arm64)[:2] == ["armv8.0_1", "armv8.2_1"]
    assert build.parse_cpu_variants("armv8.2_2,armv8.0_1", arm64) == ["armv8.0_1", "armv8.2_2"]


@posix_only
def test_target_all_ships_every_program(tree):
    """--target all: every program the tree builds is a shipped binary (the glob used to find none)."""
    cmake = (tree / "CMakeLists.txt").read_text() + "add_executable(llama-cli tools/server/server.c)\n" \
        "target_compile_definitions(llama-cli PRIVATE BUILD_COMMIT=\"x\" BUILD_NUMBER=1)\n" \
        "target_link_libraries(llama-cli PRIVATE llama)\n"
    cmake += "add_library(llama-cli-impl SHARED src/llama.c)\ntarget_link_libraries(llama-cli PRIVATE llama-cli-impl)\n"
    commit_change(tree, "CMakeLists.txt", cmake)
    section = run_build(tree, targets=["all"])
    assert section["binaries"] == ["bin/llama-cli", "bin/llama-server"]
    assert section["targets"] == ["all"]
    impl = "bin/libllama-cli-impl" + (".dylib" if sys.platform == "darwin" else ".so")
    assert impl in section["libraries"]  # llama.cpp builds each tool as lib<tool>-impl.so
    # the same build dir, llama-server alone: the other tool's own library is not shipped with it
    alone = run_build(tree, targets=["llama-server"])
    assert alone["binaries"] == ["bin/llama-server"] and impl not in alone["libraries"]
    assert "bin/libllama.so" in alone["libraries"]


# --- the command ---------------------------------------------------------------------------------


@posix_only
def test_build_command_json_and_manifest(tree):
    from dfbuild.core import manifest

    result = CliRunner().invoke(main, ["build", "--dir", str(tree), "--backend", "cpu", "--no-ccache", "--json"])
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)
    assert section["backend"] == "cpu" and section["binaries"] == ["bin/llama-server"]
    for key in ("flags", "toolchain", "targets", "wall_time_s", "source_commit", "build_dir"):
        assert key in section
    assert section["toolchain"]["cmake"] and section["toolchain"]["ninja"]
    assert manifest.load(manifest.tree_manifest_path(tree))["build"]["source_commit"] == section["source_commit"]

    again = CliRunner().invoke(main, ["build", "--dir", str(tree), "--backend", "cpu", "--no-ccache"])
    assert again.exit_code == 0
    assert "already up to date" in again.stdout  # the result, with the binaries' paths, on stdout
    assert str(Path(section["build_dir"]) / "bin" / "llama-server") in again.stdout
    # the next step, on stderr as pip and cibuildwheel say it, whole, to copy as is
    assert f"next: dfbuild smoke --build-dir {section['build_dir']} --backend cpu" in again.stderr
    assert "next:" not in again.stdout


def test_build_command_unknown_backend(tree):
    # --backend is a choice, as --os is: an unknown name is a usage error (2), a known one this host
    # cannot build is 33
    result = CliRunner().invoke(main, ["build", "--dir", str(tree), "--backend", "opencl"])
    assert result.exit_code == 2
    assert "'opencl' is not one of" in result.stderr


# --- the real thing -------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_real_cpu_build():
    """The tree the other integration tests use (X/src + X/build-cpu): the "any head" proof's, patched,
    which that proof built (no build of its own in CI)."""
    from realtrees import REAL_BASE, TEST_CPU_VARIANTS, checkout_tree

    number = int(REAL_BASE[1:])
    src = checkout_tree(REAL_BASE, patched=True)
    head = git(src, "rev-parse", "HEAD")
    first = build.build_tree(src, BuildRequest("cpu", cpu_variants=TEST_CPU_VARIANTS))
    build_dir = Path(first["build_dir"])
    assert build_dir == src.parent / "build-cpu"
    assert first["binaries"] == ["bin/llama-server"]
    assert any("libllama" in lib for lib in first["libraries"])
    assert first["build_number"] == number
    version = subprocess.run([str(build_dir / "bin" / "llama-server"), "--version"],
                             capture_output=True, text=True)
    # b10355 prints "version: 10355 (<full sha>)" (b10359's tree: "version: 0.2.0-dev (build 10359, commit <sha>)")
    assert f"{number} ({head})" in version.stdout + version.stderr or \
        f"build {number}, commit {head}" in version.stdout + version.stderr, version.stdout + version.stderr

    if os.uname().machine == "x86_64":  # the runtime-dispatched CPU variants, and only those asked for
        assert first["cpu_variants"] == TEST_CPU_VARIANTS.split(",")
        assert sorted(Path(lib).name for lib in first["libraries"] if "ggml-cpu-" in lib) == sorted(
            f"libggml-cpu-{variant}.so" for variant in TEST_CPU_VARIANTS.split(","))
    second = build.build_tree(src, BuildRequest("cpu", cpu_variants=TEST_CPU_VARIANTS))
    assert not second["configured"] and second["up_to_date"]
    assert second["compiled_steps"] == 0


# --- the split version stamp (issue: a changed patch rebuilds only what it changes) ----------------

STAMPED_CMAKE = """\
cmake_minimum_required(VERSION 3.16)
project(fakellama C CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
# as llama.cpp does: the commit goes into a generated build-info.cpp, ggml gets it as a define,
# and CMake re-runs whenever the git index changes
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/.git/index")
configure_file(common/build-info.cpp.in ${CMAKE_BINARY_DIR}/common/build-info.cpp)
add_library(ggml SHARED ggml/ggml.c)
target_compile_definitions(ggml PRIVATE GGML_COMMIT="${LLAMA_BUILD_COMMIT}")
add_library(llama SHARED src/llama.c common/speculative.cpp ${CMAKE_BINARY_DIR}/common/build-info.cpp)
target_link_libraries(llama PRIVATE ggml)
add_executable(llama-server tools/server/server.c)
target_link_libraries(llama-server PRIVATE llama)
"""

STAMPED_SERVER = """\
#include <stdio.h>
#include <string.h>
extern const char * LLAMA_COMMIT;
int speculate(void);
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("version: 1 (build 1, commit %s) %d\\n", LLAMA_COMMIT, speculate());
        return 0;
    }
    return 0;
}
"""

BUILD_INFO_IN = """\
char const * LLAMA_COMMIT = "@LLAMA_BUILD_COMMIT@";
"""


@posix_only
def test_a_changed_patch_recompiles_only_its_file_and_the_stamp(tmp_path):
    src = tmp_path / "fake" / "src"
    for path, text in {
        "CMakeLists.txt": STAMPED_CMAKE,
        "common/build-info.cpp.in": BUILD_INFO_IN,
        "common/speculative.cpp": 'extern "C" int speculate(void) { return 1; }\n',
        "ggml/ggml.c": "const char * ggml_commit(void) { return GGML_COMMIT; }\n",
        "src/llama.c": "int llama_answer(void) { return 42; }\n",
        "tools/server/server.c": STAMPED_SERVER,
    }.items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(text)
    git(src, "init", "-q")
    git(src, "add", "-A")
    git(src, "commit", "-q", "-m", "fake llama.cpp")
    base = git(src, "rev-parse", "HEAD")
    first = run_build(src)
    server = Path(first["build_dir"]) / "bin" / "llama-server"
    assert first["flags"]["LLAMA_BUILD_COMMIT"] == base and first["stamped_commit"] == base
    assert f"commit {base}) 1" in version_of(server)

    # a concern commit, as `dfbuild apply` makes one (dfbuild's identity and the concern trailer)
    (src / "common" / "speculative.cpp").write_text('extern "C" int speculate(void) { return 2; }\n')
    env = {**os.environ, "GIT_AUTHOR_NAME": "dfbuild", "GIT_AUTHOR_EMAIL": "dfbuild@localhost",
           "GIT_COMMITTER_NAME": "dfbuild", "GIT_COMMITTER_EMAIL": "dfbuild@localhost"}
    subprocess.run(["git", "-C", str(src), "commit", "-q", "-am", "spec : a fix\n\nDfbuild-Concern: zero-fill\n"],
                   check=True, env=env)
    patched = git(src, "rev-parse", "HEAD")
    second = run_build(src)

    assert not second["configured"]  # same configure arguments: the base's commit
    assert second["flags"]["LLAMA_BUILD_COMMIT"] == base and second["stamped_commit"] == patched
    assert f"commit {patched}) 2" in version_of(server)
    log = (Path(second["build_dir"]) / build.LOG_NAME).read_text()
    compiled = sorted(line.split("Building ")[1].split()[-1] for line in log.splitlines() if "Building " in line)
    assert [Path(c).name for c in compiled] == ["build-info.cpp.o", "speculative.cpp.o"], log
    # nothing changed: nothing compiled, and the stamp stays
    third = run_build(src)
    assert third["up_to_date"] and f"commit {patched}) 2" in version_of(server)
