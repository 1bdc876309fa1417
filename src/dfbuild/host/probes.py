"""Toolchain probes: is a program, header, library or file present here, which version, and what to install.

Each backend in backends.toml names its probes (data/backends.toml [probes.*]); `probe(name, host)`
answers one of them as a Probe. `doctor` turns them into the per-backend report, and the platform
modules (platforms/) ask them directly: they sit below doctor, so a platform never imports doctor.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dfbuild.core import proc
from dfbuild.core.errors import ToolchainMissingError
from dfbuild.host import backends
from dfbuild.host.backends import Host


@dataclass
class Probe:
    name: str
    what: str
    found: bool
    optional: bool = False
    path: str | None = None
    version: str | None = None
    problem: str | None = None     # set when found but unusable (too old, ...)
    install: str | None = None     # what to do when not ok

    @property
    def ok(self) -> bool:
        return self.found and self.problem is None

    def as_dict(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        return data


# --- small helpers --------------------------------------------------------------


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:4])


def run_version(program: str, args: list[str], timeout: float = 30) -> str:
    """First output of `program args` (stdout, else stderr); '' if it cannot run."""
    try:
        result = proc.run([program, *args], timeout=timeout, errors="replace")
    except (OSError, proc.SubprocessError):
        return ""
    return (result.stdout.strip() or result.stderr.strip())


def _env_dirs(spec: dict, subdir: str) -> list[Path]:
    dirs = []
    for var in spec.get("dirs_env", ()):
        value = os.environ.get(var)
        if value:
            dirs.append(Path(value) / spec.get("env_subdir", subdir))
    return dirs


def _which(names: list[str], extra_dirs: list[Path]) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    for directory in extra_dirs:
        for name in names:
            found = shutil.which(name, path=str(directory))
            if found:
                return found
    return None


def _install_hint(spec: dict, host: Host) -> str | None:
    install = spec.get("install", {})
    for key in host.install_keys():
        if key in install:
            return install[key]
    return None


# --- probe kinds ----------------------------------------------------------------


def _probe_program(spec: dict, host: Host) -> tuple[str | None, str | None]:
    path = _which(spec["names"], _env_dirs(spec, "bin") + [Path(d) for d in spec.get("dirs", ())])
    if path is None:
        return None, None
    output = run_version(path, spec.get("version_args", ["--version"]))
    return path, _parse_version(spec, output)


def _pypi_program_dir(name: str) -> str | None:
    """Where the PyPI cmake / ninja packages (dfbuild dependencies) keep their binary."""
    try:
        if name == "cmake":
            import cmake

            return cmake.CMAKE_BIN_DIR
        if name == "ninja":
            import ninja

            return ninja.BIN_DIR
    except ImportError:
        return None
    return None


def find_pypi_program(name: str) -> str | None:
    """The PyPI package's binary first (a known version), else one on PATH."""
    directory = _pypi_program_dir(name)
    if directory:
        found = shutil.which(name, path=directory)
        if found:
            return found
    return shutil.which(name)


def _probe_pypi(spec: dict, host: Host) -> tuple[str | None, str | None]:
    path = find_pypi_program(spec["names"][0])
    if path is None:
        return None, None
    return path, _parse_version(spec, run_version(path, spec.get("version_args", ["--version"])))


def _parse_version(spec: dict, output: str) -> str | None:
    if not output:
        return None
    regex = spec.get("version_regex")
    if regex:
        match = re.search(regex, output)
        return match.group(1) if match else None
    return output.splitlines()[0].strip()


def _toolkit_roots(spec: dict) -> list[Path]:
    """The install roots of the spec's near_program (nvcc: <root>/bin/nvcc), on PATH or under $CUDA_PATH."""
    near = spec.get("near_program")
    if not near:
        return []
    program = shutil.which(near)
    candidates = [program] if program else []
    for directory in _env_dirs({"dirs_env": ["CUDA_PATH", "CUDA_HOME"]}, "bin"):
        candidates.append(str(directory / near))
    # plus the usual install roots: an nvcc on PATH may be a wrapper script outside its toolkit
    found = [Path(candidate).resolve().parent.parent for candidate in candidates]
    return found + [Path(root) for root in spec.get("roots", ())]


def _header_dirs(spec: dict, extra_include_dirs: Sequence[Path]) -> list[Path]:
    dirs = list(extra_include_dirs) + _env_dirs(spec, "include")
    for root in _toolkit_roots(spec):
        dirs.append(root / "include")
        dirs.extend(sorted(root.glob("targets/*/include")))
    dirs.extend(Path(d) for d in spec.get("dirs", ()))
    return dirs


def _probe_header(spec: dict, host: Host, extra_include_dirs: Sequence[Path]) -> tuple[str | None, str | None]:
    for directory in _header_dirs(spec, extra_include_dirs):
        if all((directory / header).is_file() for header in spec["headers"]):
            version = None
            core = directory / "vulkan" / "vulkan_core.h"
            if "vulkan/vulkan_core.h" in spec["headers"]:
                version = vulkan_header_version(core)
            return str(directory), version
    return None, None


def vulkan_header_version(vulkan_core_h: Path) -> str | None:
    """'1.4.309' from vulkan_core.h's VK_HEADER_VERSION_COMPLETE and VK_HEADER_VERSION."""
    try:
        text = Path(vulkan_core_h).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    patch = re.search(r"#define\s+VK_HEADER_VERSION\s+(\d+)", text)
    complete = re.search(r"#define\s+VK_HEADER_VERSION_COMPLETE\s+VK_MAKE_API_VERSION\(\s*\d+\s*,\s*(\d+)\s*,\s*(\d+)",
                         text)
    if not patch:
        return None
    major, minor = (complete.group(1), complete.group(2)) if complete else ("1", "?")
    return f"{major}.{minor}.{patch.group(1)}"


def _probe_library(spec: dict, host: Host) -> tuple[str | None, str | None]:
    names = spec.get("libraries", {}).get(host.os, [])
    dirs = _env_dirs(spec, "Lib" if host.os == "windows" else "lib")
    for root in _toolkit_roots(spec):  # where CMake's FindCUDAToolkit looks: the toolkit's lib dirs, their stubs
        for lib in ("lib64", "lib", "lib/x64", *(str(t.relative_to(root)) for t in sorted(root.glob("targets/*/lib")))):
            dirs += [root / lib, root / lib / "stubs"]
    dirs += [Path(d) for d in spec.get("dirs", ())]
    # more of what CMake's find_library searches, so that a probe never refuses what the configure would find:
    # path lists from the environment as they are, and for each PATH entry <p>/bin its <p>/lib and <p>/lib64
    for var in spec.get("path_lists_env", ()):
        dirs += [Path(d) for d in os.environ.get(var, "").split(os.pathsep) if d]
    if spec.get("path_prefixes"):
        bins = [Path(d) for d in os.environ.get("PATH", "").split(os.pathsep) if d.rstrip("/\\").endswith("bin")]
        multiarch = {"x64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}.get(host.arch)  # Debian's lib/<triplet>
        dirs += [b.parent / lib for b in bins for lib in ("lib", "lib64", *([f"lib/{multiarch}"] if multiarch else []))]
    for directory in dirs:
        for name in names:
            if (directory / name).exists():
                return str(directory / name), None
    return None, None


def _probe_file(spec: dict, host: Host) -> tuple[str | None, str | None]:
    for candidate in spec.get("files", {}).get(host.os, []):
        if Path(candidate).is_file():
            return candidate, None
    return None, None


def _probe_metal(spec: dict, host: Host) -> tuple[str | None, str | None]:
    if host.os != "macos":
        return None, None
    located = run_version("xcrun", ["-sdk", "macosx", "--find", "metal"])
    if not located or not Path(located.splitlines()[-1]).exists():
        return None, None
    version = run_version("xcrun", ["-sdk", "macosx", "metal", "--version"])
    return located.splitlines()[-1], (version.splitlines()[0] if version else None)


# --- Windows: MSVC ----------------------------------------------------------------


def vswhere_path() -> Path:
    root = os.environ.get("ProgramFiles(x86)", r"C:\Program Files (x86)")
    return Path(root) / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"


def find_msvc(arch: str = "x64") -> dict | None:
    """Locate MSVC: an active developer prompt (cl on PATH), else vcvars via vswhere.

    Returns {"cl": path or None, "vcvars": path or None, "version": str or None}.
    """
    cl = shutil.which("cl")
    if cl and os.environ.get("VCINSTALLDIR"):
        return {"cl": cl, "vcvars": None, "version": os.environ.get("VCToolsVersion")}
    vswhere = vswhere_path()
    if not vswhere.is_file():
        return None
    install = run_version(str(vswhere), ["-latest", "-products", "*", "-requires",
                                         "Microsoft.VisualStudio.Component.VC.Tools.x86.x64",
                                         "-property", "installationPath"])
    if not install:
        return None
    script = "vcvarsarm64.bat" if arch == "arm64" else "vcvars64.bat"
    vcvars = Path(install.splitlines()[0].strip()) / "VC" / "Auxiliary" / "Build" / script
    if not vcvars.is_file():
        return None
    version = run_version(str(vswhere), ["-latest", "-products", "*", "-property", "installationVersion"])
    return {"cl": None, "vcvars": str(vcvars), "version": version or None}


MSVC_HINT = ("open the 'x64 Native Tools Command Prompt for VS 2022' (or run vcvars64.bat) and rerun dfbuild "
             "there, or install Visual Studio 2022 Build Tools with the 'Desktop development with C++' workload")


def msvc_environment(vcvars: str) -> dict[str, str]:
    """The environment a developer prompt would have: run vcvars in cmd and read back `set`.

    The two commands go through a small .bat file: Python's list quoting (\\") is not
    cmd's, so a vcvars path with spaces could not be passed inline.
    """
    with tempfile.TemporaryDirectory(prefix="dfbuild-msvc-") as tmp:
        script = Path(tmp) / "msvc-env.bat"
        script.write_text(f'@echo off\r\ncall "{vcvars}" >nul || exit /b 1\r\nset\r\n', encoding="utf-8")
        result = proc.run(["cmd", "/d", "/c", str(script)], errors="replace")
    if result.returncode != 0:
        raise ToolchainMissingError(f"{vcvars} failed (exit {result.returncode})", MSVC_HINT)
    env = {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key:
            env[key] = value
    return env


def _probe_msvc(spec: dict, host: Host) -> tuple[str | None, str | None]:
    found = find_msvc(host.arch)
    if not found:
        return None, None
    return found["cl"] or found["vcvars"], found["version"]


# --- probing ---------------------------------------------------------------------


def probe(name: str, host: Host, *, optional: bool = False, extra_include_dirs: Sequence[Path] = (),
          spec: dict | None = None) -> Probe:
    """Probe NAME of backends.toml (or SPEC: a probe of another table, the web UI's node and npm)."""
    spec = spec if spec is not None else backends.table()["probes"][name]
    kind = spec["kind"]
    if host.os == "windows" and not host.cross and spec.get("windows_kind"):
        kind = spec["windows_kind"]
    if kind == "program":
        path, version = _probe_program(spec, host)
    elif kind == "pypi":
        path, version = _probe_pypi(spec, host)
    elif kind == "header":
        path, version = _probe_header(spec, host, list(extra_include_dirs))
    elif kind == "library":
        path, version = _probe_library(spec, host)
    elif kind == "file":
        path, version = _probe_file(spec, host)
    elif kind == "metal":
        path, version = _probe_metal(spec, host)
    elif kind == "msvc":
        path, version = _probe_msvc(spec, host)
    else:  # pragma: no cover - a typo in backends.toml
        raise ValueError(f"probe {name}: unknown kind {kind}")

    result = Probe(name=name, what=spec["what"], found=path is not None, optional=optional,
                   path=path, version=version)
    minimum = spec.get("min_version")
    if result.found and minimum:
        if version is None:
            result.problem = f"cannot tell its version (need >= {minimum})"
        elif version_tuple(version) < version_tuple(minimum):
            result.problem = f"version {version} is too old (need >= {minimum})"
    if not result.ok:
        hint = _install_hint(spec, host)
        if kind == "msvc":
            hint = MSVC_HINT
        if hint and "{cuda_dash}" in hint:  # name the packages of the nvcc actually installed
            nvcc = probe("nvcc", host) if name != "nvcc" else result
            numbers = version_tuple(nvcc.version or "")[:2] if nvcc.found else ()
            hint = hint.replace("{cuda_dash}", "-".join(map(str, numbers)) if len(numbers) == 2 else "12-8")
        result.install = hint or f"install {spec['what']}"
    return result
