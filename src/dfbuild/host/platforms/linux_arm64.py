"""Linux arm64 (AArch64) binaries built on Linux x64 (Debian's aarch64 cross GCC) and run here under qemu-user.

What targets.toml's [targets.linux.arch.arm64.cross.linux] says, turned into files and
arguments (docs/arm64.md):

- a CMake toolchain file dfbuild writes into the build dir: CMAKE_SYSTEM_NAME=Linux,
  CMAKE_SYSTEM_PROCESSOR=aarch64 (ggml then builds its arm64 CPU variants), the cross
  compilers, and the cross glibc's root as the only place CMake looks for target libraries;
- TLS as the x64 build has it: the system's OpenSSL 3, linked dynamically, here Debian's
  multiarch libssl-dev:arm64, named to CMake by path (it lives outside the cross root);
- the CPU variants: ggml's Linux arm64 list (backends.toml), less those whose -march the
  cross compiler does not know (build.py test-compiles each: GCC 12 has no armv9.2-a);
- how to run an arm64 program here: qemu-aarch64 with the cross glibc's root (-L).

The binaries need nothing from the toolchain beyond glibc, libstdc++, libgcc_s and
libgomp, which every arm64 Linux has: nothing is staged beside them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dfbuild.core.errors import ToolchainMissingError
from dfbuild.host.backends import Host
from dfbuild.host.platforms.targets import compiler_facts, cross_entry, write_if_changed

TOOLCHAIN_NAME = "dfbuild-toolchain-linux-arm64.cmake"


def entry(host: Host) -> dict:
    return cross_entry(host)


def install_line(host: Host) -> str:
    install = entry(host).get("install", {})
    for key in host.install_keys():
        if key in install:
            return install[key]
    return install.get("linux", "install the aarch64-linux-gnu cross compilers and qemu-user")


def _compiler(host: Host, which: str = "c_compiler") -> str:
    name = entry(host)[which]
    found = shutil.which(name)
    if found is None:
        raise ToolchainMissingError(f"the arm64 cross compiler {name} is not installed", install_line(host))
    return found


# --- the toolchain file ---------------------------------------------------------------------


def toolchain_text(host: Host) -> str:
    e = entry(host)
    return "\n".join([
        "# written by dfbuild: Linux arm64 from Linux x64 with Debian's aarch64 cross GCC (targets.toml)",
        f"set(CMAKE_SYSTEM_NAME {e['system_name']})",
        f"set(CMAKE_SYSTEM_PROCESSOR {e['system_processor']})",
        f"set(CMAKE_C_COMPILER {e['c_compiler']})",
        f"set(CMAKE_CXX_COMPILER {e['cxx_compiler']})",
        f"set(CMAKE_LIBRARY_ARCHITECTURE {e['triplet']})",
        "# target libraries and headers only from the cross glibc's root; programs from the build machine",
        f"set(CMAKE_FIND_ROOT_PATH {e['find_root']})",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)",
        "",
    ])


def tls_args(host: Host) -> list[str]:
    """How llama.cpp's FindOpenSSL finds the arm64 OpenSSL (multiarch, outside the cross root): by path.

    ToolchainMissingError (with the apt line) when libssl-dev:arm64 is not installed: the x64
    build has TLS, so the arm64 one must too.
    """
    e = entry(host)
    libdir, include = Path(e["tls_libdir"]), Path(e["tls_include"])
    ssl, crypto = libdir / "libssl.so", libdir / "libcrypto.so"
    if not ssl.exists() or not crypto.exists() or not (include / "openssl" / "opensslv.h").is_file():
        raise ToolchainMissingError(f"the arm64 OpenSSL ({ssl}) is not installed, so llama-server could not "
                                    "download models with -hf", install_line(host))
    # -U first: a cached search result from an earlier configure is dropped
    return ["-UOPENSSL_*", f"-DOPENSSL_INCLUDE_DIR={include}", f"-DOPENSSL_SSL_LIBRARY={ssl}",
            f"-DOPENSSL_CRYPTO_LIBRARY={crypto}"]


def configure(host: Host, build_dir: Path) -> dict:
    """Write the toolchain file into BUILD_DIR; the CMake arguments, C flags and target flags it implies."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    _compiler(host), _compiler(host, "cxx_compiler")  # missing: the toolchain-missing code and the apt line
    toolchain = build_dir / TOOLCHAIN_NAME
    write_if_changed(toolchain, toolchain_text(host))
    return {"cmake_args": [f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", *tls_args(host)], "c_flags": [], "compat": [],
            "flags": dict(entry(host).get("flags", {})),
            "tls": f"OpenSSL (the system's libssl, arm64: {entry(host)['tls_libdir']})"}



# --- versions -------------------------------------------------------------------------------


def toolchain_versions(host: Host) -> dict[str, str | None]:
    """For the manifest: the cross compiler's version and the target glibc it links against."""
    return dict(_compiler_versions(_compiler(host)))


def _compiler_versions(compiler: str) -> tuple[tuple[str, str | None], ...]:
    names = ("__GLIBC__", "__GLIBC_MINOR__")
    version, found = compiler_facts(compiler, "features.h", names)
    glibc = ".".join(found[k] for k in names) if len(found) == 2 else None
    return (("aarch64-gcc", version), ("arm64-glibc-headers", glibc))


# --- what a release ships beside the binaries: nothing ----------------------------------------


def stage_runtime(host: Host, build_dir: Path) -> list[str]:
    return []


def license_files(host: Host) -> dict[str, Path]:
    return {}


# --- running arm64 programs here --------------------------------------------------------------


def launcher(host: Host) -> list[str]:
    """The command prefix that runs an arm64 program here: [qemu-aarch64, -L, the cross root, -cpu, max]."""
    runner = entry(host).get("runner", ["qemu-aarch64"])
    program = shutil.which(runner[0]) or shutil.which(runner[0] + "-static")
    if program is None:
        raise ToolchainMissingError(f"{runner[0]} is not installed, so arm64 programs cannot run here",
                                    install_line(host))
    return [program, *runner[1:]]


def run_env(host: Host) -> dict[str, str]:
    return {}


def start_timeout(host: Host) -> float | None:
    value = entry(host).get("start_timeout_s")
    return float(value) if value else None
