"""`dfbuild matrix`: the release matrix, generated from the backend table.

One entry per (os, backend, arch) row of backends.toml's [[release]] table, with
its runner (and container), the toolchain setup command, the CMake flags
`dfbuild build` will use there, and the artifact name `dfbuild release` gives
it. ci/release.yml reads this as JSON (fromJSON), so the workflow never holds a
second copy of the table.
"""

from __future__ import annotations

import re

from . import backends
from .errors import DfbuildError

TAG_PLACEHOLDER = "<tag>"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def archive_extension(os_name: str) -> str:
    """Windows users get .zip (Explorer opens it); everyone else .tar.gz."""
    return ".zip" if os_name == "windows" else ".tar.gz"


def artifact_name(tag: str, os: str, backend: str, arch: str) -> str:  # noqa: A002 - mirrors the name's fields
    """llama-<tag>-dflash-bin-<os>-<backend>-<arch>.tar.gz (.zip on Windows): the one naming rule."""
    if tag != TAG_PLACEHOLDER and not _TAG.fullmatch(tag):
        raise DfbuildError(f"'{tag}' cannot be part of an artifact name", "use letters, digits, '.', '_', '+', '-'")
    if os not in backends.OSES:
        raise DfbuildError(f"unknown os '{os}'", f"use one of {', '.join(backends.OSES)}")
    if arch not in backends.ARCHES:
        raise DfbuildError(f"unknown arch '{arch}'", f"use one of {', '.join(backends.ARCHES)}")
    suffix = backends.get(backend).artifact_suffix
    return f"llama-{tag}-dflash-bin-{os}-{suffix}-{arch}{archive_extension(os)}"


def entry_id(os: str, backend: str, arch: str) -> str:  # noqa: A002
    return f"{os}-{backend}-{arch}"


def release_matrix(tag: str = TAG_PLACEHOLDER) -> list[dict]:
    """Every release entry, in table order, checked against the backend table."""
    entries = []
    seen = set()
    for row in backends.release_entries():
        os_name, backend, arch = row["os"], row["backend"], row["arch"]
        spec = backends.get(backend)
        if not spec.builds_on(os_name):
            raise DfbuildError(f"release entry {os_name}/{backend}/{arch}: {spec.why_not_on(os_name)}",
                               "fix the [[release]] table in backends.toml")
        ident = entry_id(os_name, backend, arch)
        if ident in seen:
            raise DfbuildError(f"release entry {ident} is listed twice", "fix the [[release]] table in backends.toml")
        seen.add(ident)
        entries.append({
            "id": ident,
            "os": os_name,
            "arch": arch,
            "backend": backend,
            "runner": row["runner"],
            "container": row.get("container", ""),
            "setup": row.get("setup", ""),
            "flags": backends.cmake_flags(backend, os_name),
            "artifact": artifact_name(tag, os_name, backend, arch),
        })
    return entries


def github_matrix(tag: str = TAG_PLACEHOLDER) -> dict:
    """The matrix as GitHub Actions takes it: strategy.matrix: ${{ fromJSON(...) }}."""
    return {"include": release_matrix(tag)}


def build_identifiers() -> list[str]:
    return [entry["id"] for entry in release_matrix()]
