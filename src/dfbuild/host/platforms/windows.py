"""Windows x64 binaries built on Linux (mingw-w64 GCC) and run here through Wine.

What targets.toml's [targets.windows.cross.linux] says, turned into files and
arguments:

- a CMake toolchain file dfbuild writes into the build dir
  (CMAKE_SYSTEM_NAME=Windows, the cross compilers, the static libgcc/libstdc++
  link without re-exports), and a rules override that drops MinGW's "lib"
  prefix, so ggml finds its CPU variants as ggml-cpu-<variant>.dll;
- a compatibility header forced into C files only when a test compile shows
  that the toolchain's headers lack a declaration ggml uses
  (THREAD_POWER_THROTTLING_STATE in mingw-w64 10: the code that keeps Windows 11
  from parking ggml's worker threads stays in);
- the runtime DLLs the binaries import from the toolchain (winpthread, libgomp,
  libgcc_s_seh), copied beside them into bin/ and shipped with their licenses;
- TLS: a static OpenSSL built for the target once (platforms/openssl.py), found
  by llama.cpp's own FindOpenSSL through the toolchain file's find roots;
- Vulkan ([vulkan]): an include dir of the Vulkan and SPIR-V headers alone, and
  an import library for vulkan-1.dll made from those headers (mingw-w64 has none);
- how to run a .exe here: `wine`, in a prefix inside dfbuild's cache; a Vulkan
  build with a display (the user's, else an Xvfb started for this process).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from dfbuild.core import paths, proc
from dfbuild.core.errors import BuildError, ToolchainMissingError
from dfbuild.host.backends import Host
from dfbuild.host.platforms import openssl
from dfbuild.host.platforms.targets import compiler_facts, cross_entry, write_if_changed

TOOLCHAIN_NAME = "dfbuild-toolchain-windows.cmake"
RULES_NAME = "dfbuild-rules-windows.cmake"
COMPAT_NAME = "dfbuild-mingw-compat.h"
EXIT_NAME = "dfbuild-mingw-exit"

# exit() that ends the process without DLL_PROCESS_DETACH, linked into every binary with
# `-Wl,--wrap=exit`. Why: llama-server starts a thread (the stream sessions' GC, waiting on a
# std::condition_variable) before it parses its arguments, so `--version`, `--help` and an argument
# error end the process while that thread waits. ExitProcess kills the thread inside winpthread's
# condition wait, and the DLL's static destructors then destroy that condition variable:
# winpthread's pthread_cond_destroy waits forever for the dead waiter (MSVC's does not). Windows
# hangs there as Wine does. So exit() flushes every C stream (std::cout/cerr are synced with
# them) and terminates the process with its exit code, as Windows' own guidance for process exit
# suggests (no cleanup at process exit); a clean server shutdown has joined its threads and freed
# its models before it returns from main, so nothing is lost.
EXIT_SOURCE = """\
/* written by dfbuild: exit() without DLL_PROCESS_DETACH (see platforms/windows.py) */
#include <stdio.h>
#include <windows.h>
void __wrap_exit(int code) {
  fflush(NULL);
  TerminateProcess(GetCurrentProcess(), (UINT) code);
  ExitProcess((UINT) code);
}
"""

# What each compat check test-compiles (with <windows.h>) and, when that fails, declares.
# Only plain C types: the header is forced in before any Windows header is read.
_CHECKS = {
    "THREAD_POWER_THROTTLING_STATE": (
        "THREAD_POWER_THROTTLING_STATE t; int main(void) { t.Version = THREAD_POWER_THROTTLING_CURRENT_VERSION; "
        "t.ControlMask = THREAD_POWER_THROTTLING_EXECUTION_SPEED; "
        "return SetThreadInformation(0, ThreadPowerThrottling, &t, sizeof(t)); }\n",
        # winbase.h of mingw-w64 10 has SetThreadInformation and ThreadPowerThrottling, not these:
        "#ifndef THREAD_POWER_THROTTLING_CURRENT_VERSION\n"
        "#define THREAD_POWER_THROTTLING_CURRENT_VERSION 1\n"
        "#define THREAD_POWER_THROTTLING_EXECUTION_SPEED 0x1\n"
        "#define THREAD_POWER_THROTTLING_VALID_FLAGS (THREAD_POWER_THROTTLING_EXECUTION_SPEED)\n"
        "typedef struct _THREAD_POWER_THROTTLING_STATE {\n"
        "  unsigned long Version;\n"
        "  unsigned long ControlMask;\n"
        "  unsigned long StateMask;\n"
        "} THREAD_POWER_THROTTLING_STATE, *PTHREAD_POWER_THROTTLING_STATE;\n"
        "#endif\n",
    ),
}


def entry(host: Host) -> dict:
    return cross_entry(host)


def _compiler(host: Host, which: str = "c_compiler") -> str:
    name = entry(host)[which]
    found = shutil.which(name)
    if found is None:
        raise ToolchainMissingError(f"the Windows cross compiler {name} is not installed",
                                    install_line(host))
    return found


def install_line(host: Host) -> str:
    install = entry(host).get("install", {})
    for key in host.install_keys():
        if key in install:
            return install[key]
    return install.get("linux", "install the mingw-w64 cross compilers and Wine")


# --- the compat header ------------------------------------------------------------------


def missing_declarations(host: Host) -> list[str]:
    """The compat checks whose declarations the toolchain's headers lack (a test compile each)."""
    compiler = _compiler(host)
    missing = []
    with tempfile.TemporaryDirectory(prefix="dfbuild-compat-") as tmp:
        for name in entry(host).get("compat_checks", ()):
            test, _ = _CHECKS[name]
            source = Path(tmp) / "check.c"
            source.write_text("#include <windows.h>\n" + test, encoding="utf-8")
            result = proc.run([compiler, "-fsyntax-only", str(source)])
            if result.returncode != 0:
                missing.append(name)
    return missing


def compat_header(names: list[str]) -> str:
    parts = ["/* written by dfbuild: declarations this mingw-w64's headers lack (a test compile showed it),\n"
             "   forced into C files so that the code using them is compiled, not dropped */\n",
             "#pragma once\n"]
    parts += [_CHECKS[name][1] for name in names]
    return "".join(parts)


# --- the toolchain file ---------------------------------------------------------------------


def _cmake_list(items) -> str:
    return " ".join(items)


def toolchain_text(host: Host, rules_path: Path, exit_object: Path | None = None,
                   extra_roots: Sequence[Path] = ()) -> str:
    e = entry(host)
    roots = " ".join([e["find_root"], *(Path(r).as_posix() for r in extra_roots)])
    link = _cmake_list([*e.get("link_flags", ()),
                        *([f"-Wl,--wrap=exit,--exclude-symbols,__wrap_exit {exit_object.as_posix()}"]
                          if exit_object else [])])
    return "\n".join([
        "# written by dfbuild: Windows x64 from Linux with mingw-w64 GCC (targets.toml)",
        f"set(CMAKE_SYSTEM_NAME {e['system_name']})",
        f"set(CMAKE_SYSTEM_PROCESSOR {e['system_processor']})",
        f"set(CMAKE_C_COMPILER {e['c_compiler']})",
        f"set(CMAKE_CXX_COMPILER {e['cxx_compiler']})",
        f"set(CMAKE_RC_COMPILER {e['rc_compiler']})",
        "# the toolchain's own root, then what dfbuild built for the target (OpenSSL)",
        f"set(CMAKE_FIND_ROOT_PATH {roots})",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)",
        "# libgcc and libstdc++ inside every binary, none of their symbols exported from a DLL",
        f'set(CMAKE_EXE_LINKER_FLAGS_INIT "{link}")',
        f'set(CMAKE_SHARED_LINKER_FLAGS_INIT "{link}")',
        f'set(CMAKE_MODULE_LINKER_FLAGS_INIT "{link}")',
        "# read after CMake's Windows-GNU platform file, which sets the lib prefix",
        f'set(CMAKE_USER_MAKE_RULES_OVERRIDE "{rules_path.as_posix()}")',
        "",
    ])


RULES_TEXT = """\
# written by dfbuild: DLLs named as llama.cpp's Windows builds name them (ggml-cpu-x64.dll, llama.dll):
# ggml's backend loader looks for ggml-<backend>-*.dll on Windows, not libggml-...
set(CMAKE_SHARED_LIBRARY_PREFIX "")
set(CMAKE_SHARED_MODULE_PREFIX "")
set(CMAKE_IMPORT_LIBRARY_PREFIX "")
"""


def configure(host: Host, build_dir: Path) -> dict:
    """Write the toolchain file, rules override and (when needed) compat header into BUILD_DIR.

    Returns {"cmake_args": [...], "c_flags": [...], "compat": [names], "flags": {...}}: the
    CMake arguments, the C flags to add, what the compat header supplies, and the target's flags.
    """
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    missing = missing_declarations(host)
    c_flags = []
    if missing:
        header = build_dir / COMPAT_NAME
        write_if_changed(header, compat_header(missing))
        c_flags = ["-include", str(header)]
    rules = build_dir / RULES_NAME
    write_if_changed(rules, RULES_TEXT)
    exit_object = exit_wrapper(host, build_dir)
    tls = tls_prefix(host)
    toolchain = build_dir / TOOLCHAIN_NAME
    write_if_changed(toolchain, toolchain_text(host, rules, exit_object, [tls] if tls else []))
    tls_args = openssl_cmake_args(tls) if tls else []
    return {"cmake_args": [f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", *tls_args], "c_flags": c_flags,
            "compat": missing, "flags": dict(entry(host).get("flags", {})),
            "tls": openssl.describe(entry(host)["tls"]) if tls else None}


# --- TLS ------------------------------------------------------------------------------------


def _openssl_tools(host: Host) -> dict[str, str]:
    """The cross tools OpenSSL's Configure is given, by the variables it reads."""
    e = entry(host)
    return {"CC": e["c_compiler"], "AR": f"{e['triplet']}-ar", "RANLIB": f"{e['triplet']}-ranlib",
            "RC": e["rc_compiler"]}


def _toolchain_id(host: Host) -> str:
    versions = toolchain_versions(host)
    return f"{entry(host)['c_compiler']} {versions['mingw-gcc']} mingw-w64 {versions['mingw-w64-headers']}"


def openssl_cmake_args(prefix: Path) -> list[str]:
    """How llama.cpp's FindOpenSSL finds the OpenSSL built for the target, statically linked.

    The prefix is in the arguments so that a new OpenSSL build (a new folder) reconfigures, and the
    cached results of an earlier search (FindOpenSSL keeps mingw's library paths in LIB_EAY and
    SSL_EAY, and the version check's answer) are dropped first, so they are found again there.
    Static libssl.a/libcrypto.a: nothing to ship, nothing loaded at run time (as BoringSSL in llama.cpp's zip).
    """
    return ["-ULIB_EAY", "-USSL_EAY", "-UOPENSSL_*", f"-DOPENSSL_ROOT_DIR={prefix.as_posix()}",
            "-DOPENSSL_USE_STATIC_LIBS=ON"]


def tls_prefix(host: Host, *, build: bool = True) -> Path | None:
    """The static OpenSSL the binaries link (built once into the cache), or None when the target has no `tls`.

    build=False: only where it is when already built (None otherwise).
    """
    spec = entry(host).get("tls")
    if spec is None:
        return None
    if not build:
        prefix = openssl.prefix_path(spec, _toolchain_id(host))
        return prefix if openssl.is_built(prefix) else None
    return openssl.ensure(spec, _openssl_tools(host), _toolchain_id(host))


def exit_wrapper(host: Host, build_dir: Path) -> Path:
    """Compile EXIT_SOURCE into BUILD_DIR (again only when it changed); the object every link gets."""
    source = Path(build_dir) / f"{EXIT_NAME}.c"
    obj = Path(build_dir) / f"{EXIT_NAME}.obj"
    write_if_changed(source, EXIT_SOURCE)
    if not obj.is_file() or obj.stat().st_mtime_ns < source.stat().st_mtime_ns:
        result = proc.run([_compiler(host), "-O2", "-c", str(source), "-o", str(obj)])
        if result.returncode != 0:
            raise BuildError(f"the cross compiler cannot compile {source.name}: {result.stderr.strip()[-300:]}",
                             install_line(host))
    return obj



def toolchain_versions(host: Host) -> dict[str, str | None]:
    """For the manifest and the OpenSSL build's key: the cross compiler's version and the mingw-w64 headers'."""
    return dict(_compiler_versions(_compiler(host)))


def _compiler_versions(compiler: str) -> tuple[tuple[str, str | None], ...]:
    names = ("__MINGW64_VERSION_MAJOR", "__MINGW64_VERSION_MINOR")
    version, found = compiler_facts(compiler, "_mingw.h", names)  # cached: configure and manifest ask
    return (("mingw-gcc", version), ("mingw-w64-headers", ".".join(found.get(k, "?") for k in names)))


# --- the runtime DLLs -----------------------------------------------------------------------


def runtime_dlls(host: Host) -> dict[str, Path]:
    """{name: path} of the toolchain's runtime DLLs the binaries import (targets.toml runtime_dlls)."""
    compiler = _compiler(host)
    found = {}
    for name in entry(host).get("runtime_dlls", ()):
        result = proc.run([compiler, f"-print-file-name={name}"])
        path = Path(result.stdout.strip())
        if not path.is_absolute() or not path.is_file():
            root = Path(entry(host)["find_root"])
            path = next((p for p in (root / "lib" / name, root / "bin" / name) if p.is_file()), path)
        if not path.is_file():
            raise ToolchainMissingError(f"the toolchain's {name} was not found (the binaries import it)",
                                        install_line(host))
        found[name] = path.resolve()
    return found


def stage_runtime(host: Host, build_dir: Path) -> list[str]:
    """Copy the runtime DLLs into BUILD_DIR/bin (where the .exe and Wine look first); their names."""
    bin_dir = Path(build_dir) / "bin"
    if not bin_dir.is_dir():
        raise BuildError(f"{bin_dir} does not exist after the build", "rebuild with --fresh")
    names = []
    for name, source in runtime_dlls(host).items():
        target = bin_dir / name
        if not target.is_file() or paths.sha256_file(target) != paths.sha256_file(source):
            shutil.copyfile(source, target)
        names.append(name)
    return names


def license_files(host: Host) -> dict[str, Path]:
    """{name in licenses/: file} for the shipped runtime DLLs (the first that exists of each) and the static OpenSSL."""
    found = {}
    for name, candidates in entry(host).get("runtime_licenses", {}).items():
        path = next((Path(c) for c in candidates if Path(c).is_file()), None)
        if path is not None:
            found[name] = path
    tls = tls_prefix(host, build=False)  # linked into the binaries: its license ships with them
    if tls is not None:
        found[entry(host)["tls"]["license_name"]] = tls / "LICENSE.txt"
    return found


# --- running .exe files here ------------------------------------------------------------------


def launcher(host: Host) -> list[str]:
    """The command prefix that runs a Windows program here: [path of wine]."""
    runner = entry(host).get("runner", ["wine"])
    program = shutil.which(runner[0])
    if program is None:
        raise ToolchainMissingError(f"{runner[0]} is not installed, so Windows programs cannot run here",
                                    install_line(host))
    return [program, *runner[1:]]


def run_env(host: Host) -> dict[str, str]:
    """Wine's environment: a prefix in dfbuild's cache (the user's own WINEPREFIX wins), quiet, no prompts."""
    e = entry(host)
    env = dict(e.get("runner_env", {}))
    var = e.get("prefix_env", "WINEPREFIX")
    env[var] = os.environ.get(var) or str(paths.cache_dir() / e.get("prefix_dir", "wine-prefix"))
    Path(env[var]).parent.mkdir(parents=True, exist_ok=True)
    return env


def start_timeout(host: Host) -> float | None:
    value = entry(host).get("start_timeout_s")
    return float(value) if value else None


# --- Vulkan ---------------------------------------------------------------------------------

VULKAN_DIR = "dfbuild-vulkan"   # in the build dir: the include dir, the .def and the import library

# `#define VK_VERSION_1_0 1`, `#define VK_KHR_surface 1`: every such line of vulkan_core.h opens the
# block of one core version or extension, which runs to the next one
_GUARD = re.compile(r"^#define\s+(VK_\w+)\s+1\s*$", re.MULTILINE)
_PROTOTYPE = re.compile(r"VKAPI_ATTR\s+[\w\s*]+?\bVKAPI_CALL\s+(vk\w+)\s*\(")


def vulkan_exports(vulkan_core: str, versions) -> list[str]:
    """The entry points vulkan_core.h (its text) declares in the blocks of the core VERSIONS, in header order."""
    guards = list(_GUARD.finditer(vulkan_core))
    wanted = set(versions)
    found: list[str] = []
    for index, guard in enumerate(guards):
        if guard.group(1) not in wanted:
            continue
        end = guards[index + 1].start() if index + 1 < len(guards) else len(vulkan_core)
        for name in _PROTOTYPE.findall(vulkan_core, guard.end(), end):
            if name not in found:
                found.append(name)
    missing = wanted - {g.group(1) for g in guards}
    if missing:
        raise BuildError(f"the Vulkan headers declare no {', '.join(sorted(missing))}",
                         "use Vulkan headers >= 1.3.272 (dfbuild doctor --backend vulkan --os windows)")
    return found


def def_text(dll: str, exports: list[str]) -> str:
    return "".join([f"LIBRARY {dll}\nEXPORTS\n", *(f"{name}\n" for name in exports)])


def _probe_path(doctor_entry: dict, name: str) -> Path | None:
    found = next((p for p in doctor_entry.get("toolchain", ()) if p.get("name") == name and p.get("found")), None)
    return Path(found["path"]) if found and found.get("path") else None


def _link(link: Path, target: Path) -> None:
    """LINK -> TARGET (a directory), replaced atomically when it points elsewhere."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(link.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


def vulkan_setup(host: Host, build_dir: Path, doctor_entry: dict) -> dict:
    """The Vulkan part of a Windows cross build, made in BUILD_DIR/dfbuild-vulkan; returns
    {"flags": CMake flags, "import": what the manifest says of the import library}.

    DOCTOR_ENTRY is doctor.require's answer for the build (the probes' paths: the Vulkan headers
    the user chose with --vulkan-include-dir or the system's, the SPIR-V headers, glslc).
    """
    spec = entry(host)["vulkan"]
    headers = _probe_path(doctor_entry, "vulkan-headers")
    spirv = _probe_path(doctor_entry, "spirv-headers")
    glslc = _probe_path(doctor_entry, "glslc")
    if headers is None or spirv is None or glslc is None:  # doctor.require checked them: a caller's bug
        raise BuildError("the Vulkan headers, SPIR-V headers or glslc were not found",
                         "dfbuild doctor --backend vulkan --os windows")
    work = Path(build_dir) / VULKAN_DIR
    include = work / "include"
    include.mkdir(parents=True, exist_ok=True)
    for sub in spec["include_dirs"]:
        _link(include / sub, (headers / sub).resolve())
    for sub in spec["spirv_dirs"]:
        _link(include / sub, (spirv / sub).resolve())
    config = next((spirv / rel for rel in spec.get("spirv_config_dirs", ())
                   if (spirv / rel / "SPIRV-HeadersConfig.cmake").is_file()), None)
    if config is None:
        raise ToolchainMissingError(f"the SPIR-V headers in {spirv} have no CMake package (SPIRV-HeadersConfig.cmake), "
                                    "which ggml-vulkan's CMake asks for", "apt-get install spirv-headers")
    core = (headers / "vulkan" / "vulkan_core.h").read_text(encoding="utf-8", errors="replace")
    exports = vulkan_exports(core, spec["export_versions"])
    definition = work / (Path(spec["import_dll"]).stem + ".def")
    library = work / spec["import_library"]
    write_if_changed(definition, def_text(spec["import_dll"], exports))
    if not library.is_file() or library.stat().st_mtime_ns < definition.stat().st_mtime_ns:
        tool = shutil.which(entry(host)["dlltool"])
        if tool is None:
            raise ToolchainMissingError(f"{entry(host)['dlltool']} (binutils for mingw-w64) is not installed",
                                        install_line(host))
        tmp = library.with_name(library.name + ".tmp")
        result = proc.run([tool, "-d", str(definition), "-D", spec["import_dll"], "-l", str(tmp)])
        if result.returncode != 0:
            raise BuildError(f"dlltool could not make {library.name}: {result.stderr.strip()[-300:]}",
                             install_line(host))
        os.replace(tmp, library)
    from dfbuild.host.probes import vulkan_header_version

    version = vulkan_header_version(headers / "vulkan" / "vulkan_core.h")
    return {"flags": {"Vulkan_INCLUDE_DIR": str(include), "Vulkan_LIBRARY": str(library),
                      "Vulkan_GLSLC_EXECUTABLE": str(glslc), "SPIRV-Headers_DIR": str(config.resolve())},
            "import": {"dll": spec["import_dll"], "exports": len(exports),
                       "versions": list(spec["export_versions"]), "headers": version}}


def backend_setup(host: Host, backend: str, build_dir: Path, doctor_entry: dict) -> dict:
    """What a backend's cross build adds to the flags ({} for the CPU)."""
    if backend == "vulkan":
        return vulkan_setup(host, build_dir, doctor_entry)
    return {}


# --- a display for Wine (Vulkan) ---------------------------------------------------------------

_display_lock = threading.Lock()
_display: dict = {}   # {"process": Popen, "name": ":N"}: the Xvfb this process started


def needs_display(host: Host, binary: Path) -> bool:
    """Whether BINARY's folder holds a backend that reaches the GPU through a Wine graphics driver."""
    names = entry(host).get("vulkan", {}).get("needs_display_when", ())
    return any((Path(binary).parent / name).is_file() for name in names)


def _stop_display() -> None:
    process = _display.pop("process", None)
    _display.pop("name", None)
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except proc.TimeoutExpired:
            process.kill()
            process.wait()


def start_display(host: Host) -> str:
    """An X display for Wine: the Xvfb this process started (started on the first call), as ":N"."""
    spec = entry(host)["vulkan"]
    with _display_lock:
        process = _display.get("process")
        if process is not None and process.poll() is None:
            return _display["name"]
        command = list(spec["display_server"])
        program = shutil.which(command[0])
        if program is None:
            raise ToolchainMissingError(f"{command[0]} is not installed: a Windows Vulkan program reaches this "
                                        "machine's Vulkan driver under Wine only through a display",
                                        "apt-get install xvfb (or run with $DISPLAY set to an X display)")
        read_fd, write_fd = os.pipe()
        # what it says on a failed start; never a pipe nobody reads (closed below, once the display is known)
        log = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            process = proc.start([program, *command[1:], "-displayfd", str(write_fd)], pass_fds=(write_fd,),
                                 stdin=proc.DEVNULL, stdout=proc.DEVNULL, stderr=log,
                                 die_with=(signal.SIGTERM if threading.current_thread() is threading.main_thread()
                                           else None))
        except OSError:
            os.close(read_fd)
            log.close()
            raise
        finally:
            os.close(write_fd)
        with log:
            number = _read_display_number(read_fd, process, float(spec.get("display_start_timeout_s", 30)), log)
        _display.update(process=process, name=f":{number}")
        atexit.register(_stop_display)
        return _display["name"]


def _read_display_number(read_fd: int, process: proc.Popen, timeout: float, log) -> str:
    """The display number Xvfb writes to its -displayfd once it accepts connections."""
    import select

    data = b""
    try:
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([read_fd], [], [], timeout)
            chunk = os.read(read_fd, 64) if ready else b""
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_fd)
    number = data.decode("ascii", errors="replace").strip()
    if not number.isdigit():
        if process.poll() is None:
            process.kill()
        process.wait()
        log.seek(0)
        said = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        raise ToolchainMissingError(f"Xvfb did not start: {said[-1] if said else 'it gave no display number'}",
                                    "run with $DISPLAY set to an X display")
    return number


def device_hint(host: Host, backend: str) -> str | None:
    """What a Windows build under Wine needs to see a device of BACKEND here (smoke's exit 45 says it)."""
    spec = entry(host).get(backend)
    return spec.get("no_device_hint") if isinstance(spec, dict) else None


def display_env(host: Host, binary: Path) -> dict[str, str]:
    """What a Vulkan .exe needs besides run_env: a display (the user's $DISPLAY, else dfbuild's Xvfb) and a
    Wine prefix whose desktop has one (the user's own WINEPREFIX wins). {} for any other program."""
    if not needs_display(host, binary):
        return {}
    e = entry(host)
    env = {"DISPLAY": os.environ.get("DISPLAY") or start_display(host)}
    var = e.get("prefix_env", "WINEPREFIX")
    if not os.environ.get(var):
        env[var] = str(paths.cache_dir() / e["vulkan"].get("display_prefix_dir", "wine-prefix-display"))
    return env
