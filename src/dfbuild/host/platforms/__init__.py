"""Target operating systems (`--os`): one module per platform, as cibuildwheel keeps them.

The facts live in data/targets.toml, beside the backend table; this package
reads them. `target_host(os)` turns `--os` into the Host a build is made for:
the host itself (a native build, the default), a cross target this host has a
toolchain for (Windows x64 on Linux, through mingw-w64 and Wine), or a refusal
that says why (macOS on Linux: exit 33).

A cross target's Host has `build_os` set to the OS that runs the build; every
stage keeps using `host.os` for what the binaries are (names, suffixes, CMake
flags), and asks `cross(host)` how to build and run them here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from dfbuild.core.errors import UnsupportedBackendError
from dfbuild.host import backends
from dfbuild.host.backends import Host

# the shared facts and helpers live in targets.py (the platform modules import them from there);
# the package keeps offering them as before
from dfbuild.host.platforms.targets import compiler_facts, cross_entry, table, write_if_changed  # noqa: F401


def names() -> list[str]:
    return list(table()["targets"])


def target_host(os_name: str | None, host: Host | None = None, *, arch: str | None = None) -> Host:
    """The Host a build for OS_NAME (and ARCH) is made for, on HOST (default: this machine).

    None or HOST's own OS and arch: HOST itself. Another OS: a cross Host when targets.toml
    has `cross.<host os>` for it. Another arch of HOST's OS: a cross Host when targets.toml has
    `arch.<arch>.cross.<host os>` (Linux arm64 on Linux x64). Anything else:
    UnsupportedBackendError (exit 33) saying why; an unknown arch is refused the same way,
    before any work.
    """
    host = host or backends.current_host()
    if arch is not None and arch not in backends.ARCHES:
        raise UnsupportedBackendError(f"unknown target arch '{arch}'", f"choose one of: {', '.join(backends.ARCHES)}")
    if os_name is None:
        os_name = host.os
    if os_name == host.os and (arch is None or arch == host.arch):
        return host
    entry = table()["targets"].get(os_name)
    if entry is None:
        raise UnsupportedBackendError(f"unknown target os '{os_name}'", f"choose one of: {', '.join(names())}")
    if os_name == host.os:  # another arch of this OS
        arch_cross = entry.get("arch", {}).get(arch, {}).get("cross", {}).get(host.os)
        if arch_cross is None or arch_cross.get("build_arch", host.arch) != host.arch:
            raise UnsupportedBackendError(
                f"--arch {arch} on this {host.os} {host.arch} host: dfbuild has no cross toolchain for "
                f"{os_name} {arch} here", f"drop --arch (the default builds for {host.arch}), or build on an "
                f"{arch} machine or runner (dfbuild matrix)")
        # another arch of this OS: ARCH was given (HOST's own arch returned HOST above)
        return replace(host, arch=cast(str, arch), build_os=host.os, build_arch=host.arch)
    cross_spec = entry.get("cross", {}).get(host.os)
    if cross_spec is None:
        why = entry.get("refused", {}).get(host.os, f"dfbuild cannot build for {os_name} on {host.os}")
        raise UnsupportedBackendError(f"--os {os_name} on this {host.os} host: {why}",
                                      f"drop --os (the default builds for {host.os}), or build on a {os_name} machine")
    target_arch = cross_spec.get("arch", host.arch)
    if arch is not None and arch != target_arch:
        raise UnsupportedBackendError(f"--os {os_name} --arch {arch}: dfbuild cross-builds {os_name} for "
                                      f"{target_arch} only here", f"drop --arch, or build on a {os_name} {arch} runner")
    return replace(host, os=os_name, arch=target_arch, build_os=host.os)


def cross(host: Host):
    """The platform module that builds HOST's binaries on another OS or arch, or None for a native build."""
    if not host.cross:
        return None
    if host.os == "windows":
        from dfbuild.host.platforms import windows

        return windows
    if host.os == "linux" and host.build_os == "linux" and host.arch == "arm64":
        from dfbuild.host.platforms import linux_arm64

        return linux_arm64
    raise UnsupportedBackendError(  # pragma: no cover
        f"no cross toolchain for {host.os} {host.arch} on {host.build_os}", "drop --os / --arch")


def by_elf_machine(machine: str, host: Host | None = None) -> Host | None:
    """The cross Host whose binaries are ELF files for MACHINE (e.g. AArch64) on this Linux HOST, or None."""
    host = host or backends.current_host()
    for arch, entry in table()["targets"].get(host.os, {}).get("arch", {}).items():
        cross_ = entry.get("cross", {}).get(host.os)
        if cross_ and cross_.get("elf_machine") == machine and cross_.get("build_arch", host.arch) == host.arch:
            return replace(host, arch=arch, build_os=host.os, build_arch=host.arch)
    return None
