"""Windows x64 from Linux (`--os windows`): the target table, the toolchain, the zip and its PE checks (fast).

The real cross-build of b11434, its Wine smoke and its proof are in
test_windows_real.py (slow); these run in seconds, with the mingw-w64 compilers
where a test needs to make a real PE file (skipped, saying why, without them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dfbuild.build import tree as build
from dfbuild.core.errors import ToolchainMissingError, UnsupportedBackendError
from dfbuild.host import backends, doctor, pe, platforms
from dfbuild.host.backends import Host
from dfbuild.host.platforms import windows
from dfbuild.release import pipeline as release
from dfbuild.verify import release_dir as verify

LINUX = Host("linux", "x64", "debian", "12")
WINDOWS_ON_LINUX = Host("windows", "x64", "debian", "12", build_os="linux")
MINGW = shutil.which("x86_64-w64-mingw32-gcc-posix")
needs_mingw = pytest.mark.skipif(MINGW is None or not sys.platform.startswith("linux"),
                                 reason="the mingw-w64 cross compiler is not installed "
                                        "(apt-get install gcc-mingw-w64-x86-64-posix)")


# --- the target table ------------------------------------------------------------------------


def test_os_defaults_to_the_host_and_windows_is_a_cross_target_on_linux():
    assert platforms.target_host(None, LINUX) == LINUX
    assert platforms.target_host("linux", LINUX) == LINUX
    target = platforms.target_host("windows", LINUX)
    assert (target.os, target.arch, target.build_os, target.cross) == ("windows", "x64", "linux", True)
    assert target.exe_suffix == ".exe"
    # the install hints of the machine that installs: Debian's, not Windows'
    assert target.install_keys() == ["debian-12", "debian", "linux"]
    assert platforms.cross(LINUX) is None and platforms.cross(target) is windows


def test_macos_on_linux_is_refused_clearly_with_exit_33():
    with pytest.raises(UnsupportedBackendError) as caught:
        platforms.target_host("macos", LINUX)
    assert caught.value.exit_code == 33
    assert "no cross toolchain" in caught.value.message and "macOS runner" in caught.value.message
    with pytest.raises(UnsupportedBackendError):
        platforms.target_host("beos", LINUX)


def test_a_cross_build_gets_its_own_build_dirs_and_gcc_s_cpu_variants():
    assert build.dir_label("cpu", LINUX) == "cpu"
    assert build.dir_label("cpu", WINDOWS_ON_LINUX) == "cpu-windows"
    assert build.default_build_dir(Path("/w/src"), "cpu", WINDOWS_ON_LINUX) == Path("/w/build-cpu-windows")
    # MSVC skips some variants; mingw-w64 GCC compiles them all, as on Linux
    assert backends.host_cpu_variants(WINDOWS_ON_LINUX) == backends.cpu_variants("linux", "x64")
    assert "zen4" not in backends.host_cpu_variants(Host("windows", "x64"))


def test_cross_flags_turn_on_shared_libraries_and_say_what_tls_is():
    entry = {"toolchain": []}
    flags = build.build_flags("cpu", WINDOWS_ON_LINUX, commit="c" * 40, number=1, entry=entry, use_ccache=False)
    assert flags["BUILD_SHARED_LIBS"] == "ON"          # GGML_BACKEND_DL needs it; MinGW's default is OFF
    assert flags["GGML_BACKEND_DL"] == "ON" and flags["GGML_CPU_ALL_VARIANTS"] == "ON"
    # TLS through llama.cpp's own OpenSSL path, linked with the OpenSSL dfbuild builds for the target
    assert flags["LLAMA_BUILD_BORINGSSL"] == "OFF" and flags["LLAMA_OPENSSL"] == "ON"
    # a native Windows (MSVC) build keeps BoringSSL, as llama.cpp's release does
    native = build.build_flags("cpu", Host("windows", "x64"), commit="c" * 40, number=1, entry=entry, use_ccache=False)
    assert native["LLAMA_BUILD_BORINGSSL"] == "ON" and "BUILD_SHARED_LIBS" not in native


def test_the_toolchain_file_dfbuild_writes(tmp_path):
    text = windows.toolchain_text(WINDOWS_ON_LINUX, tmp_path / "rules.cmake", tmp_path / "exit.obj")
    assert f"-Wl,--wrap=exit,--exclude-symbols,__wrap_exit {(tmp_path / 'exit.obj').as_posix()}" in text
    assert "set(CMAKE_SYSTEM_NAME Windows)" in text
    assert "x86_64-w64-mingw32-g++-posix" in text
    assert "-static-libgcc -static-libstdc++ -Wl,--exclude-libs,ALL -Wl,--no-insert-timestamp" in text
    assert f'CMAKE_USER_MAKE_RULES_OVERRIDE "{(tmp_path / "rules.cmake").as_posix()}"' in text
    assert 'set(CMAKE_SHARED_MODULE_PREFIX "")' in windows.RULES_TEXT  # ggml loads ggml-cpu-*.dll


# --- doctor -------------------------------------------------------------------------------------


@pytest.fixture
def no_tools(monkeypatch, tmp_path):
    """A PATH with nothing on it, and probes that look nowhere else."""
    from helpers import isolate_probes

    return isolate_probes(monkeypatch, tmp_path)[1]


def test_doctor_without_the_cross_toolchain_names_the_packages(no_tools):
    entry = doctor.check_backend("cpu", WINDOWS_ON_LINUX)
    assert not entry["can_build"]
    assert entry["missing"][:2] == ["mingw-gcc", "mingw-gxx"]
    assert entry["missing_to_run"] == ["wine"]
    line = entry["install"][0]
    assert line == ("apt-get install g++-mingw-w64-x86-64-posix gcc-mingw-w64-x86-64-posix wine wine64 make perl")
    with pytest.raises(ToolchainMissingError) as caught:
        doctor.require("cpu", WINDOWS_ON_LINUX)
    assert caught.value.exit_code == 30 and "g++-mingw-w64-x86-64-posix" in (caught.value.hint or "")


def test_doctor_hint_names_only_what_is_missing_not_the_cross_toolchain_already_there(monkeypatch):
    # mingw-w64, Wine, Xvfb and glslc all found; only the Vulkan headers missing: the hint is theirs,
    # not an apt-get line for the cross toolchain this machine already has
    def found_but_headers(name, host, *, optional=False, extra_include_dirs=()):
        missing = name in ("vulkan-headers", "xvfb")
        return doctor.Probe(name=name, what=name, found=not missing, optional=optional,
                            install=f"install {name}" if missing else None)

    monkeypatch.setattr(doctor, "probe", found_but_headers)
    entry = doctor.check_backend("vulkan", WINDOWS_ON_LINUX)
    assert entry["missing"] == ["vulkan-headers"] and entry["missing_to_run"] == ["xvfb"]
    assert entry["install"] == ["install vulkan-headers", "install xvfb"]
    with pytest.raises(ToolchainMissingError) as caught:
        doctor.require("vulkan", WINDOWS_ON_LINUX)
    assert "mingw" not in (caught.value.hint or "") and "install vulkan-headers" in caught.value.hint


def test_doctor_for_cuda_on_windows_from_linux_says_where_it_builds():
    entry = doctor.check_backend("cuda", WINDOWS_ON_LINUX)
    assert not entry["can_build"] and not entry["toolchain"]
    assert "Windows runner" in entry["reason"]


@needs_mingw
def test_doctor_with_the_toolchain_can_build():
    entry = doctor.check_backend("cpu", platforms.target_host("windows"))
    assert entry["can_build"], entry["reason"]
    names = [p["name"] for p in entry["toolchain"]]
    assert names[:2] == ["mingw-gcc", "mingw-gxx"] and "c-compiler" not in names and "openssl-headers" not in names


# --- the compat header: on evidence, and it can fail ----------------------------------------------


@needs_mingw
def test_the_compat_header_is_used_only_when_the_headers_lack_the_declarations(tmp_path):
    host = platforms.target_host("windows")
    missing = windows.missing_declarations(host)
    uses = tmp_path / "uses.c"
    # what ggml-cpu.c does to keep Windows 11 from parking its threads
    uses.write_text("#include <windows.h>\nint f(void) { THREAD_POWER_THROTTLING_STATE t; ZeroMemory(&t, sizeof(t));\n"
                    "  t.Version = THREAD_POWER_THROTTLING_CURRENT_VERSION;\n"
                    "  t.ControlMask = THREAD_POWER_THROTTLING_EXECUTION_SPEED;\n"
                    "  return SetThreadInformation(GetCurrentThread(), ThreadPowerThrottling, &t, sizeof(t)); }\n")
    plain = subprocess.run([MINGW, "-c", "-o", str(tmp_path / "a.o"), str(uses)], capture_output=True, text=True)
    assert (plain.returncode != 0) == ("THREAD_POWER_THROTTLING_STATE" in missing), plain.stderr
    if missing:  # mingw-w64 10 (Debian 12): the header makes the same code compile, nothing dropped
        header = tmp_path / windows.COMPAT_NAME
        header.write_text(windows.compat_header(missing))
        fixed = subprocess.run([MINGW, "-include", str(header), "-c", "-o", str(tmp_path / "b.o"), str(uses)],
                               capture_output=True, text=True)
        assert fixed.returncode == 0, fixed.stderr
        symbols = subprocess.run(["x86_64-w64-mingw32-nm", str(tmp_path / "b.o")], capture_output=True, text=True)
        assert "SetThreadInformation" in symbols.stdout  # the call is compiled in


# --- PE reading and the zip -------------------------------------------------------------------------


def _mingw(tmp: Path, *args: str) -> None:
    subprocess.run([MINGW, *args], cwd=tmp, check=True, capture_output=True)


def make_windows_build(build_dir: Path, commit: str) -> dict:
    """A real (tiny) Windows build: llama-server.exe importing llama.dll (which imports kernel32 only)."""
    bin_dir = build_dir / "bin"
    bin_dir.mkdir(parents=True)
    (build_dir / "llama.c").write_text("__declspec(dllexport) int llama_answer(void) { return 42; }\n")
    (build_dir / "server.c").write_text(
        "#include <stdio.h>\n#include <string.h>\n__declspec(dllimport) int llama_answer(void);\n"
        "int main(int argc, char **argv) {\n"
        f'  if (argc > 1 && !strcmp(argv[1], "--version")) {{ printf("version: 1 (build 1, commit {commit})\\n"); '
        "return llama_answer() - 42; }\n  return 0; }\n")
    _mingw(build_dir, "-shared", "-o", "bin/llama.dll", "llama.c", "-Wl,--out-implib,libllama.dll.a")
    _mingw(build_dir, "-o", "bin/llama-server.exe", "server.c", "-L.", "-lllama")
    return {
        "backend": "cpu",
        "host": {"os": "windows", "arch": "x64", "build_os": "linux"},
        "source_commit": commit,
        "build_number": 1,
        "build_dir": str(build_dir),
        "flags": {"GGML_NATIVE": "OFF", "LLAMA_BUILD_COMMIT": commit},
        "binaries": ["bin/llama-server.exe"],
        "libraries": ["bin/llama.dll"],
    }


@pytest.fixture
def windows_inputs(tmp_path):
    from test_release_unit import make_tree, series_section

    tree, head = make_tree(tmp_path)
    sections = {
        "source": {"kind": "sdist", "base": "b11434", "commit": head, "dir": str(tree)},
        "series": series_section(head),
        "build": make_windows_build(tmp_path / "build-cpu-windows", head),
        "smoke": {"passed": True, "failed": [], "results": {}},
    }
    return {"tree": tree, "head": head, "sections": sections, "tmp": tmp_path}


def package_windows(inputs, out: Path) -> dict:
    from dfbuild import series

    rel = release.package(inputs["sections"], tree=inputs["tree"], patches_root=series.load_series().root,
                          out_dir=out, work_dir=inputs["tmp"] / "work-package")
    full = {**{k: release.portable(v) for k, v in inputs["sections"].items()}, "release": {**rel, "stages": {}}}
    full["release"].pop("reused")
    (out / "manifest.json").write_text(json.dumps(full, indent=2, sort_keys=True))
    return rel


@needs_mingw
def test_pe_reading_machine_and_imports(windows_inputs):
    bin_dir = Path(windows_inputs["sections"]["build"]["build_dir"]) / "bin"
    exe = (bin_dir / "llama-server.exe").read_bytes()
    assert pe.is_pe(exe) and not pe.is_pe(b"MZ" + b"\0" * 100) and not pe.is_pe(b"\x7fELF")
    info = pe.read(exe)
    assert info.machine == "x64" and not info.dll
    assert "llama.dll" in info.imports and "KERNEL32.dll" in info.imports
    assert pe.unresolved_imports(info, {"llama.dll"}) == []
    assert pe.unresolved_imports(info, set()) == ["llama.dll"]
    assert pe.read((bin_dir / "llama.dll").read_bytes()).dll


@needs_mingw
def test_the_windows_zip_verifies_and_fails_without_a_dll_it_imports(windows_inputs, tmp_path):
    out = tmp_path / "out"
    rel = package_windows(windows_inputs, out)
    assert rel["archive"].endswith("-bin-win-cpu-x64.zip") and "-dflash-" in rel["tag"]
    assert [a["kind"] for a in rel["artifacts"]] == ["archive"]   # a cross build ships no wheel
    report = verify.verify(out, run_binaries=False)
    assert report["ok"], report["problems"]
    assert any("PE files are x64" in n for n in report["checked"]), report["checked"]
    paths_in_zip = zipfile.ZipFile(out / rel["archive"]).namelist()
    # flat, as llama.cpp's Windows zips: the .exe, its DLLs and dfbuild's own files at the top, no folder
    assert rel["layout"] == "flat" and rel["root"] is None
    assert {"llama-server.exe", "llama.dll", "LICENSE", "manifest.json", "licenses/winpthreads-COPYING.txt"} \
        <= set(paths_in_zip), paths_in_zip

    # the same build without llama.dll: every other check passes, the import does not resolve
    windows_inputs["sections"]["build"]["libraries"] = []
    broken = tmp_path / "broken"
    package_windows(windows_inputs, broken)
    report = verify.verify(broken, run_binaries=False)
    assert not report["ok"]
    assert any("imports llama.dll, which is neither in the archive nor a Windows system DLL" in p
               for p in report["problems"]), report["problems"]


@needs_mingw
def test_verify_fails_a_pe_file_that_names_a_build_path_or_the_wrong_machine(windows_inputs, tmp_path):
    build_dir = Path(windows_inputs["sections"]["build"]["build_dir"])
    (build_dir / "llama.c").write_text('__declspec(dllexport) const char *where = "/work/someone/build/ggml.c";\n'
                                       "__declspec(dllexport) int llama_answer(void) { return 42; }\n")
    _mingw(build_dir, "-shared", "-o", "bin/llama.dll", "llama.c")
    out = tmp_path / "out"
    package_windows(windows_inputs, out)
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any("names an absolute build path: /work/someone/build/ggml.c" in p for p in problems), problems
    info = pe.read((build_dir / "bin" / "llama.dll").read_bytes())
    assert info.machine == "x64"

    # the same DLL claiming to be for ARM64 (IMAGE_FILE_MACHINE_ARM64 in its COFF header)
    _mingw(build_dir, "-shared", "-o", "bin/llama.dll", "llama.c")  # no planted path this time
    dll = bytearray((build_dir / "bin" / "llama.dll").read_bytes())
    header = int.from_bytes(dll[0x3C:0x40], "little") + 4
    dll[header:header + 2] = (0xAA64).to_bytes(2, "little")
    (build_dir / "bin" / "llama.dll").write_bytes(bytes(dll))
    out = tmp_path / "out-arm"
    package_windows(windows_inputs, out)
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any(": llama.dll is a arm64 PE file, not x64" in p for p in problems), problems


WINE = shutil.which("wine")


@needs_mingw
@pytest.mark.integration
@pytest.mark.skipif(WINE is None, reason="wine is not installed (apt-get install wine wine64)")
def test_verify_runs_the_exe_under_wine_only_when_every_check_passed(windows_inputs, tmp_path):
    out = tmp_path / "out"
    package_windows(windows_inputs, out)
    report = verify.verify(out, run_binaries=True)
    assert report["ok"], report["problems"]
    assert any("--version names the patched commit" in n for n in report["checked"]), report["checked"]

    windows_inputs["sections"]["build"]["libraries"] = []   # llama.dll missing: never run
    broken = tmp_path / "broken"
    package_windows(windows_inputs, broken)
    report = verify.verify(broken, run_binaries=True)
    assert not report["ok"]
    assert any("not run: another check of this directory failed" in n or "not run: the archive failed" in n
               for n in report["checked"] + report["problems"]), report


# --- exit(): llama-server.exe --version must end --------------------------------------------------

_GC_DLL = """\
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
// what llama-server's stream session manager does: a thread waiting on a condition variable,
// started before the arguments are parsed, stopped by a static destructor
struct gc {
  std::thread t; std::mutex m; std::condition_variable cv; bool running = false;
  void start() { { std::lock_guard<std::mutex> l(m); running = true; }
    t = std::thread([this] { std::unique_lock<std::mutex> l(m);
                             cv.wait_for(l, std::chrono::seconds(600), [this] { return !running; }); }); }
  ~gc() { { std::lock_guard<std::mutex> l(m); running = false; } cv.notify_all(); if (t.joinable()) t.join(); }
};
static gc g;
extern "C" __declspec(dllexport) void start_gc() { g.start(); }
"""
_GC_MAIN = """\
#include <cstdio>
#include <cstdlib>
#include <windows.h>
extern "C" __declspec(dllimport) void start_gc();
int main() { start_gc(); Sleep(300); printf("version: 1\\n"); exit(3); }   // as --version does, from arg.cpp
"""


def _exits_within(exe: Path, seconds: float) -> int | None:
    """EXE's exit code under Wine, or None when it is still running after SECONDS (then killed)."""
    from dfbuild import smoke

    prefix, env = smoke.launcher_for(exe)
    with open(exe.with_suffix(".log"), "wb") as log:  # a file: Wine's services keep inherited pipes open
        process = subprocess.Popen([*prefix, str(exe)], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env={**__import__("os").environ, **env},
                                   cwd=exe.parent)
        try:
            return process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None


@needs_mingw
@pytest.mark.integration
@pytest.mark.skipif(WINE is None, reason="wine is not installed (apt-get install wine wine64)")
def test_exit_with_a_waiting_thread_ends_only_with_dfbuilds_exit_wrapper(tmp_path):
    host = platforms.target_host("windows")
    obj = windows.exit_wrapper(host, tmp_path)
    (tmp_path / "gc.cpp").write_text(_GC_DLL)
    (tmp_path / "main.cpp").write_text(_GC_MAIN)
    gxx = shutil.which("x86_64-w64-mingw32-g++-posix")
    for name, wrap in (("plain", []), ("wrapped", ["-Wl,--wrap=exit,--exclude-symbols,__wrap_exit", str(obj)])):
        out = tmp_path / name
        out.mkdir()
        flags = ["-static-libgcc", "-static-libstdc++", "-Wl,--exclude-libs,ALL", *wrap]
        subprocess.run([gxx, "-shared", "-o", out / "gc.dll", tmp_path / "gc.cpp", *flags,
                        f"-Wl,--out-implib,{out / 'libgc.dll.a'}"], check=True, capture_output=True)
        subprocess.run([gxx, "-o", out / "t.exe", tmp_path / "main.cpp", f"-L{out}", "-lgc", *flags],
                       check=True, capture_output=True)
        for dll in windows.runtime_dlls(host).values():
            shutil.copy(dll, out)
    # mingw-w64's own exit(): the thread dies inside winpthread's condition wait and the static
    # destructor's pthread_cond_destroy waits for it forever
    assert _exits_within(tmp_path / "plain" / "t.exe", 15) is None
    # dfbuild's: flushed, ended with the exit code
    assert _exits_within(tmp_path / "wrapped" / "t.exe", 60) == 3
    assert (tmp_path / "wrapped" / "t.log").read_text().strip().endswith("version: 1")


# --- the CLI, as a user runs it --------------------------------------------------------------------


def _cli(*args):
    from helpers import dfbuild

    return dfbuild(*args)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--os windows cross-builds on Linux")
def test_cli_doctor_and_build_for_windows_without_the_toolchain_exit_30_with_the_install_line(no_tools, tmp_path):
    from helpers import said

    result = _cli("doctor", "--backend", "cpu", "--os", "windows")
    assert result.exit_code == 30, result.output
    assert "apt-get install g++-mingw-w64-x86-64-posix gcc-mingw-w64-x86-64-posix wine wine64" in said(result)
    assert "Traceback" not in result.output
    report = json.loads(_cli("doctor", "--backend", "cpu", "--os", "windows", "--json").stdout)
    assert report["target"] == {"os": "windows", "arch": "x64"} and report["host"]["os"] == "linux"
    assert report["backends"]["cpu"]["missing"][:2] == ["mingw-gcc", "mingw-gxx"]

    tree = tmp_path / "src"
    from helpers import write_fake_llama

    write_fake_llama(tree)
    (tree / "tools" / "server").mkdir(parents=True)
    built = _cli("build", "--dir", tree, "--backend", "cpu", "--os", "windows")
    assert built.exit_code == 30, built.output
    assert "g++-mingw-w64-x86-64-posix" in said(built) and "Traceback" not in built.output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS is refused on Linux")
def test_cli_os_macos_on_linux_is_refused_clearly(tmp_path):
    from helpers import said

    for args in (("doctor", "--backend", "cpu"), ("release", "--base", "b11434", "--backend", "cpu",
                                                   "--work", tmp_path / "w", "--out", tmp_path / "o"),
                 ("prove", "--base", "b11434", "--work", tmp_path / "w")):
        result = _cli(*args, "--os", "macos")
        assert result.exit_code == 33, (args, result.output)
        assert "no cross toolchain" in said(result) and "Traceback" not in result.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()   # refused before anything was made
    assert _cli("doctor", "--os", "beos").exit_code == 2                      # click's usage error
