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

import functools
from dataclasses import replace

from .. import backends
from ..backends import Host
from ..errors import UnsupportedBackendError

@functools.lru_cache(maxsize=None)
def table() -> dict:
    """The parsed targets.toml (cached; treat it as read-only)."""
    return backends.data_table("targets.toml")


def names() -> list[str]:
    return list(table()["targets"])


def target_host(os_name: str | None, host: Host | None = None) -> Host:
    """The Host a build for OS_NAME is made for, on HOST (default: this machine).

    None or HOST's own OS: HOST itself. Another OS: a cross Host when targets.toml
    has `cross.<host os>` for it, else UnsupportedBackendError (exit 33) saying why.
    """
    host = host or backends.current_host()
    if os_name is None or os_name == host.os:
        return host
    entry = table()["targets"].get(os_name)
    if entry is None:
        raise UnsupportedBackendError(f"unknown target os '{os_name}'", f"choose one of: {', '.join(names())}")
    cross_entry = entry.get("cross", {}).get(host.os)
    if cross_entry is None:
        why = entry.get("refused", {}).get(host.os, f"dfbuild cannot build for {os_name} on {host.os}")
        raise UnsupportedBackendError(f"--os {os_name} on this {host.os} host: {why}",
                                      f"drop --os (the default builds for {host.os}), or build on a {os_name} machine")
    arch = cross_entry.get("arch", host.arch)
    return replace(host, os=os_name, arch=arch, build_os=host.os)


def cross(host: Host):
    """The platform module that builds HOST's binaries on another OS, or None for a native build."""
    if not host.build_os or host.build_os == host.os:
        return None
    if host.os == "windows":
        from . import windows

        return windows
    raise UnsupportedBackendError(f"no cross toolchain for {host.os} on {host.build_os}",  # pragma: no cover
                                  "drop --os")


def cross_entry(host: Host) -> dict:
    """targets.toml's [targets.<os>.cross.<build os>] for a cross HOST."""
    return table()["targets"][host.os]["cross"][host.build_os]
