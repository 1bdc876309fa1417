"""targets.toml's facts, and what every platform module shares: the cross entry, a compiler's facts,
a file written only when it changes. The platform modules import this, never the package itself."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from dfbuild.core import proc
from dfbuild.host import backends
from dfbuild.host.backends import Host


@functools.cache
def table() -> dict:
    """The parsed targets.toml (cached; treat it as read-only)."""
    return backends.data_table("targets.toml")


def cross_entry(host: Host) -> dict:
    """targets.toml's [targets.<os>.cross.<build os>] for a cross HOST (another OS), or
    [targets.<os>.arch.<arch>.cross.<build os>] for another arch of the same OS."""
    target = table()["targets"][host.os]
    if host.build_os == host.os:
        return target["arch"][host.arch]["cross"][host.build_os]
    return target["cross"][host.build_os]


@functools.cache  # asked by configure and by the manifest: run once per compiler
def compiler_facts(compiler: str, header: str, macros: tuple[str, ...]) -> tuple[str | None, dict[str, str]]:
    """A cross compiler's version, and the values of MACROS once HEADER is included (the C library's
    or the runtime's version, which the compiler's own version does not say)."""
    version = proc.run([compiler, "-dumpfullversion"]).stdout.strip()
    defined = proc.run([compiler, "-E", "-dM", "-x", "c", "-"], input=f"#include <{header}>\n").stdout
    found = {}
    for line in defined.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in macros:
            found[parts[1]] = parts[2]
    return version or None, found


def write_if_changed(path: Path, text: str) -> None:
    """Same bytes: keep the file (and its time: ninja rebuilds nothing). Atomic otherwise."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)
