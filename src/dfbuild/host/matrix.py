"""`dfbuild matrix`: the release matrix, generated from the backend table.

One entry per (os, backend, toolkit, arch) row of backends.toml's [[release]] table, with
its runner (and container), its build image and, on Linux, its glibc floor, the toolchain setup command, the CMake flags
`dfbuild build` will use there, and the artifact name `dfbuild release` gives
it. ci/release.yml reads this as JSON (fromJSON), so the workflow never holds a
second copy of the table.
"""

from __future__ import annotations

import re
from typing import cast

from dfbuild.core.errors import DfbuildError
from dfbuild.host import backends

TAG_PLACEHOLDER = "<tag>"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def archive_extension(os_name: str) -> str:
    """Windows users get .zip (Explorer opens it); everyone else .tar.gz."""
    return ".zip" if os_name == "windows" else ".tar.gz"


def _toolkit_label(toolkit: str | None) -> str:
    """'12.8' from '12.8.1' / (12, 8): llama.cpp names toolkits by major.minor."""
    if toolkit is None:
        return ""
    numbers = backends.version_tuple(toolkit if isinstance(toolkit, str) else ".".join(map(str, toolkit)))
    return ".".join(map(str, numbers[:2]))


def artifact_label(os: str, backend: str, toolkit: str | None = None) -> str:
    """The part between -bin- and -<arch>: ubuntu, ubuntu-vulkan, win-cuda-12.4, macos, ... (llama.cpp's names)."""
    spec = backends.get(backend)
    labels = backends.table()["common"]["artifact_os"]
    word = spec.raw.get("artifact_label", {}).get(os, spec.artifact_suffix)
    if "{toolkit}" in word:
        version = _toolkit_label(toolkit)
        if not version:
            raise DfbuildError(f"the {backend} artifact name needs the toolkit version",
                               "build with the toolkit installed (dfbuild doctor), or give the matrix entry a toolkit")
        word = word.replace("{toolkit}", version)
    return "-".join(part for part in (labels[os], word) if part)


def artifact_name(tag: str, os: str, backend: str, arch: str,
                  toolkit: str | None = None) -> str:
    """llama-<tag>-bin-<label>-<arch>.tar.gz (.zip on Windows): llama.cpp's own scheme, the dflash marker
    inside the tag (release.release_tag: b11434-dflash-e8448d4a).

    e.g. llama-b11434-dflash-e8448d4a-bin-ubuntu-x64.tar.gz, ...-bin-ubuntu-vulkan-x64.tar.gz,
    ...-bin-win-cuda-12.4-x64.zip, ...-bin-macos-arm64.tar.gz.
    """
    if tag != TAG_PLACEHOLDER and not _TAG.fullmatch(tag):
        raise DfbuildError(f"'{tag}' cannot be part of an artifact name", "use letters, digits, '.', '_', '+', '-'")
    if os not in backends.OSES:
        raise DfbuildError(f"unknown os '{os}'", f"use one of {', '.join(backends.OSES)}")
    if arch not in backends.ARCHES:
        raise DfbuildError(f"unknown arch '{arch}'", f"use one of {', '.join(backends.ARCHES)}")
    return f"llama-{tag}-bin-{artifact_label(os, backend, toolkit)}-{arch}{archive_extension(os)}"


def cudart_name(toolkit: str, arch: str = "x64", *, os: str = "windows", tag: str = TAG_PLACEHOLDER) -> str:
    """The CUDA runtime libraries beside a CUDA archive, as llama.cpp names them: on Windows
    cudart-llama-bin-win-cuda-12.4-x64.zip (no tag: the toolkit's DLLs, the same for every release),
    on Linux cudart-llama-<tag>-bin-ubuntu-cuda-12.8-x64.tar.gz (a tarball rooted at a folder of
    that name)."""
    if os == "windows":
        return f"cudart-llama-bin-win-cuda-{_toolkit_label(toolkit)}-{arch}.zip"
    return f"cudart-llama-{tag}-bin-{artifact_label(os, 'cuda', toolkit)}-{arch}{archive_extension(os)}"


def entry_id(os: str, backend: str, arch: str, toolkit: str | None = None) -> str:
    return "-".join(p for p in (os, backend, _toolkit_label(toolkit), arch) if p)


GLIBC_CEILING = (2, 35)   # the newest glibc a Linux entry may build on: Ubuntu 22.04 (Debian 12 has 2.36)
_UBUNTU_RELEASE = re.compile(r"ubuntu-?(\d{2}\.\d{2})")


def image_glibc(image: str) -> str | None:
    """The glibc of a build image (ubuntu-22.04, nvidia/cuda:12.8.1-devel-ubuntu22.04, ...), from [linux_glibc]."""
    match = _UBUNTU_RELEASE.search(image or "")
    return backends.table().get("linux_glibc", {}).get(f"ubuntu-{match.group(1)}") if match else None


def _linux_floor(ident: str, row: dict) -> tuple[str, str]:
    """A Linux entry's build image and glibc floor, checked: the declared glibc is the image's, at most 2.35."""
    image = row.get("container") or row.get("image") or ""
    declared = str(row.get("glibc") or "")
    known = image_glibc(image)
    fix = "fix the [[release]] table in backends.toml"
    if not image or not declared:
        raise DfbuildError(f"release entry {ident} needs its build image (container or image) and its glibc", fix)
    if known is None:
        raise DfbuildError(f"release entry {ident}: the glibc of image {image} is not in [linux_glibc]", fix)
    if known != declared:
        raise DfbuildError(f"release entry {ident} says glibc {declared}, but its image {image} has {known}", fix)
    if backends.version_tuple(declared) > GLIBC_CEILING:
        raise DfbuildError(f"release entry {ident} builds on glibc {declared}: its binaries would not start on "
                           f"Ubuntu 22.04 or Debian 12", "build it on an image with glibc 2.35 or older")
    return image, declared


# What was verified where, per entry (the [[release]] table's `verified`, docs/matrix.md)
VERIFIED_MARKS = ("built and run here", "built here", "runner only")
CPU_FALLBACK_ARG = "--allow-cpu-fallback"


def _verified(ident: str, row: dict) -> tuple[str, str]:
    """An entry's mark and its note, checked: a known mark, and a note (how, or why not) with it."""
    mark, note = row.get("verified"), str(row.get("verified_note") or "")
    fix = "fix the [[release]] table in backends.toml"
    if mark not in VERIFIED_MARKS:
        raise DfbuildError(f"release entry {ident}: verified is {mark!r}, not one of: {', '.join(VERIFIED_MARKS)}",
                           fix)
    if not note:
        raise DfbuildError(f"release entry {ident} says {mark!r} without verified_note (how, or why not)", fix)
    return mark, note


def release_matrix(tag: str = TAG_PLACEHOLDER) -> list[dict]:
    """Every release entry, in table order, checked against the backend table."""
    entries = []
    seen = set()
    for row in backends.release_entries():
        os_name, backend, arch = row["os"], row["backend"], row["arch"]
        toolkit = row.get("toolkit")
        spec = backends.get(backend)
        if not spec.builds_on(os_name):
            raise DfbuildError(f"release entry {os_name}/{backend}/{arch}: {spec.why_not_on(os_name)}",
                               "fix the [[release]] table in backends.toml")
        ident = entry_id(os_name, backend, arch, toolkit) + (f"-{row['variant']}" if row.get("variant") else "")
        if ident in seen:
            raise DfbuildError(f"release entry {ident} is listed twice", "fix the [[release]] table in backends.toml")
        seen.add(ident)
        image, glibc = _linux_floor(ident, row) if os_name == "linux" else (row.get("image", row["runner"]), "")
        verified, verified_note = _verified(ident, row)
        smoke_on_cpu = str(row.get("smoke_on_cpu") or "")
        if smoke_on_cpu and not spec.smoke_device:
            raise DfbuildError(f"release entry {ident}: smoke_on_cpu, but the {backend} backend's smoke always runs on "
                               "the CPU", "fix the [[release]] table in backends.toml")
        nvcc = backends.version_tuple(toolkit) if (toolkit and backend == "cuda") else None
        # every CUDA row of backends.toml [[release]] names its toolkit (tests/test_matrix.py reads them all)
        extra = [cudart_name(cast(str, toolkit), arch, os=os_name, tag=tag)] if backend == "cuda" else []
        flags = backends.cmake_flags(backend, os_name, nvcc_version=nvcc, arch=arch)
        build_os = row.get("build_os", "")
        if build_os and build_os != os_name:  # a cross build (--os): the target's flags on top (targets.toml)
            from dfbuild.host import platforms

            cross = platforms.table()["targets"][os_name].get("cross", {}).get(build_os)
            if cross is None:
                raise DfbuildError(f"release entry {ident}: no cross toolchain for {os_name} on {build_os}",
                                   "fix the [[release]] table in backends.toml (or targets.toml)")
            flags.update(cross.get("flags", {}))
        entries.append({
            "id": ident,
            "os": os_name,
            "arch": arch,
            "backend": backend,
            "toolkit": toolkit or "",
            "runner": row["runner"],
            "container": row.get("container", ""),
            "image": image,    # where the binaries are linked
            "glibc": glibc,    # Linux: the oldest glibc they start on (the image's)
            "setup": row.get("setup", ""),
            "build_os": build_os,                        # set: a cross build, `dfbuild ... --os <os>` there
            "os_args": f"--os {os_name}" if build_os and build_os != os_name else "",
            "publish": bool(row.get("publish", True)),   # false: a check of another path, never released
            "flags": flags,
            "artifact": artifact_name(tag, os_name, backend, arch, toolkit),
            "extra_artifacts": extra,
            "verified": verified,              # built and run here | built here | runner only
            "verified_note": verified_note,    # how, or why not
            # a runner with no GPU of the backend: the smoke runs on the CPU backend, recorded as such
            "smoke_args": CPU_FALLBACK_ARG if smoke_on_cpu else "",
            "smoke_on_cpu": smoke_on_cpu,
        })
    return entries


def github_matrix(tag: str = TAG_PLACEHOLDER) -> dict:
    """The matrix as GitHub Actions takes it: strategy.matrix: ${{ fromJSON(...) }}."""
    return {"include": release_matrix(tag)}


def build_identifiers() -> list[str]:
    return [entry["id"] for entry in release_matrix()]
