"""Vulkan for Windows from Linux (`--backend vulkan --os windows`): the import library, the include
dir, the zip's PE checks and the display Wine needs (fast).

The real cross build, its verify and its smoke under Wine on lavapipe are in
test_windows_vulkan_real.py (opt-in); these run in seconds, with the mingw-w64
tools where a test makes a real PE file (skipped, saying why, without them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild import smoke
from dfbuild.build import tree as build
from dfbuild.core.errors import BuildError, ToolchainMissingError
from dfbuild.host import doctor, pe, platforms
from dfbuild.host.backends import Host
from dfbuild.host.platforms import windows
from dfbuild.verify import release_dir as verify

WINDOWS_ON_LINUX = Host("windows", "x64", "debian", "12", build_os="linux")
MINGW = shutil.which("x86_64-w64-mingw32-gcc-posix")
DLLTOOL = shutil.which("x86_64-w64-mingw32-dlltool")
needs_mingw = pytest.mark.skipif(MINGW is None or DLLTOOL is None or not sys.platform.startswith("linux"),
                                 reason="the mingw-w64 cross compiler and dlltool are not installed "
                                        "(apt-get install gcc-mingw-w64-x86-64-posix)")
needs_wine = pytest.mark.skipif(shutil.which("wine") is None, reason="wine is not installed (apt-get install wine wine64)")
HAS_XVFB = shutil.which("Xvfb") is not None
needs_display = pytest.mark.skipif(not HAS_XVFB and not os.environ.get("DISPLAY"),
                                   reason="no display for Wine's Vulkan: Xvfb is not installed (apt-get install xvfb) "
                                          "and $DISPLAY is unset")

# vulkan_core.h's shape: a guard line per core version and per extension, prototypes after it
CORE_H = """\
// VK_VERSION_1_0 is a preprocessor guard. Do not pass it to API calls.
#define VK_VERSION_1_0 1
typedef VkResult (VKAPI_PTR *PFN_vkCreateInstance)(const VkInstanceCreateInfo* pCreateInfo);
#ifndef VK_NO_PROTOTYPES
VKAPI_ATTR VkResult VKAPI_CALL vkCreateInstance(
    const VkInstanceCreateInfo*                 pCreateInfo,
    VkInstance*                                 pInstance);

VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetInstanceProcAddr(
    VkInstance                                  instance,
    const char*                                 pName);
#endif
// VK_VERSION_1_1 is a preprocessor guard. Do not pass it to API calls.
#define VK_VERSION_1_1 1
VKAPI_ATTR VkResult VKAPI_CALL vkEnumerateInstanceVersion(
    uint32_t*                                   pApiVersion);
#define VK_VERSION_1_2 1
VKAPI_ATTR void VKAPI_CALL vkResetQueryPool(VkDevice device);
#define VK_VERSION_1_3 1
VKAPI_ATTR void VKAPI_CALL vkCmdPipelineBarrier2(VkCommandBuffer commandBuffer);
#define VK_VERSION_1_4 1
VKAPI_ATTR void VKAPI_CALL vkCmdSetLineStipple(VkCommandBuffer commandBuffer);
// VK_KHR_surface is a preprocessor guard. Do not pass it to API calls.
#define VK_KHR_surface 1
VKAPI_ATTR void VKAPI_CALL vkDestroySurfaceKHR(
    VkInstance                                  instance);
"""
CORE_VERSIONS = ["VK_VERSION_1_0", "VK_VERSION_1_1", "VK_VERSION_1_2", "VK_VERSION_1_3"]


# --- the import library ---------------------------------------------------------------------------


def test_the_exports_are_the_core_versions_entry_points_and_nothing_else():
    assert windows.vulkan_exports(CORE_H, CORE_VERSIONS) == [
        "vkCreateInstance", "vkGetInstanceProcAddr", "vkEnumerateInstanceVersion", "vkResetQueryPool",
        "vkCmdPipelineBarrier2"]
    # extensions are not exported by the loader (they come through vkGetInstanceProcAddr), nor newer cores
    assert "vkDestroySurfaceKHR" not in windows.vulkan_exports(CORE_H, CORE_VERSIONS)
    assert windows.vulkan_exports(CORE_H, ["VK_VERSION_1_4"]) == ["vkCmdSetLineStipple"]
    assert windows.def_text("vulkan-1.dll", ["vkA", "vkB"]) == "LIBRARY vulkan-1.dll\nEXPORTS\nvkA\nvkB\n"


def test_headers_without_a_core_version_are_refused():
    with pytest.raises(BuildError) as caught:
        windows.vulkan_exports(CORE_H.replace("#define VK_VERSION_1_3 1\n", ""), CORE_VERSIONS)
    assert "VK_VERSION_1_3" in caught.value.message and ">= 1.3.272" in (caught.value.hint or "")


REAL_CORE = next((p for p in (Path("/usr/include/vulkan/vulkan_core.h"),) if p.is_file()), None)


@pytest.mark.skipif(REAL_CORE is None, reason="no Vulkan headers here (apt-get install libvulkan-dev)")
def test_the_exports_from_real_headers_are_what_every_loader_exports():
    names = windows.vulkan_exports(REAL_CORE.read_text(encoding="utf-8", errors="replace"),
                                   windows.entry(WINDOWS_ON_LINUX)["vulkan"]["export_versions"])
    assert len(names) == len(set(names)) == 215   # 1.0: 137, 1.1: 28, 1.2: 13, 1.3: 37 entry points
    for core in ("vkGetInstanceProcAddr", "vkCreateInstance", "vkEnumerateInstanceVersion", "vkGetBufferDeviceAddress",
                 "vkCmdPipelineBarrier2", "vkQueueSubmit2"):
        assert core in names
    for extension in ("vkCreateWin32SurfaceKHR", "vkDestroySurfaceKHR", "vkCmdDrawMeshTasksEXT",
                      "vkCreateDebugUtilsMessengerEXT"):
        assert extension not in names


WINE_VULKAN = Path("/usr/lib/x86_64-linux-gnu/wine/x86_64-windows/vulkan-1.dll")


@pytest.mark.skipif(REAL_CORE is None or not WINE_VULKAN.is_file(),
                    reason="needs Vulkan headers and Wine's vulkan-1.dll (apt-get install libvulkan-dev wine64)")
def test_every_export_of_the_import_library_is_one_that_a_real_loader_exports():
    import pefile

    loader = pefile.PE(str(WINE_VULKAN), fast_load=True)
    loader.parse_data_directories(directories=[pefile.DIRECTORY_ENTRY["IMAGE_DIRECTORY_ENTRY_EXPORT"]])
    exported = {s.name.decode() for s in loader.DIRECTORY_ENTRY_EXPORT.symbols if s.name}
    names = windows.vulkan_exports(REAL_CORE.read_text(encoding="utf-8", errors="replace"),
                                   windows.entry(WINDOWS_ON_LINUX)["vulkan"]["export_versions"])
    assert [n for n in names if n not in exported] == []


def fake_headers(root: Path) -> dict:
    """Vulkan headers, SPIR-V headers with their CMake package, and a glslc, as doctor's probes find them."""
    vulkan_inc = root / "vk" / "include"
    (vulkan_inc / "vulkan").mkdir(parents=True)
    (vulkan_inc / "vk_video").mkdir()
    (vulkan_inc / "vulkan" / "vulkan_core.h").write_text(
        "#define VK_HEADER_VERSION 309\n"
        "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n" + CORE_H)
    (vulkan_inc / "vulkan" / "vulkan.hpp").write_text("// c++\n")
    (vulkan_inc / "stdio.h").write_text("#error a host header must never be seen by the cross compiler\n")
    spirv_inc = root / "spirv" / "include"
    (spirv_inc / "spirv" / "unified1").mkdir(parents=True)
    (spirv_inc / "spirv" / "unified1" / "spirv.hpp").write_text("// spirv\n")
    config = root / "spirv" / "share" / "cmake" / "SPIRV-Headers"
    config.mkdir(parents=True)
    (config / "SPIRV-HeadersConfig.cmake").write_text("# config\n")
    glslc = root / "bin" / "glslc"
    glslc.parent.mkdir()
    glslc.write_text("#!/bin/sh\n")
    found = {"vulkan-headers": vulkan_inc, "spirv-headers": spirv_inc, "glslc": glslc}
    return {"toolchain": [{"name": n, "found": True, "path": str(p)} for n, p in found.items()]}


@needs_mingw
def test_the_build_gets_an_include_dir_of_its_own_and_an_import_library_of_core_vulkan(tmp_path):
    entry = fake_headers(tmp_path)
    build_dir = tmp_path / "build-vulkan-windows"
    setup = windows.backend_setup(WINDOWS_ON_LINUX, "vulkan", build_dir, entry)
    flags = setup["flags"]
    include = Path(flags["Vulkan_INCLUDE_DIR"])
    # only the Vulkan and SPIR-V headers: no other header of the host's include dir reaches mingw
    assert include.parent == build_dir / windows.VULKAN_DIR
    assert sorted(p.name for p in include.iterdir()) == ["spirv", "vk_video", "vulkan"]
    assert (include / "spirv" / "unified1" / "spirv.hpp").is_file()
    assert flags["SPIRV-Headers_DIR"] == str((tmp_path / "spirv" / "share" / "cmake" / "SPIRV-Headers").resolve())
    assert flags["Vulkan_GLSLC_EXECUTABLE"] == str(tmp_path / "bin" / "glslc")
    assert setup["import"] == {"dll": "vulkan-1.dll", "exports": 5, "versions": CORE_VERSIONS, "headers": "1.4.309"}
    library = Path(flags["Vulkan_LIBRARY"])
    assert library.name == "libvulkan-1.dll.a" and library.is_file()

    # a DLL that calls a core entry point links against it and imports vulkan-1.dll
    (tmp_path / "uses.c").write_text("void *vkGetInstanceProcAddr(void *, const char *);\n"
                                     "__declspec(dllexport) void *probe(void) { return vkGetInstanceProcAddr(0, \"x\"); }\n")
    subprocess.run([MINGW, "-shared", "-o", "ggml-vulkan.dll", "uses.c", str(library)], cwd=tmp_path, check=True,
                   capture_output=True)
    assert "vulkan-1.dll" in pe.read((tmp_path / "ggml-vulkan.dll").read_bytes()).imports
    # an extension's entry point is not in it: the link fails here, not the load on a user's machine
    (tmp_path / "ext.c").write_text("void vkDestroySurfaceKHR(void *);\n"
                                    "__declspec(dllexport) void probe(void) { vkDestroySurfaceKHR(0); }\n")
    failed = subprocess.run([MINGW, "-shared", "-o", "ext.dll", "ext.c", str(library)], cwd=tmp_path,
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "vkDestroySurfaceKHR" in failed.stderr

    # the same headers again: nothing is rewritten (ninja relinks nothing)
    before = library.stat().st_mtime_ns
    assert windows.backend_setup(WINDOWS_ON_LINUX, "vulkan", build_dir, entry) == setup
    assert library.stat().st_mtime_ns == before


def test_spirv_headers_without_their_cmake_package_say_what_to_install(tmp_path):
    entry = fake_headers(tmp_path)
    shutil.rmtree(tmp_path / "spirv" / "share")
    with pytest.raises(ToolchainMissingError) as caught:
        windows.backend_setup(WINDOWS_ON_LINUX, "vulkan", tmp_path / "b", entry)
    assert caught.value.exit_code == 30 and "spirv-headers" in (caught.value.hint or "")


def test_a_cpu_cross_build_adds_nothing(tmp_path):
    assert windows.backend_setup(WINDOWS_ON_LINUX, "cpu", tmp_path, {}) == {}
    flags = build.build_flags("vulkan", WINDOWS_ON_LINUX, commit="c" * 40, number=1, entry={"toolchain": []},
                              use_ccache=False)
    assert flags["GGML_VULKAN"] == "ON" and flags["BUILD_SHARED_LIBS"] == "ON" and flags["GGML_BACKEND_DL"] == "ON"


# --- doctor ---------------------------------------------------------------------------------------


def test_doctor_names_what_the_windows_vulkan_build_and_run_need(monkeypatch, tmp_path):
    from helpers import isolate_probes

    isolate_probes(monkeypatch, tmp_path)
    entry = doctor.check_backend("vulkan", WINDOWS_ON_LINUX)
    assert not entry["can_build"]
    assert {"glslc", "vulkan-headers", "spirv-headers"} <= set(entry["missing"])
    assert "vulkan-loader" not in [p["name"] for p in entry["toolchain"]]   # dfbuild makes the import library
    assert entry["missing_to_run"] == ["wine", "xvfb"]
    assert any("xvfb" in line for p in entry["runtime"] if p["name"] == "xvfb" for line in [p["install"] or ""])
    # the driver it runs on is this machine's (lavapipe under Wine), probed as Linux's
    driver = next(p for p in entry["runtime"] if p["name"] == "vulkan-driver")
    if driver["found"]:
        assert driver["path"].startswith("/usr/share/vulkan/icd.d/"), driver
    else:
        assert "mesa-vulkan-drivers" in (driver["install"] or ""), driver


# --- the zip and verify ---------------------------------------------------------------------------


def _vulkan_build(inputs: dict, *, with_vulkan: bool = True, ship_loader: bool = False) -> None:
    from test_windows_cross import _mingw

    sections = inputs["sections"]
    build_dir = Path(sections["build"]["build_dir"])
    entry = fake_headers(inputs["tmp"] / "headers")
    library = Path(windows.backend_setup(WINDOWS_ON_LINUX, "vulkan", build_dir, entry)["flags"]["Vulkan_LIBRARY"])
    sections["build"]["backend"] = "vulkan"
    sections["smoke"] = {"passed": True, "failed": [], "results": {}, "ran_on": "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits)"}
    if with_vulkan:
        (build_dir / "vk.c").write_text("void *vkGetInstanceProcAddr(void *, const char *);\n"
                                        "__declspec(dllexport) void *ggml_backend_init(void) "
                                        "{ return vkGetInstanceProcAddr(0, \"x\"); }\n")
        _mingw(build_dir, "-shared", "-o", "bin/ggml-vulkan.dll", "vk.c", str(library))
        sections["build"]["libraries"].append("bin/ggml-vulkan.dll")
    if ship_loader:
        shutil.copyfile(build_dir / "bin" / "llama.dll", build_dir / "bin" / "vulkan-1.dll")
        sections["build"]["libraries"].append("bin/vulkan-1.dll")


from test_windows_cross import windows_inputs  # noqa: E402,F401 - the fixture: a tiny real Windows build, packaged


@needs_mingw
def test_the_win_vulkan_zip_imports_the_drivers_loader_and_ships_none(windows_inputs, tmp_path):
    from test_windows_cross import package_windows

    _vulkan_build(windows_inputs)
    out = tmp_path / "out"
    rel = package_windows(windows_inputs, out)
    assert rel["archive"].endswith("-bin-win-vulkan-x64.zip") and "-dflash-" in rel["tag"]
    report = verify.verify(out, run_binaries=False)
    assert report["ok"], report["problems"]
    assert any("ggml-vulkan.dll imports vulkan-1.dll, the GPU driver's own, which the archive does not ship" in n
               for n in report["checked"]), report["checked"]
    assert any("smoke passed on Vulkan0: llvmpipe" in n for n in report["checked"]), report["checked"]


@needs_mingw
@needs_wine
@needs_display
def test_verify_that_runs_the_vulkan_zip_says_each_check_once(windows_inputs, tmp_path):
    """The run adds its own lines (--version under Wine) to the member checks, and repeats none of them."""
    from test_windows_cross import package_windows

    _vulkan_build(windows_inputs)
    out = tmp_path / "out"
    package_windows(windows_inputs, out)
    try:
        report = verify.verify(out, run_binaries=True)
    finally:
        windows._stop_display()  # the Xvfb the run started: later tests expect none
    assert report["ok"], report["problems"]
    assert any("--version names the patched commit" in n for n in report["checked"]), report["checked"]
    assert len(report["checked"]) == len(set(report["checked"])), report["checked"]


@needs_mingw
@pytest.mark.parametrize("build, problem", [
    ({"ship_loader": True}, ": vulkan-1.dll is the GPU driver's own DLL, which an archive must not ship"),
    ({"with_vulkan": False}, "no file imports vulkan-1.dll: this vulkan build would never reach the GPU driver"),
], ids=["ships-the-loader", "nothing-imports-vulkan"])
def test_verify_fails_a_vulkan_zip_that_breaks_the_driver_rule(windows_inputs, tmp_path, build, problem):
    from test_windows_cross import package_windows

    _vulkan_build(windows_inputs, **build)
    out = tmp_path / "out"
    package_windows(windows_inputs, out)
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any(problem in p for p in problems), problems


# --- a display for Wine ---------------------------------------------------------------------------


def test_only_a_vulkan_build_gets_a_display_and_the_users_own_settings_win(monkeypatch, tmp_path):
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DISPLAY", ":77")
    monkeypatch.delenv("WINEPREFIX", raising=False)
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin" / "llama-server.exe"
    exe.write_bytes(b"MZ")
    assert not windows.needs_display(WINDOWS_ON_LINUX, exe)
    assert windows.display_env(WINDOWS_ON_LINUX, exe) == {}
    (tmp_path / "bin" / "ggml-vulkan.dll").write_bytes(b"MZ")
    assert windows.needs_display(WINDOWS_ON_LINUX, exe)
    # the user's display; a Wine prefix of its own (a headless wineserver's desktop has no graphics driver)
    assert windows.display_env(WINDOWS_ON_LINUX, exe) == {
        "DISPLAY": ":77", "WINEPREFIX": str(tmp_path / "cache" / "wine-prefix-display")}
    monkeypatch.setenv("WINEPREFIX", str(tmp_path / "mine"))
    assert windows.display_env(WINDOWS_ON_LINUX, exe) == {"DISPLAY": ":77"}


@pytest.mark.skipif(shutil.which("wine") is None, reason="wine is not installed (apt-get install wine wine64)")
def test_the_smoke_runs_a_vulkan_exe_with_the_display(monkeypatch, tmp_path):
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DISPLAY", ":77")
    monkeypatch.delenv("WINEPREFIX", raising=False)
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin" / "llama-server.exe"
    exe.write_bytes(b"MZ")
    prefix, env = smoke.launcher_for(exe)
    assert Path(prefix[0]).name == "wine" and "DISPLAY" not in env
    assert env["WINEPREFIX"] == str(tmp_path / "cache" / "wine-prefix")
    (tmp_path / "bin" / "ggml-vulkan.dll").write_bytes(b"MZ")
    prefix, env = smoke.launcher_for(exe)
    assert env["DISPLAY"] == ":77" and env["WINEPREFIX"] == str(tmp_path / "cache" / "wine-prefix-display")


def test_no_xvfb_and_no_display_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("DISPLAY", raising=False)
    (tmp_path / "ggml-vulkan.dll").write_bytes(b"MZ")
    with pytest.raises(ToolchainMissingError) as caught:
        windows.display_env(WINDOWS_ON_LINUX, tmp_path / "llama-server.exe")
    assert caught.value.exit_code == 30 and "apt-get install xvfb" in (caught.value.hint or "")


@pytest.mark.skipif(not HAS_XVFB, reason="Xvfb is not installed (apt-get install xvfb)")
def test_dfbuild_starts_one_xvfb_and_stops_it(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    name = windows.start_display(WINDOWS_ON_LINUX)
    try:
        process = windows._display["process"]
        assert name.startswith(":") and name[1:].isdigit() and process.poll() is None
        assert Path(f"/tmp/.X11-unix/X{name[1:]}").exists()   # it accepts connections
        assert windows.start_display(WINDOWS_ON_LINUX) == name   # one per dfbuild process
    finally:
        windows._stop_display()
    assert process.poll() is not None and "process" not in windows._display


@pytest.mark.skipif(not HAS_XVFB or not Path("/proc/self/stat").exists(),
                    reason="Xvfb is not installed (apt-get install xvfb), or no /proc")
def test_the_xvfb_ends_with_dfbuild_even_when_dfbuild_is_killed():
    import time

    code = ("import os\nfrom dfbuild.host import platforms\nfrom dfbuild.host.platforms import windows\n"
            "windows.start_display(platforms.target_host('windows'))\n"
            "print(windows._display['process'].pid, flush=True)\nos.kill(os.getpid(), 9)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(ran.stdout.strip())
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
    if alive:
        os.kill(pid, 15)
    assert not alive, "the Xvfb outlived the dfbuild that started it"


def test_no_device_under_wine_names_the_display_and_the_prefix(tmp_path):
    from dfbuild.host import backends

    exe = tmp_path / "bin" / "llama-server.exe"
    error = smoke.no_device_error(backends.get("vulkan"), "`llama-server --list-devices` lists none", {}, exe)
    assert error.exit_code == 45
    assert error.hint.startswith("under Wine the .exe reaches this machine's Vulkan driver through winevulkan and a "
                                 "display") and "mesa-vulkan-drivers" in error.hint
    # a Linux build's hint is the backend table's alone
    linux = smoke.no_device_error(backends.get("vulkan"), "none", {}, tmp_path / "bin" / "llama-server")
    assert "Wine" not in linux.hint and "mesa-vulkan-drivers" in linux.hint


def test_the_targets_table_says_vulkan_is_cross_built_for_windows():
    target = platforms.cross_entry(WINDOWS_ON_LINUX)
    assert "vulkan" in target["backends"] and "vulkan" not in target.get("not_backends", {})
    assert pe.backend_driver_dll("vulkan") == "vulkan-1.dll" and pe.backend_driver_dll("cpu") is None
    assert "vulkan-1.dll" in pe.system_dlls()[2]
    assert os.path.basename(target["vulkan"]["display_server"][0]) == "Xvfb"
