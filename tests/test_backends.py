"""The backend table: its shape, and the CMake flags it gives each (backend, host)."""

from __future__ import annotations

import pytest

from dfbuild.core.errors import DfbuildError, UnsupportedBackendError
from dfbuild.host import backends

OFFLINE_FLAGS = {
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "OFF",
}


def test_table_lists_the_five_backends():
    assert backends.names() == ["cpu", "cuda", "vulkan", "hip", "metal"]


def test_every_backend_names_only_known_probes_with_install_hints():
    table = backends.table()
    probes = table["probes"]
    for name in backends.names():
        spec = backends.get(name)
        assert spec.artifact_suffix and spec.summary and spec.hosts
        wanted = (*table["common"]["probes"], *table["common"]["optional_probes"], *spec.probes,
                  *spec.runtime_probes)
        for probe in wanted:
            assert probe in probes, f"{name} names unknown probe {probe}"
            install = probes[probe]["install"]
            for host_os in spec.hosts:
                # a generic hint for every host os the backend builds on; distros may refine it
                assert host_os in install, (probe, host_os)
        for host_os in backends.OSES:
            if host_os not in spec.hosts:
                assert spec.why_not_on(host_os)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "vulkan", "hip"])
@pytest.mark.parametrize("host_os", ["linux", "windows"])
def test_every_build_is_offline_portable_and_has_tls(backend, host_os):
    flags = backends.cmake_flags(backend, host_os)
    for key, value in OFFLINE_FLAGS.items():
        assert flags[key] == value
    # TLS for -hf, as llama.cpp's releases: the system OpenSSL on Linux, BoringSSL elsewhere
    if host_os == "linux":
        assert flags["LLAMA_OPENSSL"] == "ON" and "LLAMA_BUILD_BORINGSSL" not in flags
    else:
        assert flags["LLAMA_BUILD_BORINGSSL"] == "ON"
    # x64: the runtime-dispatched CPU variants (the GPU backends ship the CPU backend too)
    assert flags["GGML_BACKEND_DL"] == flags["GGML_CPU_ALL_VARIANTS"] == "ON"
    # arm64: on Linux too, as llama.cpp's ubuntu-arm64 release (its armv8.x/armv9.x variants); none on Windows
    arm64 = backends.cmake_flags(backend, host_os, arch="arm64")
    if host_os == "linux":
        assert arm64["GGML_BACKEND_DL"] == arm64["GGML_CPU_ALL_VARIANTS"] == "ON"
        assert backends.cpu_variants(host_os, "arm64")[0] == "armv8.0_1"
    else:
        assert "GGML_CPU_ALL_VARIANTS" not in arm64 and backends.cpu_variants(host_os, "arm64") == []
    assert "GGML_CPU_ALL_VARIANTS" not in backends.cmake_flags("cpu", "macos", arch="arm64")  # one Apple build


def test_rpath_is_exactly_origin_in_the_built_files():
    """CMAKE_BUILD_WITH_INSTALL_RPATH: no build-dir path and no empty entry (= the current dir) in RUNPATH."""
    linux = backends.cmake_flags("cpu", "linux")
    assert linux["CMAKE_INSTALL_RPATH"] == "$ORIGIN" and linux["CMAKE_BUILD_WITH_INSTALL_RPATH"] == "ON"
    assert "CMAKE_BUILD_RPATH_USE_ORIGIN" not in linux
    metal = backends.cmake_flags("metal", "macos")
    assert metal["CMAKE_INSTALL_RPATH"] == "@loader_path" and metal["CMAKE_BUILD_WITH_INSTALL_RPATH"] == "ON"
    assert "GGML_BACKEND_DL" not in metal  # one binary on Apple GPUs, as llama.cpp's macOS build
    assert "CMAKE_INSTALL_RPATH" not in backends.cmake_flags("cpu", "windows")  # DLLs sit next to the .exe


def test_cpu_on_macos_turns_metal_off_and_metal_turns_it_on():
    assert backends.cmake_flags("cpu", "macos")["GGML_METAL"] == "OFF"
    assert "GGML_METAL" not in backends.cmake_flags("cpu", "linux")
    metal = backends.cmake_flags("metal", "macos")
    assert metal["GGML_METAL"] == "ON"
    assert metal["GGML_METAL_EMBED_LIBRARY"] == "ON"


def test_cuda_flags_and_arch_list():
    flags = backends.cmake_flags("cuda", "linux", cuda_arch="86,90")
    assert flags["GGML_CUDA"] == "ON"
    assert flags["GGML_CUDA_NCCL"] == "OFF"
    assert flags["CMAKE_CUDA_ARCHITECTURES"] == "86;90"
    # without --cuda-arch: llama.cpp's list for the toolkit in use
    cuda12 = backends.cmake_flags("cuda", "linux", nvcc_version=(12, 8))["CMAKE_CUDA_ARCHITECTURES"].split(";")
    assert cuda12 == ["50-virtual", "61-virtual", "70-virtual", "75-virtual", "80-virtual", "86-real", "89-real",
                      "90-virtual", "120a-real"]
    cuda124 = backends.cmake_flags("cuda", "windows", nvcc_version=(12, 4))["CMAKE_CUDA_ARCHITECTURES"]
    assert "61-virtual" in cuda124 and "70-virtual" in cuda124 and "120a" not in cuda124
    cuda13 = backends.cmake_flags("cuda", "linux", nvcc_version=(13, 0))["CMAKE_CUDA_ARCHITECTURES"].split(";")
    assert cuda13[0] == "75-virtual" and "121a-real" in cuda13 and not any(a.startswith(("50", "61", "70"))
                                                                           for a in cuda13)
    # no toolkit known: CMake's/ggml's own default, never a list the toolkit might not build
    assert "CMAKE_CUDA_ARCHITECTURES" not in backends.cmake_flags("cuda", "linux")


@pytest.mark.parametrize("value, expected", [
    ("86", "86"),
    ("86;90", "86;90"),
    ("75-virtual, 90-real", "75-virtual;90-real"),
    (["89", "120a-real"], "89;120a-real"),
    ("native", "native"),
])
def test_parse_cuda_arch_accepts(value, expected):
    assert backends.parse_cuda_arch(value) == expected


@pytest.mark.parametrize("value, nvcc, fragment", [
    ("sm_86", None, "is not a CUDA architecture"),
    ("8.6", None, "is not a CUDA architecture"),
    ("", None, "empty"),
    ("35", None, "older than sm_50"),
    ("86a", None, "only for sm_90"),
    ("native;86", None, "cannot be combined"),
    ("61", (13, 0), "CUDA 13.0 cannot build sm_61"),
    ("120a-real", (12, 4), "CUDA 12.4 cannot build sm_120"),
])
def test_parse_cuda_arch_rejects(value, nvcc, fragment):
    with pytest.raises(DfbuildError) as exc:
        backends.parse_cuda_arch(value, nvcc)
    assert fragment in exc.value.message
    assert exc.value.hint


def test_hip_targets_from_families_and_ids():
    assert backends.parse_gpu_targets("rdna4") == "gfx1200;gfx1201"
    assert backends.parse_gpu_targets("rdna4,gfx1030,gfx1201") == "gfx1200;gfx1201;gfx1030"
    flags = backends.cmake_flags("hip", "linux", gpu_targets="gfx1100")
    assert flags["GGML_HIP"] == "ON"
    assert flags["GPU_TARGETS"] == "gfx1100"
    default = backends.cmake_flags("hip", "linux")["GPU_TARGETS"].split(";")
    assert {"gfx1200", "gfx1201"} <= set(default)  # RDNA4, the reporter's card, is in the default


@pytest.mark.parametrize("bad", ["rdna9", "sm_86", "gfx", ""])
def test_hip_targets_reject_nonsense(bad):
    with pytest.raises(DfbuildError):
        backends.parse_gpu_targets(bad)


def test_vulkan_include_override():
    flags = backends.cmake_flags("vulkan", "linux", vulkan_include_dir="/opt/vk/include")
    assert flags["GGML_VULKAN"] == "ON"
    assert flags["Vulkan_INCLUDE_DIR"] == "/opt/vk/include"


@pytest.mark.parametrize("kwargs", [{"cuda_arch": "86"}, {"gpu_targets": "rdna4"},
                                    {"vulkan_include_dir": "/x"}])
def test_backend_options_are_refused_for_other_backends(kwargs):
    with pytest.raises(DfbuildError) as exc:
        backends.cmake_flags("cpu", "linux", **kwargs)
    assert "applies only to" in exc.value.message


def test_unknown_backend_has_its_own_exit_code():
    with pytest.raises(UnsupportedBackendError) as exc:
        backends.get("opencl")
    assert exc.value.exit_code == 33
    assert "cpu, cuda, vulkan, hip, metal" in exc.value.hint


def test_cmake_args_keep_table_order():
    args = backends.cmake_args({"A": "1", "B": "x y"})
    assert args == ["-DA=1", "-DB=x y"]


@pytest.mark.parametrize("platform_name, machine, expected", [
    ("win32", "AMD64", ("windows", "x64")),
    ("darwin", "arm64", ("macos", "arm64")),
    ("linux", "aarch64", ("linux", "arm64")),
    ("linux", "x86_64", ("linux", "x64")),
])
def test_current_host_maps_platform_names(monkeypatch, platform_name, machine, expected):
    monkeypatch.setattr(backends.sys, "platform", platform_name)
    monkeypatch.setattr(backends.platform, "machine", lambda: machine)
    host = backends.current_host()
    assert (host.os, host.arch) == expected
    assert host.exe_suffix == (".exe" if expected[0] == "windows" else "")


def test_install_keys_go_from_specific_to_generic():
    host = backends.Host("linux", "x64", "debian", "12")
    assert host.install_keys() == ["debian-12", "debian", "linux"]
    assert backends.Host("windows", "x64").install_keys() == ["windows"]
