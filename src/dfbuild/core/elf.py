"""Just enough ELF for packaging: a file's DT_NEEDED, RUNPATH/RPATH, SONAME and the glibc it needs.

Release archives and wheels check these (RUNPATH exactly $ORIGIN, no empty
entry, which would mean the current directory), and the wheel bundles the
system libraries a manylinux wheel may not assume (libssl, libgomp, ...).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dfbuild.core import proc

ELF_MAGIC = b"\x7fELF"

# Libraries every manylinux system has (PEP 599/600 policy, glibc and the GCC
# runtime): never bundled, never reported as a requirement.
SYSTEM_CORE = re.compile(
    r"^(libc|libm|libdl|libpthread|librt|libutil|libresolv|libanl|libnsl|ld-linux[-\w.]*|libstdc\+\+|libgcc_s"
    r"|linux-vdso)\.so(\.\d+)*$")


def is_elf(data: bytes) -> bool:
    """An ELF header: the magic, then a 32/64-bit class and a byte order dfbuild can read."""
    return len(data) >= 64 and data[:4] == ELF_MAGIC and data[4] in (1, 2) and data[5] in (1, 2)


# e_machine values (the ELF header's machine field), named as ldconfig and `file` name them
MACHINES = {3: "x86", 40: "ARM", 62: "x86-64", 183: "AArch64", 243: "RISC-V"}
# dfbuild's arch names -> the machine their ELF files are for
ARCH_MACHINES = {"x64": "x86-64", "arm64": "AArch64"}


def machine(data: bytes) -> str | None:
    """The machine an ELF file is for (x86-64, AArch64, ...; e_machine <n> when unnamed), or None for a non-ELF."""
    if not is_elf(data[:64]):
        return None
    value = int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")
    return MACHINES.get(value, f"e_machine {value}")


def host_machine() -> str | None:
    """The machine this host's own programs are for."""
    return {"x86_64": "x86-64", "aarch64": "AArch64", "arm64": "AArch64"}.get(os.uname().machine)


@dataclass
class ElfInfo:
    needed: list[str] = field(default_factory=list)
    runpath: str | None = None
    rpath: str | None = None
    soname: str | None = None
    glibc: tuple[int, ...] | None = None   # the highest GLIBC_x.y symbol version it needs; None: none
    machine: str | None = None             # x86-64, AArch64, ... (MACHINES)


# A symbol version glibc defines: GLIBC_2.34 (GLIBC_PRIVATE is not a version a system promises).
_GLIBC_VERSION = re.compile(r"GLIBC_(\d+(?:\.\d+)+)")


def version_text(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else ""


def read(data: bytes | Path) -> ElfInfo:
    """The dynamic section's NEEDED, RUNPATH, RPATH and SONAME of an ELF file (bytes or path)."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    raw = Path(data).read_bytes() if isinstance(data, (str, Path)) else data
    info = ElfInfo(machine=machine(raw[:64]))
    for section in ELFFile(io.BytesIO(raw)).iter_sections():
        if isinstance(section, GNUVerNeedSection):
            # .gnu.version_r: per needed library, the symbol versions taken from it. The highest
            # GLIBC_ one is the oldest glibc the file starts on (what a manylinux_2_X tag promises).
            for _library, versions in section.iter_versions():
                for aux in versions:
                    match = _GLIBC_VERSION.fullmatch(aux.name)
                    if match:
                        version = tuple(int(part) for part in match.group(1).split("."))
                        info.glibc = max(info.glibc or version, version)
            continue
        if not isinstance(section, DynamicSection):
            continue
        tag: Any  # pyelftools gives each tag the attribute its d_tag names
        for tag in section.iter_tags():
            if tag.entry.d_tag == "DT_NEEDED":
                info.needed.append(tag.needed)
            elif tag.entry.d_tag == "DT_RUNPATH":
                info.runpath = tag.runpath
            elif tag.entry.d_tag == "DT_RPATH":
                info.rpath = tag.rpath
            elif tag.entry.d_tag == "DT_SONAME":
                info.soname = tag.soname
    return info


def search_path_problem(info: ElfInfo) -> str | None:
    """Why an ELF's library search path is unsafe or unportable, or None.

    Allowed: no RUNPATH/RPATH at all, or RUNPATH exactly $ORIGIN. An empty entry
    means the current directory; anything else points at the build machine.
    """
    if info.rpath is not None:
        return f"has DT_RPATH {info.rpath!r} (only RUNPATH $ORIGIN is allowed)"
    if info.runpath is not None and info.runpath != "$ORIGIN":
        return f"has RUNPATH {info.runpath!r}, not exactly $ORIGIN"
    return None


def system_library_dirs() -> dict[str, Path]:
    """soname -> path of the libraries the dynamic loader knows (`ldconfig -p`)."""
    found: dict[str, Path] = {}
    ldconfig = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig")
                                                 if os.path.exists(p)), None)
    if ldconfig is None:
        return found
    try:
        output = proc.run([ldconfig, "-p"], timeout=60).stdout
    except (OSError, proc.SubprocessError):
        return found
    machine = "x86-64" if os.uname().machine == "x86_64" else "AArch64" if os.uname().machine == "aarch64" else ""
    for line in output.splitlines():
        match = re.match(r"^\s*(\S+) \(([^)]*)\) => (\S+)$", line)
        if match and (not machine or machine in match.group(2)):
            found.setdefault(match.group(1), Path(match.group(3)))
    return found


# --- what verify checks of every shipped ELF file ---------------------------------------------------------


def check_file(label: str, name: str, data: bytes, problems: list[str],
               glibc: dict[str, tuple[int, ...]] | None = None, want_machine: str | None = None) -> int:
    """RUNPATH must be exactly $ORIGIN (or absent): an empty entry would load libraries from the current dir.
    With WANT_MACHINE (x86-64, AArch64), the file must be an ELF file for it. Problems go to PROBLEMS,
    labelled LABEL: NAME.

    GLIBC, when given, gets NAME's highest GLIBC_ symbol version (the oldest glibc it starts on).
    Returns 1 for an ELF file, 0 otherwise.
    """
    if not is_elf(data):
        return 0
    try:
        info = read(data)
        problem = search_path_problem(info)
    except Exception as exc:  # a damaged ELF is a finding, not a crash
        info, problem = None, f"cannot be read as ELF ({exc})"
    if problem:
        problems.append(f"{label}: {name} {problem}")
    if want_machine and info is not None and info.machine != want_machine:
        problems.append(f"{label}: {name} is an ELF file for {info.machine}, not {want_machine}")
    if glibc is not None and info is not None and info.glibc:
        glibc[name] = info.glibc
    return 1


def glibc_note(label: str, needs: dict[str, tuple[int, ...]]) -> str:
    """One line: the highest glibc any ELF of LABEL needs, and which one."""
    top = max(needs.values())
    which = sorted(name for name, version in needs.items() if version == top)
    return (f"{label}: needs glibc {version_text(top)} or newer "
            f"(GLIBC_{version_text(top)} in {', '.join(which[:3])}{' ...' if len(which) > 3 else ''})")
