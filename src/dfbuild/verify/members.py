"""verify's checks of what an archive holds, member by member: modes and special bits, links that stay
inside the archive, the folder every member lies in (llama.cpp's layout, or dfbuild's older one), every
PE file's machine, imports and build paths, and the fields of its manifest that verify reads; and where
its smoke ran, in words.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Collection
from pathlib import PurePosixPath

from dfbuild.core.archive import (
    Member,
    archive_root,
    unsafe_member,
)
from dfbuild.verify.wheel import manylinux_glibc, wheel_platform  # noqa: F401 - verify's API before the split

# what dfbuild writes into an archive: files and folders owned by root (uid 0, no names), no special bits
_SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


def member_problem(member: Member, root: str | None) -> str | None:
    """Why an archive member (already read by the strict reader) is not what dfbuild ships, or None: outside
    ROOT/ (None: a flat zip, no folder), a link out of its folder, setuid, setgid or sticky, or owned by anyone
    but root (GNU tar run as root gives a file to the owner its header names)."""
    if root is not None and member.name != root and not member.name.startswith(root + "/"):
        return f"member {member.name!r} is outside the root directory {root}/"
    if member.kind == "link" and member.link is not None and (unsafe_member(member.link) or "/" in member.link):
        return f"{member.name} links outside its directory ({member.link})"
    if member.mode is not None and member.mode & _SPECIAL_BITS:
        return (f"{member.name} has mode {member.mode:04o}: setuid, setgid or sticky, which dfbuild never "
                "ships (GNU tar run as root keeps it; pip drops it)")
    if member.owner is not None and (member.owner[:2] != (0, 0) or member.owner[2] not in ("", "root")
                                     or member.owner[3] not in ("", "root")):
        return (f"{member.name} is owned by {member.owner[2] or member.owner[0]}:{member.owner[3] or member.owner[1]}, "
                "not root (GNU tar run as root would give it to that user)")
    return None


def _link_target_record(name: str, expected: dict[str, dict]) -> dict | None:
    """The manifest's record of the file a link record NAME ends at (following links), or None."""
    record, where, hops = expected.get(name), name, 0
    while record is not None and "link" in record and hops <= len(expected):
        where = str(PurePosixPath(where).parent / record["link"]).removeprefix("./")
        record, hops = expected.get(where), hops + 1
    return record if record is not None and "link" not in record else None


def _link_problem(name: str, member: Member, by_name: dict[str, Member]) -> str | None:
    """Why the link NAME cannot be vetted: it loops, dangles, or ends at a directory (None for a non-link)."""
    if member.kind != "link":
        return None
    hops, seen = 0, {name}
    current: Member | None = member
    where = name
    while current is not None and current.kind == "link":
        where = str(PurePosixPath(where).parent / (current.link or "")).removeprefix("./")
        if where in seen:
            return f"is a symlink loop (it comes back to {where})"
        seen.add(where)
        current = by_name.get(where)
        hops += 1
        if current is None:
            return f"links to {where}, which the archive does not hold"
        if hops > len(by_name):
            return "is a symlink loop"
    if current is None or current.kind != "file":  # (None: returned above)
        return f"links to {where}, which is not a file"
    return None


def _str_or_none(value) -> bool:
    return value is None or isinstance(value, str)


def manifest_field_problem(embedded: dict) -> str | None:
    """The first field of an archive's manifest that is not what dfbuild writes (a crafted or damaged
    manifest), named, or None. Every field verify reads is checked here, so no check meets a wrong type."""
    rel: dict = embedded["release"]  # its shape is checked before (verify._check_archive)
    for key in ("os", "arch", "wheel_dist", "wheel_version", "tag", "backend", "layout", "root"):
        if not _str_or_none(rel.get(key)):
            return f"release.{key} is {type(rel.get(key)).__name__}, not text"
    for number, entry in enumerate(rel["files"]):
        for key in ("sha256", "link", "mode"):
            if not _str_or_none(entry.get(key)):
                return f"release.files[{number}].{key} ({entry['path']}) is {type(entry.get(key)).__name__}, not text"
    bundled = rel.get("wheel_bundled")
    if bundled is not None and not (isinstance(bundled, list) and all(
            isinstance(b, dict) and isinstance(b.get("name"), str) and isinstance(b.get("sha256"), str)
            for b in bundled)):
        return "release.wheel_bundled is not a list of {name, sha256}"
    for section in ("build", "series", "source", "smoke"):
        if embedded.get(section) is not None and not isinstance(embedded.get(section), dict):
            return f"{section} is {type(embedded.get(section)).__name__}, not a section (an object)"
    build_ = embedded.get("build") or {}
    binaries = build_.get("binaries")
    if binaries is not None and not (isinstance(binaries, list) and all(isinstance(b, str) for b in binaries)):
        return f"build.binaries is {type(binaries).__name__}, not a list of names"
    for section, key in (("build", "source_commit"), ("series", "head"), ("smoke", "ran_on"), ("smoke", "device")):
        if not _str_or_none((embedded.get(section) or {}).get(key)):
            return f"{section}.{key} is not text"
    if not isinstance((embedded.get("smoke") or {}).get("cpu_fallback", False), bool):
        return "smoke.cpu_fallback is not true or false"
    return None


GPU_BACKENDS = ("cuda", "vulkan", "hip")


def smoke_statement(embedded: dict) -> str:
    """Where an archive's smoke ran, in words, from its manifest (what verify and the release notes say)."""
    section = embedded.get("smoke") or {}
    backend = (embedded.get("release") or {}).get("backend")
    if section.get("skipped"):
        return "smoke skipped (--skip-smoke): not smoke-tested"
    if section.get("ran_on"):
        verdict = "passed" if section.get("passed") else "ran"
        if section.get("cpu_fallback"):
            return f"smoke {verdict} on the CPU backend, not on a {backend} device ({section['ran_on']})"
        return f"smoke {verdict} on {section['ran_on']}"
    if backend in GPU_BACKENDS:
        return "smoke: where it ran is not recorded (packaged before dfbuild recorded the device)"
    return "smoke passed on the CPU backend" if section.get("passed") else "smoke: no result recorded"


def _driver_dll(packed: dict) -> str | None:
    from dfbuild.host import pe

    return pe.backend_driver_dll(packed.get("backend")) if packed.get("os") == "windows" else None


def _pe_problems(label: str, actual: dict[str, Member], arch: str | None, problems: list[str],
                 third_party: Collection[str] = (), *, backend: str | None = None,
                 driver_users: list[str] | None = None) -> int:
    """Every PE file of an archive: the archive's machine, every imported DLL inside the archive or a
    Windows system DLL, no absolute build path. Returns how many PE files there were.

    THIRD_PARTY: the toolchain's runtime DLLs (the manifest's release.runtime_dlls), shipped as their
    distribution built them: Debian's libgomp names Debian's /build/... tree, which is no path of ours.

    A GPU driver's DLL (vulkan-1.dll, nvcuda.dll) never ships: a copy beside the .exe would be loaded
    instead of the driver's own. BACKEND's driver DLL (targets.toml backend_driver_dlls: vulkan-1.dll
    for a Vulkan build) must be imported by some PE file: else the build never talks to the GPU.
    The files that import it go into DRIVER_USERS.
    """
    from dfbuild.host import pe

    files = {n: m.data for n, m in actual.items() if m.kind == "file" and m.data}
    shipped = {PurePosixPath(n).name for n in files}
    _, _, drivers = pe.system_dlls()
    for name_ in sorted(files):
        if PurePosixPath(name_).name.lower() in drivers:
            problems.append(f"{label}: {name_} is the GPU driver's own DLL, which an archive must not ship "
                            "(Windows would load this copy instead of the installed driver's)")
    wanted = pe.backend_driver_dll(backend)
    users: list[str] = []
    count = 0
    for name_, data in sorted(files.items()):
        if not pe.is_pe(data):
            continue
        count += 1
        try:
            info = pe.read(data)
        except Exception as exc:
            problems.append(f"{label}: {name_} cannot be read as PE ({exc})")
            continue
        if arch and info.machine != arch:
            problems.append(f"{label}: {name_} is a {info.machine} PE file, not {arch}")
        missing = pe.unresolved_imports(info, shipped)
        if missing:
            problems.append(f"{label}: {name_} imports {', '.join(missing)}, which is neither in the archive nor "
                            "a Windows system DLL (Windows would refuse to start it)")
        if wanted and wanted.lower() in {d.lower() for d in [*info.imports, *info.delay_imports]}:
            users.append(PurePosixPath(name_).name)
        paths_found = pe.absolute_paths(data) if name_ not in third_party else []
        if paths_found:
            problems.append(f"{label}: {name_} names an absolute build path: {', '.join(paths_found)}")
    if wanted and count and not users:
        problems.append(f"{label}: no file imports {wanted}: this {backend} build would never reach the GPU "
                        f"driver (is ggml-{backend}.dll missing?)")
    if driver_users is not None:
        driver_users.extend(users)
    return count


_NO_ROOT = object()  # layout_root: the members are under no folder this archive may have


def allowed_roots(name: str) -> list[str]:
    """The folders an archive called NAME may be rooted at: llama-<tag> (llama.cpp's layout, issue 36),
    or its own name without the suffix (dfbuild's layout before: one folder holding bin/)."""
    roots = []
    match = re.match(r"^(llama-.+?)-bin-", name)
    if match:
        roots.append(match.group(1))
    roots.append(archive_root(name))
    return roots


def layout_root(name: str, member_names: list[str]):
    """The folder every member of the archive NAME is in (allowed_roots), None for a flat zip (no folder
    at all), or _NO_ROOT when they are in neither."""
    for root in allowed_roots(name):
        if member_names and all(n.rstrip("/") == root or n.startswith(root + "/") for n in member_names):
            return root
    tops = {n.split("/", 1)[0] for n in member_names}
    if name.endswith(".zip") and not any(t in allowed_roots(name) for t in tops):
        return None
    return _NO_ROOT


def layout_problem(name: str, root: str | None, packed: dict) -> str | None:
    """Whether the archive is laid out as its manifest says: "top" under llama-<tag>/, "flat" without a
    folder, or (no layout: packed before issue 36) under a folder named like the archive."""
    layout = packed.get("layout")
    expected: str | None
    if layout is None:
        expected = archive_root(name)
    elif layout == "top":
        expected = packed.get("root")
        if expected not in allowed_roots(name)[:-1] or expected != f"llama-{packed.get('tag')}":
            return f"its manifest names the folder {expected!r}, not llama-<its tag>/ of the archive's name"
    elif layout == "flat":
        expected = None
        if not name.endswith(".zip"):
            return "its manifest says it is a flat zip, but it is a tarball"
    else:
        return f"its manifest names an unknown layout {layout!r}"
    if root != expected:
        found = f"in {root}/" if root else "flat (no folder)"
        wanted = f"in {expected}/" if expected else "flat (no folder)"
        return f"its members are {found}, but its manifest says {wanted}"
    return None
