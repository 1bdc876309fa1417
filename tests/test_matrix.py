"""`dfbuild matrix`: the release matrix comes from the backend table, entry for entry."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfbuild.build import tree as build
from dfbuild.cli import main
from dfbuild.core.errors import DfbuildError
from dfbuild.host import backends, matrix
from dfbuild.host.backends import Host

REQUIRED = {
    ("linux", "cpu", "x64"), ("linux", "vulkan", "x64"), ("linux", "cuda", "x64"), ("linux", "hip", "x64"),
    ("windows", "cpu", "x64"), ("windows", "cuda", "x64"), ("windows", "vulkan", "x64"),
    ("macos", "metal", "arm64"),
    ("linux", "cpu", "arm64"),
}
# what build.py adds per build on top of the table's flags
PER_BUILD = ("LLAMA_BUILD_NUMBER", "LLAMA_BUILD_COMMIT", "CMAKE_C_COMPILER_LAUNCHER", "CMAKE_CXX_COMPILER_LAUNCHER",
             "CMAKE_CUDA_COMPILER_LAUNCHER", "CMAKE_HIP_COMPILER_LAUNCHER", "CMAKE_HIP_COMPILER", "CMAKE_CUDA_COMPILER")


def matrix_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["matrix", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_matrix_has_the_required_entries():
    entries = matrix_json()["include"]
    assert {(e["os"], e["backend"], e["arch"]) for e in entries} >= REQUIRED
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids))


def test_gpu_toolkits_come_in_their_vendor_containers():
    by_id = {e["id"]: e for e in matrix.release_matrix()}
    for cuda in ("linux-cuda-12.8-x64", "linux-cuda-13.0-x64"):
        assert by_id[cuda]["container"].startswith(f"nvidia/cuda:{by_id[cuda]['toolkit']}.")
        assert "-devel-" in by_id[cuda]["container"]  # nvcc and cuBLAS headers, not just runtime
    assert by_id["linux-hip-6.4-x64"]["container"].startswith("rocm/dev-")
    assert by_id["macos-metal-arm64"]["runner"].startswith("macos-")
    for cuda in ("windows-cuda-12.4-x64", "windows-cuda-13.0-x64"):
        assert by_id[cuda]["runner"].startswith("windows-")
        assert f"cuda_{by_id[cuda]['toolkit']}." in by_id[cuda]["setup"]  # the installer of that toolkit
    assert by_id["linux-cpu-arm64"]["runner"].endswith("-arm")


def test_every_entry_has_the_tables_flags():
    from dfbuild.host import platforms

    for entry in matrix_json()["include"]:
        nvcc = backends.version_tuple(entry["toolkit"]) if entry["backend"] == "cuda" else None
        expected = backends.cmake_flags(entry["backend"], entry["os"], nvcc_version=nvcc, arch=entry["arch"])
        if entry["build_os"]:  # a cross build: the target table's flags on top
            expected.update(platforms.table()["targets"][entry["os"]]["cross"][entry["build_os"]]["flags"])
        assert entry["flags"] == expected, entry["id"]


def test_the_published_win_cpu_zip_is_cross_built_and_the_msvc_build_is_a_check():
    by_id = {e["id"]: e for e in matrix.release_matrix()}
    cross, msvc = by_id["windows-cpu-x64"], by_id["windows-cpu-x64-msvc"]
    assert cross["build_os"] == "linux" and cross["os_args"] == "--os windows" and cross["publish"]
    assert cross["runner"].startswith("ubuntu-") and "mingw-w64" in cross["setup"] and "wine" in cross["setup"]
    assert msvc["runner"].startswith("windows-") and msvc["publish"] is False and msvc["os_args"] == ""
    # one zip per name in the release: only one published entry makes each artifact
    published = [e["artifact"] for e in by_id.values() if e["publish"]]
    assert len(published) == len(set(published))


def test_dfbuild_build_on_each_runner_uses_the_entrys_flags():
    """What `dfbuild build` would configure on that runner = the entry's flags + only the per-build stamp."""
    for entry in matrix.release_matrix():
        probes = {"toolchain": [{"name": "nvcc", "found": True, "ok": True, "optional": False,
                                 "path": "nvcc", "version": entry["toolkit"] or "12.8"}]}
        host = Host(entry["os"], entry["arch"], build_os=entry["build_os"] or None)
        flags = build.build_flags(entry["backend"], host, commit="c", number=1, entry=probes)
        static = {k: v for k, v in flags.items() if k not in PER_BUILD}
        assert static == entry["flags"], entry["id"]


def test_artifact_names_follow_llama_cpp_with_the_dflash_marker_in_the_tag():
    """llama.cpp's release.yml names, llama-<tag>-bin-<platform>: -bin-ubuntu-x64, -bin-ubuntu-vulkan-x64,
    -bin-win-cpu-x64, -bin-win-cuda-12.4-x64, -bin-macos-arm64; the dflash marker is in the tag
    (b10359-dflash-3f9a0c1d); the CUDA runtime beside them as llama.cpp names it."""
    name = matrix.artifact_name
    tag = "b10359-dflash-3f9a0c1d"
    assert name(tag, "linux", "cpu", "x64") == f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    assert name(tag, "linux", "cpu", "arm64") == f"llama-{tag}-bin-ubuntu-arm64.tar.gz"
    assert name(tag, "linux", "vulkan", "x64") == f"llama-{tag}-bin-ubuntu-vulkan-x64.tar.gz"
    assert name(tag, "linux", "cuda", "x64", "12.8.93") == f"llama-{tag}-bin-ubuntu-cuda-12.8-x64.tar.gz"
    assert name(tag, "linux", "hip", "x64", "6.4") == f"llama-{tag}-bin-ubuntu-rocm-6.4-x64.tar.gz"
    assert name(tag, "windows", "cpu", "x64") == f"llama-{tag}-bin-win-cpu-x64.zip"
    assert name(tag, "windows", "vulkan", "x64") == f"llama-{tag}-bin-win-vulkan-x64.zip"
    assert name(tag, "windows", "cuda", "x64", "12.4") == f"llama-{tag}-bin-win-cuda-12.4-x64.zip"
    assert name(tag, "macos", "metal", "arm64") == f"llama-{tag}-bin-macos-arm64.tar.gz"
    assert matrix.cudart_name("12.4") == "cudart-llama-bin-win-cuda-12.4-x64.zip"  # llama.cpp's: no tag
    assert matrix.cudart_name("12.8.1", os="linux", tag=tag) == f"cudart-llama-{tag}-bin-ubuntu-cuda-12.8-x64.tar.gz"
    with pytest.raises(DfbuildError, match="toolkit version"):
        name("b10359", "windows", "cuda", "x64")
    for entry in matrix_json("--tag", "b10359")["include"]:
        assert entry["artifact"] == name("b10359", entry["os"], entry["backend"], entry["arch"], entry["toolkit"] or None)
        assert entry["artifact"].endswith(".zip" if entry["os"] == "windows" else ".tar.gz")
        # the CUDA runtime beside every CUDA archive, Linux too (as llama.cpp's ubuntu-cuda job, issue 36)
        cuda = entry["backend"] == "cuda"
        cudart = [matrix.cudart_name(entry["toolkit"], entry["arch"], os=entry["os"], tag="b10359")] if cuda else []
        assert entry["extra_artifacts"] == cudart


@pytest.mark.parametrize("args", [("../x", "linux", "cpu", "x64"), ("b1", "win", "cpu", "x64"),
                                  ("b1", "linux", "cpu", "x86"), ("b1", "linux", "opencl", "x64")])
def test_artifact_name_rejects_bad_parts(args):
    with pytest.raises(DfbuildError):
        matrix.artifact_name(*args)


def test_setup_commands_are_valid_bash():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    for entry in matrix.release_matrix():
        if entry["setup"]:
            check = subprocess.run([bash, "-n", "-c", entry["setup"]], capture_output=True, text=True)
            assert check.returncode == 0, (entry["id"], check.stderr)


def test_vulkan_runner_installs_what_doctor_asks_for():
    by_id = {e["id"]: e for e in matrix.release_matrix()}
    setup = by_id["linux-vulkan-x64"]["setup"]
    # LunarG's vulkan-sdk package brings glslc, the headers, the SPIR-V headers and the loader
    assert "vulkan-sdk" in setup or all(p in setup for p in ("glslc", "libvulkan-dev", "spirv-headers"))
    assert "mesa-vulkan-drivers" in setup


def test_a_release_entry_for_a_host_the_backend_cannot_use_is_refused(monkeypatch):
    table = copy.deepcopy(backends.table())
    table["release"].append({"os": "linux", "arch": "x64", "backend": "metal", "runner": "ubuntu-24.04"})
    monkeypatch.setattr(backends, "table", lambda: table)
    with pytest.raises(DfbuildError) as exc:
        matrix.release_matrix()
    assert "only on macOS" in exc.value.message


def test_plain_listing_and_identifiers():
    ids = CliRunner().invoke(main, ["matrix", "--print-build-identifiers"])
    assert ids.exit_code == 0
    assert ids.stdout.split() == matrix.build_identifiers()
    assert {"linux-cuda-12.8-x64", "linux-cuda-13.0-x64", "windows-cuda-12.4-x64"} <= set(ids.stdout.split())

    table = CliRunner().invoke(main, ["matrix"])
    assert table.exit_code == 0
    for entry_id in matrix.build_identifiers():
        assert entry_id in table.output


# glibc of the Ubuntu releases a build image may be based on (the test's own table, not backends.toml's)
UBUNTU_GLIBC = {"20.04": (2, 31), "22.04": (2, 35), "24.04": (2, 39), "26.04": (2, 42)}


def test_every_linux_entry_builds_on_glibc_2_35_or_older():
    """Binaries need the glibc they were linked on: a 24.04 image (2.39) makes archives that do not start on
    Debian 12 (2.36) or Ubuntu 22.04 (2.35). The image is read from the generated matrix, whatever it declares."""
    linux = [e for e in matrix_json()["include"] if e["os"] == "linux"]
    assert linux
    too_new, floors = [], {}
    for entry in linux:
        image = entry.get("container") or entry.get("image") or entry["runner"]  # a container links the binaries
        release = re.search(r"ubuntu-?(\d{2}\.\d{2})", image)
        assert release and release.group(1) in UBUNTU_GLIBC, f"{entry['id']}: glibc of image {image} unknown"
        glibc = ".".join(map(str, UBUNTU_GLIBC[release.group(1)]))
        floors[entry["id"]] = glibc
        if UBUNTU_GLIBC[release.group(1)] > (2, 35):
            too_new.append(f"{entry['id']} builds on {image} (glibc {glibc})")
    assert too_new == []
    assert {e["id"]: e.get("glibc") for e in linux} == floors  # what the matrix says is the image's


def test_readme_states_the_glibc_floor_of_each_linux_entry():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text(encoding="utf-8")
    for entry in matrix.release_matrix():
        if entry["os"] == "linux":
            row = next((line for line in readme.splitlines() if line.startswith(f"| {entry['id']} |")), None)
            assert row is not None, f"docs/backends.md has no glibc row for {entry['id']}"
            assert row.rstrip(" |").endswith(entry["glibc"]) and entry["image"] in row, row


def test_an_entry_on_a_newer_glibc_is_refused(monkeypatch):
    table = copy.deepcopy(backends.table())
    row = next(r for r in table["release"] if r["os"] == "linux" and r.get("container"))
    row["container"] = row["container"].replace("22.04", "24.04")
    monkeypatch.setattr(backends, "table", lambda: table)
    with pytest.raises(DfbuildError, match="has 2.39"):
        matrix.release_matrix()
    row["glibc"] = "2.39"
    with pytest.raises(DfbuildError, match="would not start on Ubuntu 22.04 or Debian 12"):
        matrix.release_matrix()


# --- what was verified where (issue 31) -------------------------------------------------------------------

# the marks as the issue states them; an entry that changes its mark changes this line with it
VERIFIED = {
    "linux-cpu-x64": "built and run here",        # dfbuild's own integration tests
    "linux-vulkan-x64": "built and run here",     # lavapipe
    "linux-cuda-13.0-x64": "built and run here",  # the lent H200 (nvcc 13)
    "linux-cpu-arm64": "built and run here",      # cross-built with aarch64 GCC, run under qemu-aarch64
    "windows-cpu-x64": "built and run here",      # mingw-w64, Wine
    "windows-cpu-x64-msvc": "runner only", "windows-cuda-12.4-x64": "runner only",
    "windows-cuda-13.0-x64": "runner only", "macos-metal-arm64": "runner only",
    "windows-vulkan-x64": "built and run here",  # mingw-w64 cross build, proven under Wine on lavapipe
    "linux-hip-6.4-x64": "built and run here",   # in the forky ROCm root, smoke on its CPU backend (no AMD GPU)
}


def test_every_entry_says_what_was_verified_where_in_the_table_and_in_json():
    entries = {e["id"]: e for e in matrix_json()["include"]}
    for ident, entry in entries.items():
        assert entry["verified"] in matrix.VERIFIED_MARKS, ident
        assert entry["verified_note"], ident  # how, or why not
    for ident, mark in VERIFIED.items():
        assert entries[ident]["verified"] == mark, ident
    # arm64 is "built and run here" only through its own entry's data (the qemu cross build sets it)
    arm64 = next(r for r in backends.release_entries() if (r["os"], r["arch"]) == ("linux", "arm64"))
    assert entries["linux-cpu-arm64"]["verified"] == arm64["verified"]
    for ident in ("windows-cuda-12.4-x64", "windows-cpu-x64-msvc", "macos-metal-arm64"):
        assert "runner" in entries[ident]["verified_note"]
    shown = CliRunner().invoke(main, ["matrix"])
    assert shown.exit_code == 0
    for ident, entry in entries.items():
        assert f"{ident}: {entry['verified']}: {entry['verified_note']}" in shown.output
    assert "verified" in shown.output  # the table's column


@pytest.mark.parametrize("change, words", [({"verified": None}, "not one of"),
                                           ({"verified": "tested somewhere"}, "not one of"),
                                           ({"verified_note": ""}, "without verified_note"),
                                           ({"smoke_on_cpu": "no GPU", "backend": "cpu"}, "always runs on the CPU")])
def test_a_release_entry_without_a_known_mark_and_its_reason_is_refused(monkeypatch, change, words):
    table = copy.deepcopy(backends.table())
    table["release"][0].update(change)
    monkeypatch.setattr(backends, "table", lambda: table)
    with pytest.raises(DfbuildError) as exc:
        matrix.release_matrix()
    assert words in exc.value.message


def test_gpu_entries_on_hosted_runners_smoke_on_the_cpu_and_say_so():
    """GitHub's hosted runners have no GPU: their CUDA and HIP entries pass --allow-cpu-fallback, so the
    manifest and the release notes say where the smoke ran (not a silent CPU pass)."""
    entries = {e["id"]: e for e in matrix.release_matrix()}
    for ident, entry in entries.items():
        if entry["backend"] in ("cuda", "hip") or ident == "windows-vulkan-x64":
            assert entry["smoke_args"] == "--allow-cpu-fallback" and entry["smoke_on_cpu"], ident
        else:  # lavapipe on the Linux Vulkan runner is a device; CPU and Metal entries list none
            assert entry["smoke_args"] == "" and entry["smoke_on_cpu"] == "", ident
