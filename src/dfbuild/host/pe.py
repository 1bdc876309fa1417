"""Just enough PE (Windows .exe/.dll) for packaging, beside elf.py: machine type, imported DLLs, paths.

Read with pefile (PyPI), not by hand. A Windows zip passes when every PE file in
it is for the zip's machine, every DLL it imports is either inside the zip or a
DLL every Windows system has (targets.toml [windows_system_dlls]), and no file
names an absolute path of the build machine.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

MZ_MAGIC = b"MZ"

# IMAGE_FILE_MACHINE_*: dfbuild's arch names
MACHINES = {0x8664: "x64", 0xAA64: "arm64", 0x014C: "x86"}


def is_pe(data: bytes) -> bool:
    """An MZ header whose e_lfanew points at a 'PE\\0\\0' signature."""
    if len(data) < 64 or data[:2] != MZ_MAGIC:
        return False
    offset = int.from_bytes(data[0x3C:0x40], "little")
    return 0 < offset <= len(data) - 4 and data[offset:offset + 4] == b"PE\0\0"


@dataclass
class PeInfo:
    machine: str                               # x64, arm64, x86, or 0x.... when unknown
    dll: bool
    imports: list[str] = field(default_factory=list)   # DLL names as the file spells them
    delay_imports: list[str] = field(default_factory=list)


def read(data: bytes) -> PeInfo:
    """Machine, whether it is a DLL, and the DLLs it imports (normal and delay-loaded)."""
    import pefile

    pe = pefile.PE(data=data, fast_load=True)
    try:
        pe.parse_data_directories(directories=[pefile.DIRECTORY_ENTRY["IMAGE_DIRECTORY_ENTRY_IMPORT"],
                                               pefile.DIRECTORY_ENTRY["IMAGE_DIRECTORY_ENTRY_DELAY_IMPORT"]])
        machine = pe.FILE_HEADER.Machine
        info = PeInfo(machine=MACHINES.get(machine, f"0x{machine:04x}"),
                      dll=bool(pe.FILE_HEADER.Characteristics & 0x2000))
        for attr, target in (("DIRECTORY_ENTRY_IMPORT", info.imports),
                             ("DIRECTORY_ENTRY_DELAY_IMPORT", info.delay_imports)):
            for item in getattr(pe, attr, []) or []:
                name = item.dll.decode("ascii", errors="replace") if isinstance(item.dll, bytes) else str(item.dll)
                if name not in target:
                    target.append(name)
    finally:
        pe.close()
    return info


def system_dlls() -> tuple[set[str], list[str], set[str]]:
    """(names, patterns, driver DLLs) from targets.toml, lower case: what a Windows system provides."""
    from dfbuild.host import platforms

    table = platforms.table().get("windows_system_dlls", {})
    return ({n.lower() for n in table.get("names", ())}, [p.lower() for p in table.get("patterns", ())],
            {n.lower() for n in table.get("driver_dlls", ())})


def backend_driver_dll(backend: str | None) -> str | None:
    """The GPU driver's DLL a backend's Windows build must import (targets.toml: vulkan-1.dll for vulkan)."""
    from dfbuild.host import platforms

    return platforms.table().get("windows_system_dlls", {}).get("backend_driver_dlls", {}).get(backend or "")


def unresolved_imports(info: PeInfo, shipped: set[str]) -> list[str]:
    """The imported DLLs that are neither in SHIPPED (names in the zip) nor a Windows system or driver DLL.

    Windows looks DLL names up case-insensitively.
    """
    names, patterns, drivers = system_dlls()
    shipped_lower = {s.lower() for s in shipped}
    missing = []
    for dll in [*info.imports, *info.delay_imports]:
        low = dll.lower()
        if low in shipped_lower or low in names or low in drivers or any(fnmatch.fnmatch(low, p) for p in patterns):
            continue
        missing.append(dll)
    return missing


# An absolute path of a build machine inside a binary: a POSIX path under a usual root, or a drive path.
_BUILD_PATH = re.compile(rb"(?:/(?:home|root|tmp|work|build|usr/src|opt|var|srv|mnt|runner|__w)/[\x21-\x7e]{2,}"
                         rb"|[A-Za-z]:\\(?:Users|a|actions-runner|build|src|work)\\[\x21-\x7e]{2,})")


def absolute_paths(data: bytes, extra: Sequence[bytes] = ()) -> list[str]:
    """Absolute build-machine paths found in DATA (at most a few, for the message).

    EXTRA: paths known to be this machine's (the work dir), found anywhere.
    """
    found: list[str] = []
    for needle in extra:
        if needle and needle in data and needle.decode(errors="replace") not in found:
            found.append(needle.decode(errors="replace"))
    for match in _BUILD_PATH.finditer(data):
        text = match.group(0).decode("ascii", errors="replace")
        if text not in found:
            found.append(text)
        if len(found) >= 3:
            break
    return found
