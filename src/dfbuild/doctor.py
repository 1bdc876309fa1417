"""`dfbuild doctor`: which backends can build here, and exactly what to install.

Each backend in backends.toml names its toolchain probes; a probe says what to
look for (a program and its version, a header, a library) and what to install
per host when it is missing. `dfbuild build` runs the same check first and
fails fast with ToolchainMissingError.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from . import backends, proc
from .backends import Host
from .errors import ToolchainMissingError, UnsupportedBackendError


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


def _header_dirs(spec: dict, extra_include_dirs: list[Path]) -> list[Path]:
    dirs = list(extra_include_dirs) + _env_dirs(spec, "include")
    near = spec.get("near_program")
    if near:
        program = shutil.which(near)
        candidates = [program] if program else []
        for directory in _env_dirs({"dirs_env": ["CUDA_PATH", "CUDA_HOME"]}, "bin"):
            candidates.append(str(directory / near))
        for candidate in candidates:
            root = Path(candidate).resolve().parent.parent
            dirs.append(root / "include")
            dirs.extend(sorted(root.glob("targets/*/include")))
    dirs.extend(Path(d) for d in spec.get("dirs", ()))
    return dirs


def _probe_header(spec: dict, host: Host, extra_include_dirs: list[Path]) -> tuple[str | None, str | None]:
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
    dirs = _env_dirs(spec, "Lib" if host.os == "windows" else "lib") + [Path(d) for d in spec.get("dirs", ())]
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


def probe(name: str, host: Host, *, optional: bool = False, extra_include_dirs: list[Path] = ()) -> Probe:
    spec = backends.table()["probes"][name]
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


def check_backend(backend: str, host: Host | None = None, *, extra_include_dirs: list[Path] = (),
                  _cache: dict | None = None) -> dict:
    """One backend's doctor entry: can it build on HOST, what was found, what to install."""
    host = host or backends.current_host()
    spec = backends.get(backend)
    cache = _cache if _cache is not None else {}
    entry: dict = {"backend": backend, "summary": spec.summary, "can_build": False, "reason": None,
                   "toolchain": [], "runtime": [], "missing": [], "install": []}
    if not spec.builds_on(host.os):
        entry["reason"] = spec.why_not_on(host.os)
        entry["install"] = [entry["reason"]]
        return entry

    common = backends.table()["common"]
    if host.cross:
        # a cross build (--os windows on Linux): the target's cross compilers instead of the native
        # ones, no host TLS library (targets.toml says why), and what runs the binaries here
        from . import platforms

        target = platforms.cross_entry(host)
        entry["target"] = {"os": host.os, "arch": host.arch, "build_os": host.build_os,
                           **({"build_arch": host.build_arch} if host.build_arch else {}),
                           "toolchain": target.get("toolchain")}
        if spec.name not in target.get("backends", ("cpu",)):
            entry["reason"] = target.get("not_backends", {}).get(
                spec.name, f"the {spec.name} backend is not cross-built for {host.os} here")
            entry["install"] = [entry["reason"]]
            return entry
        native = {"c-compiler", "cxx-compiler"}
        # a backend's cross build may need other tools than its native one (Vulkan for Windows: headers
        # and glslc, no Linux loader; a display to run): targets.toml backend_probes / backend_run_probes
        backend_probes = target.get("backend_probes", {}).get(spec.name, spec.probes)
        wanted = [(name, False) for name in (*target.get("probes", ()),
                                              *(p for p in common["probes"] if p not in native), *backend_probes)]
        run_probes = (*target.get("run_probes", ()), *target.get("backend_run_probes", {}).get(spec.name, ()))
    else:
        wanted = [(name, False) for name in (*common["probes"], *common.get("host_probes", {}).get(host.os, ()),
                                              *spec.probes)]
        run_probes = ()
    wanted += [(name, True) for name in common.get("optional_probes", ())]
    for name, optional in wanted:
        key = (name, tuple(map(str, extra_include_dirs)))
        if key not in cache:
            cache[key] = probe(name, host, optional=optional, extra_include_dirs=extra_include_dirs)
        entry["toolchain"].append(cache[key].as_dict())
    # what runs the binaries: this machine's own (a cross build's .exe reaches this host's Vulkan driver)
    run_host = backends.current_host() if host.cross else host
    for name in spec.runtime_probes:
        entry["runtime"].append(probe(name, run_host, optional=True).as_dict())
    for name in run_probes:  # not needed to build, needed to smoke, prove and verify --run: installed with it
        entry["runtime"].append(probe(name, host, optional=True).as_dict())

    blocking = [p for p in entry["toolchain"] if not p["ok"] and not p["optional"]]
    entry["missing"] = [p["name"] for p in blocking]
    if not host.cross:
        entry["install"] = _dedupe(p["install"] for p in blocking)
    else:
        from . import platforms

        unrunnable = [p for p in entry["runtime"] if p["name"] in run_probes and not p["ok"]]
        entry["missing_to_run"] = [p["name"] for p in unrunnable]
        # one line for the whole cross toolchain, as the user types it, but only when something it
        # installs is missing: a hint to install what is there already reads as if it were not
        in_line = {*target.get("probes", ()), *target.get("run_probes", ())}
        missed = (*blocking, *unrunnable)
        line = [platforms.cross(host).install_line(host)] if any(p["name"] in in_line for p in missed) else []
        entry["install"] = _dedupe(line + [p["install"] for p in missed if p["name"] not in in_line])
    entry["can_build"] = not blocking
    if blocking:
        entry["reason"] = "missing: " + "; ".join(
            p["what"] + (f" ({p['problem']})" if p["problem"] else "") for p in blocking)
    if blocking and spec.name == "hip":
        _hip_in_root(entry, host)
    return entry


def _hip_in_root(entry: dict, host: Host) -> None:
    """No ROCm here: a Linux x64 host builds hip in dfbuild's Debian forky root (platforms/rocm_root.py)."""
    from .platforms import rocm_root

    if host.os != "linux" or host.arch != "x64" or host.cross or not rocm_root.runs_here() \
            or os.environ.get(rocm_root.ROOT_ENV, "").strip().lower() == "host":
        return
    root = rocm_root.recipe()
    made = rocm_root.root_path(root)
    have = shutil.which("mmdebstrap") is not None
    entry["rocm_root"] = {"suite": root["suite"], "rocm": root["rocm"], "path": str(made),
                          "made": rocm_root.is_made(made), "mmdebstrap": have}
    state = (f"made: {made}" if rocm_root.is_made(made)
             else "made once on the first hip build: about 550 MB to download, 5.3 GB on disk")
    where = f"the Debian {root['suite']} root with ROCm {root['rocm']} ({state}; docs/hip.md)"
    if have or rocm_root.is_made(made):
        entry["can_build"] = True
        entry["reason"] = f"no ROCm on this machine: builds in {where}"
        entry["install"] = []
    else:
        entry["install"] = [f"{rocm_root.MMDEBSTRAP_INSTALL} (dfbuild then builds hip in {where})",
                            *entry["install"]]


def _dedupe(items) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item and item not in seen:
            seen.append(item)
    return seen


def doctor(backend: str | None = None, *, host: Host | None = None,
           extra_include_dirs: list[Path] = ()) -> dict:
    """Per backend (or just BACKEND): what is present here and exactly what to install."""
    host = host or backends.current_host()
    chosen = [backend] if backend else backends.names()
    for name in chosen:
        backends.get(name)  # unknown backend -> UnsupportedBackendError before any probing
    cache: dict = {}
    return {
        "host": {"os": host.build_os or host.os, "arch": backends.current_host().arch if host.cross else host.arch,
                 "distro": host.distro, "distro_version": host.distro_version},
        **({"target": {"os": host.os, "arch": host.arch}} if host.cross else {}),
        "backends": {name: check_backend(name, host, extra_include_dirs=extra_include_dirs, _cache=cache)
                     for name in chosen},
    }


def require(backend: str, host: Host | None = None, *, extra_include_dirs: list[Path] = ()) -> dict:
    """check_backend, raising if BACKEND cannot build here.

    UnsupportedBackendError when the host can never build it (metal off macOS),
    ToolchainMissingError (what is missing + what to install) otherwise.
    """
    entry = check_backend(backend, host, extra_include_dirs=extra_include_dirs)
    if not entry["can_build"] and not entry["toolchain"]:  # not a toolchain matter: this host never can
        raise UnsupportedBackendError(f"the {backend} backend cannot build here: {entry['reason']}",
                                      "build it on a runner of its kind (see `dfbuild matrix`)")
    if not entry["can_build"]:
        raise ToolchainMissingError(
            f"cannot build the {backend} backend here: {entry['reason']}",
            "\n".join(entry["install"]) or None,
        )
    return entry


def toolchain_versions(entry: dict) -> dict[str, str | None]:
    """{probe name: version or path} of what a build used, for the manifest."""
    return {p["name"]: (p["version"] or p["path"]) for p in entry["toolchain"] if p["found"]}


# --- Vulkan headers for Debian 12 ----------------------------------------------------------
# Debian 12's libvulkan-dev (1.3.239) predates VK_EXT_layer_settings, which
# ggml-vulkan uses. Debian 13's package (1.4.309) has it and its headers work
# with Debian 12's loader and glslc, so dfbuild can unpack just those headers
# into its cache (through apt, with a private state dir: the system's apt setup
# is not touched) and pass them as Vulkan_INCLUDE_DIR.


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str | None:
    """The Debian archive URI this machine's apt already uses (deb822 or one-line sources)."""
    files = sorted((sources_dir / "sources.list.d").glob("*.sources")) if (sources_dir / "sources.list.d").is_dir() else []
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("URIs:"):
                for uri in line.split()[1:]:
                    if uri.rstrip("/").endswith("/debian"):
                        return uri.rstrip("/")
    lists = [sources_dir / "sources.list"]
    if (sources_dir / "sources.list.d").is_dir():
        lists += sorted((sources_dir / "sources.list.d").glob("*.list"))
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            match = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", line)
            if match:
                return match.group(1)
    return None


def fetch_debian_vulkan_headers(suite: str = "trixie") -> Path:
    """Unpack SUITE's libvulkan-dev headers into the cache; returns the include dir to pass."""
    from .paths import cache_dir, locked

    root = cache_dir() / "vulkan-headers" / suite
    include = root / "usr" / "include"
    if (include / "vulkan" / "vulkan_core.h").is_file():
        return include
    mirror = debian_mirror()
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb") and mirror):
        raise ToolchainMissingError("fetching Debian's Vulkan headers needs apt-get, dpkg-deb and a Debian mirror",
                                    "on other systems install Vulkan headers >= 1.3.272 (or the LunarG SDK)")
    with locked(root):
        apt = root / "apt"
        for sub in ("lists/partial", "cache/archives/partial", "parts"):
            (apt / sub).mkdir(parents=True, exist_ok=True)
        (apt / "sources.list").write_text(
            f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {suite} main\n")
        options = ["-o", f"Dir::Etc::SourceList={apt / 'sources.list'}", "-o", f"Dir::Etc::SourceParts={apt / 'parts'}",
                   "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
                   "-o", "Debug::NoLocking=1"]
        for args in (["update"], ["download", "libvulkan-dev"]):
            result = proc.run(["apt-get", "-q", *options, *args], cwd=apt, errors="replace")
            if result.returncode != 0:
                last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:]
                raise ToolchainMissingError(f"apt-get {args[0]} for Debian {suite} failed: {' '.join(last)}",
                                            "check apt's access to the Debian mirror")
        debs = sorted(apt.glob("libvulkan-dev_*.deb"))
        if not debs:
            raise ToolchainMissingError(f"apt-get download gave no libvulkan-dev package for {suite}")
        proc.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], capture=False, check=True)
    return include
