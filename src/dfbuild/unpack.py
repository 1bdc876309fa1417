"""Safe unpacking of archives and sdists: no member outside the target, no link out, no bomb.

Every archive dfbuild unpacks (an sdist vendoring llama.cpp, a tarball for
`dfbuild import`) goes through extract, which refuses the whole archive
before anything is written when one member is unsafe.
"""

from __future__ import annotations

import copy
import os
import posixpath
import re
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import ArchiveError, UsageError, from_os_error


# --- archives ---------------------------------------------------------------------


def _check_member(name: str) -> None:
    posix = PurePosixPath(name.replace("\\", "/"))
    if posix.is_absolute() or re.match(r"^[A-Za-z]:", name) or ".." in posix.parts:
        raise ArchiveError(f"archive member '{name}' has an absolute or '..' path; refusing the whole archive",
                           "only use archives from a source you trust")


@dataclass(frozen=True)
class Limits:
    """Caps on what dfbuild unpacks from an archive (a small archive can unpack to a huge tree)."""

    unpacked_bytes: int = 4 << 30     # total size of the members
    members: int = 200_000
    ratio: int | None = 100           # unpacked / archive size, checked past 64 MiB; None: not checked

    @classmethod
    def raised_to(cls, size: int | None) -> "Limits":
        """The default caps, or (--max-unpacked-size) SIZE bytes with the ratio check off."""
        return cls() if size is None else cls(unpacked_bytes=size, members=max(cls.members, size // 4096),
                                               ratio=None)


LIMIT_FLAG = "--max-unpacked-size"


_RATIO_FLOOR = 64 << 20


def parse_size(text: str) -> int:
    """'500M', '4G', '123456' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"'{text}' is not a size", "write it like 500M, 4G or 8589934592")
    scale = 1 << (10 * " KMGT".index(match.group(2).upper() or " "))
    return int(float(match.group(1)) * scale)


def check_limits(archive: Path, sizes: list[int], limits: Limits) -> None:
    """Refuse an archive whose members would unpack past LIMITS, before anything is unpacked."""
    total, packed = sum(sizes), max(archive.stat().st_size, 1)
    hint = f"if you trust it, raise the cap with {LIMIT_FLAG} SIZE (e.g. {LIMIT_FLAG} 16G)"
    if len(sizes) > limits.members:
        raise ArchiveError(f"archive {archive.name} has {len(sizes)} members, more than the cap of "
                           f"{limits.members}; nothing was unpacked", hint)
    if total > limits.unpacked_bytes:
        raise ArchiveError(f"archive {archive.name} unpacks to {total} bytes, more than the cap of "
                           f"{limits.unpacked_bytes}; nothing was unpacked", hint)
    if limits.ratio and total > _RATIO_FLOOR and total > limits.ratio * packed:
        raise ArchiveError(f"archive {archive.name} ({packed} bytes) unpacks to {total} bytes, over "
                           f"{limits.ratio} times its size (an archive bomb?); nothing was unpacked", hint)


def extract(archive: Path, into: Path, limits: Limits | None = None) -> None:
    """Unpack ARCHIVE (.zip or a tarball) into INTO, refusing the whole archive if one member is unsafe."""
    limits = limits or Limits()
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    _check_member(name)
                check_limits(archive, [info.file_size for info in zf.infolist()], limits)
                bad = zf.testzip()
                if bad:
                    raise ArchiveError(f"archive {archive} is corrupt at member {bad}", "download it again")
                zf.extractall(into)
            return
        with tarfile.open(archive) as tf:
            members = tf.getmembers()  # reads the whole index, so truncation shows here
            check_limits(archive, [m.size for m in members if m.isfile()], limits)
            for member in members:
                _check_member(member.name)
                if (member.issym() or member.islnk()):
                    _check_link(member)
            # the "data" filter also drops owners, so root-extracted trees stay usable by git
            if hasattr(tarfile, "data_filter"):
                tf.extractall(into, members=members, filter="data")
            else:  # Python < 3.10.12 / 3.11.4 (Debian 12 has 3.11.2): the same checks by hand
                tf.extractall(into, members=[_data_member(m) for m in members])
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, KeyError, RuntimeError,
            NotImplementedError) as exc:  # zipfile: an encrypted member, an unsupported method (deflate64)
        if isinstance(exc, OSError) and from_os_error(exc):  # a full disk is not a bad download
            raise from_os_error(exc) from None
        if isinstance(exc, KeyError):  # a hard link to a member the archive does not hold
            raise ArchiveError(f"archive {archive} has a link to a member it does not hold ({exc}); "
                               "refusing the whole archive", "only use archives from a source you trust") from None
        # tarfile lists every compression it tried on separate lines; one line is enough
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(":")
        raise ArchiveError(f"cannot read archive {archive}: {reason}",
                           "the file is truncated or not a .tar.gz/.zip; download it again") from None


def _data_member(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What tarfile's "data" filter does, for Pythons without it (names and links are checked already).

    Only files, directories and links; no setuid/setgid/sticky bits, no group or
    other write; owned by whoever extracts (no chown to the archive's owners).
    """
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise ArchiveError(f"archive member '{member.name}' is a device, FIFO or other special file; "
                           "refusing the whole archive", "only use archives from a source you trust")
    clean = copy.copy(member)
    clean.uid, clean.gid = getattr(os, "getuid", lambda: 0)(), getattr(os, "getgid", lambda: 0)()
    clean.uname = clean.gname = ""
    if member.isfile() or member.isdir():
        clean.mode = member.mode & 0o755 | (0o600 if member.isfile() else 0o700)
    return clean


def _check_link(member: tarfile.TarInfo) -> None:
    target = PurePosixPath(member.name).parent / member.linkname
    if PurePosixPath(member.linkname).is_absolute() or ".." in PurePosixPath(posixpath.normpath(str(target))).parts:
        raise ArchiveError(f"archive link '{member.name}' points outside the tree; refusing the whole archive",
                           "only use archives from a source you trust")


def _check_links_stay_in(root: Path) -> None:
    """The tree becomes DEST on its own, so a link may not leave it (even to elsewhere in the archive)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            link = Path(folder) / name
            if not link.is_symlink():
                continue
            target = posixpath.normpath((link.parent.relative_to(root) / os.readlink(link)).as_posix())
            if Path(os.readlink(link)).is_absolute() or target.split("/")[0] == "..":
                raise ArchiveError(
                    f"archive link '{link.relative_to(root).as_posix()}' points outside the llama.cpp tree; "
                    "refusing the whole archive",
                    "only use archives from a source you trust")
