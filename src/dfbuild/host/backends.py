"""The backend table (data/backends.toml) and the CMake flags it implies.

Everything backend-specific is data in backends.toml; this module only reads
it, validates the few options a user may pass (--cuda-arch, --gpu-targets), and
turns (backend, host) into CMake flags. doctor.py probes the toolchains the
table names, build.py runs CMake with these flags, and matrix.py lists the
release entries, so the three can never disagree.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dfbuild.core.errors import DfbuildError, UnsupportedBackendError

try:  # Python 3.11+
    import tomllib as _toml  # type: ignore[import-not-found]  # mypy checks as 3.10, which has none
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    _toml = None

OSES = ("linux", "macos", "windows")
ARCHES = ("x64", "arm64")


# --- the table ------------------------------------------------------------------


def data_table(name: str) -> dict:
    """A TOML file of dfbuild's data/ folder (backends.toml, targets.toml), parsed."""
    text = resources.files("dfbuild").joinpath(f"data/{name}").read_text(encoding="utf-8")
    if _toml is not None:
        return _toml.loads(text)
    import tomlkit  # pragma: no cover

    return tomlkit.loads(text).unwrap()  # pragma: no cover


@functools.cache
def table() -> dict:
    """The parsed backends.toml (cached; treat it as read-only)."""
    return data_table("backends.toml")


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    hosts: tuple[str, ...]
    artifact_suffix: str
    flags: dict = field(hash=False)
    host_flags: dict = field(hash=False)
    probes: tuple[str, ...]
    runtime_probes: tuple[str, ...]
    not_here: dict = field(hash=False)
    smoke_server_args: tuple[str, ...]       # how the smoke stage runs this backend's llama-server
    smoke_env: dict = field(hash=False)
    smoke_runtime: dict = field(hash=False)   # start timeout, identity rule, shader cache
    smoke_software: dict = field(hash=False)  # the smaller table for software devices
    smoke_device: dict = field(hash=False)    # GPU backends: the device the smoke must find (smoke.plan)
    raw: dict = field(hash=False, repr=False)

    def builds_on(self, host_os: str) -> bool:
        return host_os in self.hosts

    def why_not_on(self, host_os: str) -> str:
        return self.not_here.get(host_os, f"the {self.name} backend does not build on {host_os}")


def names() -> list[str]:
    return list(table()["backends"])


def resolve(backend: Backend | str) -> Backend:
    """The backend record for a name (the CLI resolves once; stages pass the record on)."""
    return backend if isinstance(backend, Backend) else get(backend)


def get(name: str) -> Backend:
    """The backend called NAME, or UnsupportedBackendError listing the known ones."""
    entry = table()["backends"].get(name)
    if entry is None:
        raise UnsupportedBackendError(
            f"unknown backend '{name}'",
            f"choose one of: {', '.join(names())}",
        )
    return Backend(
        name=name,
        summary=entry["summary"],
        hosts=tuple(entry["hosts"]),
        artifact_suffix=entry["artifact_suffix"],
        flags=dict(entry.get("flags", {})),
        host_flags={k: dict(v) for k, v in entry.get("host_flags", {}).items()},
        probes=tuple(entry.get("probes", ())),
        runtime_probes=tuple(entry.get("runtime_probes", ())),
        not_here=dict(entry.get("not_here", {})),
        smoke_server_args=tuple(entry.get("smoke", {}).get("server_args", ())),
        smoke_env=dict(entry.get("smoke", {}).get("env", {})),
        smoke_runtime=dict(entry.get("smoke", {}).get("runtime", {})),
        smoke_software=dict(entry.get("smoke", {}).get("software", {})),
        smoke_device=dict(entry.get("smoke", {}).get("device", {})),
        raw=entry,
    )


# --- hosts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    os: str                      # linux | macos | windows
    arch: str                    # x64 | arm64
    distro: str | None = None    # e.g. "debian", "ubuntu" (Linux only)
    distro_version: str | None = None  # e.g. "12"
    # A cross build (`--os windows` on Linux): the OS of the machine that runs the build, while
    # `os` and `arch` are what the binaries are for (platforms.target_host makes these). None: native.
    build_os: str | None = None
    # ...and the arch of that machine, for a cross build to another arch of the same OS
    # (`--arch arm64` on Linux x64). None: the target's own arch (no arch cross).
    build_arch: str | None = None

    @property
    def exe_suffix(self) -> str:
        return ".exe" if self.os == "windows" else ""

    @property
    def cross(self) -> bool:
        return ((bool(self.build_os) and self.build_os != self.os)
                or (bool(self.build_arch) and self.build_arch != self.arch))

    def install_keys(self) -> list[str]:
        """Keys of a probe's install table, most specific first (the machine that installs: the build OS)."""
        keys = []
        if self.distro and self.distro_version:
            keys.append(f"{self.distro}-{self.distro_version}")
        if self.distro:
            keys.append(self.distro)
        keys.append(self.build_os or self.os)
        return keys


def normalise_arch(machine: str) -> str:
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "x64"):
        return "x64"
    if machine in ("aarch64", "arm64", "armv8l", "arm64e"):
        return "arm64"
    return machine


def current_host() -> Host:
    if sys.platform.startswith("win"):
        return Host("windows", normalise_arch(platform.machine()))
    if sys.platform == "darwin":
        return Host("macos", normalise_arch(platform.machine()))
    distro = version = None
    try:
        release = platform.freedesktop_os_release()
        distro, version = release.get("ID"), release.get("VERSION_ID")
    except (OSError, AttributeError):
        pass
    return Host("linux", normalise_arch(platform.machine()), distro, version)


# --- user-supplied lists ----------------------------------------------------------

# One CUDA architecture as CMake accepts it: 86, 90-real, 120a-real, 75-virtual.
_CUDA_ARCH = re.compile(r"(\d{2,3})([af]?)(-real|-virtual)?")
_CUDA_ARCH_WORDS = ("native", "all", "all-major")


def _split_list(value: str | Iterable[str]) -> list[str]:
    items = re.split(r"[;,\s]+", value) if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


def parse_cuda_arch(value: str | Iterable[str], nvcc_version: tuple[int, ...] | None = None) -> str:
    """Validate a --cuda-arch list ("86", "86,90", "75-virtual;90-real") into CMake's ';' form.

    With the nvcc version known, also reject what that toolkit cannot build
    (CUDA 13 dropped everything below sm_75; 100+ needs CUDA 12.8).
    """
    items = _split_list(value)
    if not items:
        raise DfbuildError("--cuda-arch is empty", "give compute capabilities like 86 or 86;90")
    for item in items:
        if item in _CUDA_ARCH_WORDS:
            if len(items) > 1:
                raise DfbuildError(f"--cuda-arch '{item}' cannot be combined with other architectures",
                                   "give it alone, or list numeric architectures")
            continue
        match = _CUDA_ARCH.fullmatch(item)
        if not match:
            raise DfbuildError(
                f"'{item}' is not a CUDA architecture",
                "use compute capabilities without the dot, e.g. 86 (RTX 30xx), 89 (RTX 40xx), 90 (H100/H200), "
                "optionally with -real or -virtual",
            )
        number = int(match.group(1))
        if number < 50:
            raise DfbuildError(f"CUDA architecture {item} is older than sm_50, which no supported toolkit builds",
                               "use 50 or newer")
        if match.group(2) and number < 90:
            raise DfbuildError(f"'{item}': the a/f suffixes exist only for sm_90 and newer", "drop the suffix")
        if nvcc_version:
            if nvcc_version >= (13,) and number < 75:
                raise DfbuildError(f"CUDA {'.'.join(map(str, nvcc_version))} cannot build sm_{number}",
                                   "CUDA 13 supports sm_75 and newer; use an older toolkit for older GPUs")
            if nvcc_version < (12, 8) and number >= 100:
                raise DfbuildError(f"CUDA {'.'.join(map(str, nvcc_version))} cannot build sm_{number}",
                                   "Blackwell (sm_100/sm_120) needs CUDA 12.8 or newer")
    return ";".join(items)


_GFX = re.compile(r"gfx[0-9]{2,4}[a-f0-9]?")


def parse_gpu_targets(value: str | Iterable[str]) -> str:
    """Validate a --gpu-targets list of gfx ids and/or family names (rdna4, ...) into 'gfx1200;gfx1201'."""
    families = table()["backends"]["hip"]["gpu_families"]
    targets: list[str] = []
    items = _split_list(value)
    if not items:
        raise DfbuildError("--gpu-targets is empty", f"give gfx ids or families: {', '.join(families)}")
    for item in items:
        expanded = families.get(item.lower())
        if expanded is None:
            if not _GFX.fullmatch(item.lower()):
                raise DfbuildError(
                    f"'{item}' is not an AMD GPU target",
                    f"use gfx ids like gfx1201 or a family: {', '.join(families)}",
                )
            expanded = [item.lower()]
        targets.extend(t for t in expanded if t not in targets)
    return ";".join(targets)


# --- flags ----------------------------------------------------------------------


def cuda_default_arch(nvcc_version: tuple[int, ...]) -> str:
    """llama.cpp's own non-native CMAKE_CUDA_ARCHITECTURES for a toolkit (ggml/src/ggml-cuda/CMakeLists.txt).

    CUDA 12 keeps 50/61/70 (Maxwell, Pascal, Volta: people run DFlash on them);
    CUDA 13 dropped everything below sm_75.
    """
    archs = []
    if nvcc_version < (13,):
        archs += ["50-virtual", "61-virtual", "70-virtual"]
    archs += ["75-virtual", "80-virtual", "86-real"]
    if nvcc_version >= (11, 8):
        archs += ["89-real", "90-virtual"]
    if nvcc_version >= (12, 8):
        archs += ["120a-real"]
    if nvcc_version >= (12, 9):
        archs += ["121a-real"]
    return ";".join(archs)


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", str(text))[:3])


def cpu_variants(host_os: str, arch: str, *, msvc: bool | None = None) -> list[str]:
    """The runtime-dispatched CPU variants a release build has on this host (empty: none).

    MSVC builds fewer (ggml skips the ones it cannot compile); MSVC is the compiler
    of a native Windows build, while a cross build for Windows (mingw-w64 GCC) has
    GCC's full list: pass msvc=False (or use host_cpu_variants).
    """
    if "GGML_CPU_ALL_VARIANTS" not in arch_flags(host_os, arch):
        return []
    variants = table()["common"]["cpu_variants"]
    if arch != "x64":
        return list(variants.get(arch, []))
    msvc = host_os == "windows" if msvc is None else msvc
    return list(variants["x64_msvc"] if msvc else variants["x64"])


def arch_flags(host_os: str, arch: str) -> dict[str, str]:
    """The arch's flags (common.arch_flags.<arch>), then the OS's own for it (common.arch_flags.<os>-<arch>)."""
    table_ = table()["common"].get("arch_flags", {})
    return {**table_.get(arch, {}), **table_.get(f"{host_os}-{arch}", {})}


def host_cpu_variants(host: Host) -> list[str]:
    """cpu_variants for a Host: a cross build for Windows compiles with GCC, not MSVC."""
    return cpu_variants(host.os, host.arch, msvc=host.os == "windows" and not host.cross)


def cmake_flags(backend: Backend | str, host_os: str, *, cuda_arch: str | Iterable[str] | None = None,
                gpu_targets: str | Iterable[str] | None = None,
                vulkan_include_dir: str | None = None,
                nvcc_version: tuple[int, ...] | None = None, arch: str = "x64") -> dict[str, str]:
    """The static CMake flags for BACKEND on HOST_OS/ARCH: common, backend, host-specific, options.

    These are the flags a release entry lists; build.py adds only the per-build
    ones (version stamp, compiler launchers) on top. Without --cuda-arch, the
    CUDA architectures are llama.cpp's list for NVCC_VERSION (the toolkit in use).
    """
    if host_os not in OSES:
        raise DfbuildError(f"unknown host os '{host_os}'", f"use one of {', '.join(OSES)}")
    spec = resolve(backend)
    backend = spec.name
    common = table()["common"]
    flags: dict[str, str] = {}
    flags.update(common["flags"])
    flags.update(common.get("host_flags", {}).get(host_os, {}))
    if backend != "metal":  # Apple GPUs: one binary, no dynamic backends (as llama.cpp's macOS build)
        flags.update(arch_flags(host_os, arch))
    flags.update(spec.flags)
    flags.update(spec.host_flags.get(host_os, {}))

    if backend == "cuda":
        if cuda_arch is not None:
            flags["CMAKE_CUDA_ARCHITECTURES"] = parse_cuda_arch(cuda_arch, nvcc_version)
        elif nvcc_version:
            flags["CMAKE_CUDA_ARCHITECTURES"] = cuda_default_arch(nvcc_version)
    elif cuda_arch is not None:
        raise DfbuildError("--cuda-arch applies only to the cuda backend", "drop it, or use --backend cuda")

    if backend == "hip":
        flags["GPU_TARGETS"] = parse_gpu_targets(gpu_targets if gpu_targets is not None
                                                 else spec.raw["default_gpu_targets"])
    elif gpu_targets is not None:
        raise DfbuildError("--gpu-targets applies only to the hip backend", "drop it, or use --backend hip")

    if vulkan_include_dir is not None:
        if backend != "vulkan":
            raise DfbuildError("--vulkan-include-dir applies only to the vulkan backend",
                               "drop it, or use --backend vulkan")
        flags["Vulkan_INCLUDE_DIR"] = str(vulkan_include_dir)
    return flags


def cmake_args(flags: dict[str, str]) -> list[str]:
    """-DKEY=VALUE arguments, in the table's order (so logs read like the table)."""
    return [f"-D{key}={value}" for key, value in flags.items()]


def release_entries() -> list[dict]:
    """The raw [[release]] rows of the table (matrix.py turns them into the CI matrix)."""
    return [dict(row) for row in table()["release"]]


def machine_facts() -> dict:
    """Where a proof ran, as its record says it (`series record-proof` writes it into series.toml)."""
    cpu = platform.processor()
    try:  # Linux names the CPU model here; platform.processor() is often empty or just the arch
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "arch": platform.machine(), "cpu": cpu or None,
            "system": f"{platform.system()} {platform.release()}"}
