"""Vulkan for Windows from Linux, for real: a llama.cpp release cross-built with `--backend vulkan --os
windows`, proved and smoke-tested under Wine on lavapipe, verified.

Opt-in (DFBUILD_TEST_WINDOWS_VULKAN=1), beside the integration and slow markers: a
cold Vulkan cross build is another cold build of the whole tree plus ggml-vulkan's
shaders, and the smoke on lavapipe under Wine takes minutes per server start with a
cold Mesa shader cache, which would take `.ci/run` past its budget on two cores. The
release or benchmark run sets the variable (docs/windows.md).
DFBUILD_TEST_WINDOWS_VULKAN_BASE picks the release (default: the tests' REAL_BASE).

The way a user runs it (subprocesses of the CLI), with the x64 CPU variant and the
tests' -O1 flags:

- `dfbuild release --base B --backend vulkan --os windows`: the series carried to B
  is proved on lavapipe under Wine (unpatched fails, patched passes, on the device
  `Vulkan0: llvmpipe ...`), and the zip llama.cpp names `...-bin-win-vulkan-x64.zip`
  holds ggml-vulkan.dll, which imports vulkan-1.dll, and no vulkan-1.dll;
- `dfbuild verify` passes, checking the PE imports, and runs the unpacked
  llama-server.exe --version under Wine, which names the patched commit;
- with the Vulkan loader pointed at a missing driver (VK_DRIVER_FILES), `dfbuild smoke`
  of the same build exits 45 and runs nothing on the CPU.

Skipped, saying why, without the cross toolchain, Wine, Xvfb or a Vulkan driver.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE, vulkan_include_dir

from dfbuild import smoke
from dfbuild.host import pe

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DFBUILD_TEST_WINDOWS_VULKAN") != "1",
                       reason="the Windows Vulkan cross build is opt-in: DFBUILD_TEST_WINDOWS_VULKAN=1 "
                              "(a cold build and a lavapipe smoke under Wine; docs/windows.md)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cross build for Windows is checked on Linux"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in ("x86_64-w64-mingw32-g++-posix", "wine", "Xvfb", "glslc")),
                       reason="needs the mingw-w64 cross compilers, Wine, Xvfb and glslc: apt-get install "
                              "g++-mingw-w64-x86-64-posix gcc-mingw-w64-x86-64-posix wine wine64 xvfb glslc "
                              "spirv-headers mesa-vulkan-drivers"),
]

BASE = os.environ.get("DFBUILD_TEST_WINDOWS_VULKAN_BASE", REAL_BASE)
WORK = CACHE / "work" / BASE
VARIANTS = "x64"   # the baseline: any x86-64 CPU (and Wine's)


def dfbuild(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def include_args() -> list[str]:
    include = vulkan_include_dir()   # Debian 12: Debian 13's headers, fetched into the cache
    return ["--vulkan-include-dir", str(include)] if include else []


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("windows-vulkan-release") / "out"
    started = time.monotonic()
    result = dfbuild("release", "--base", BASE, "--backend", "vulkan", "--os", "windows", "--cpu-variants", VARIANTS,
                     *include_args(), "--out", out, "--work", WORK, "-j", "2",
                     "--target", "llama-server", "--json")  # llama-server only, for CI's time (docs/ci.md)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"out": out, "manifest": json.loads(result.stdout), "stderr": result.stderr,
            "wall_s": time.monotonic() - started}


def test_the_zip_llama_cpp_names_imports_the_drivers_loader_and_ships_none(released, tmp_path):
    full = released["manifest"]
    rel = full["release"]
    name = rel["archive"]
    assert name.startswith(f"llama-{BASE}-dflash-") and name.endswith("-bin-win-vulkan-x64.zip")
    assert [a["kind"] for a in rel["artifacts"]] == ["archive"]   # a cross build ships no wheel
    with zipfile.ZipFile(released["out"] / name) as zf:
        zf.extractall(tmp_path)
    bin_dir = tmp_path  # a flat zip, as llama.cpp's
    names = {p.name.lower() for p in bin_dir.iterdir()}
    assert {"llama-server.exe", "ggml-vulkan.dll", f"ggml-cpu-{VARIANTS}.dll", "ggml-base.dll"} <= names
    assert "vulkan-1.dll" not in names
    assert "vulkan-1.dll" in [d.lower() for d in pe.read((bin_dir / "ggml-vulkan.dll").read_bytes()).imports]
    imported = full["build"]["cross"]["import_library"]
    assert imported["dll"] == "vulkan-1.dll" and imported["exports"] > 180
    # the smoke ran on lavapipe's device under Wine, not on the CPU backend
    assert full["smoke"]["ran_on"].startswith("Vulkan0: llvmpipe") and not full["smoke"].get("cpu_fallback")
    # under Wine, the unpacked server names the patched commit
    server = bin_dir / "llama-server.exe"
    prefix, env = smoke.launcher_for(server)
    assert env.get("DISPLAY")   # a Vulkan .exe runs with a display
    ran = subprocess.run([*prefix, str(server), "--version"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert full["series"]["head"][:8] in ran.stdout + ran.stderr, ran.stdout + ran.stderr


def test_verify_checks_the_pe_imports_and_runs_the_server_under_wine(released):
    result = dfbuild("verify", released["out"], "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checked = " ".join(json.loads(result.stdout)["checked"])
    assert "ggml-vulkan.dll imports vulkan-1.dll, the GPU driver's own, which the archive does not ship" in checked
    assert "--version names the patched commit" in checked


def test_no_vulkan_device_under_wine_stops_the_smoke_with_exit_45(released, tmp_path):
    result = dfbuild("smoke", "--backend", "vulkan", "--build-dir", WORK / "build-vulkan-windows",
                     "--fixtures", tmp_path / "fixtures", env={"VK_DRIVER_FILES": str(tmp_path / "missing_icd.json")})
    assert result.returncode == 45, result.stderr[-3000:]
    assert "no vulkan device" in result.stderr and "missing_icd.json" in result.stderr
