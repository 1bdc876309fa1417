"""Safe unpacking of archives and sdists: no member outside the target, no link out, no bomb.

Every archive dfbuild unpacks (an sdist vendoring llama.cpp, a tarball for
`dfbuild import`) goes through extract, which reads it whole with the strict
reader verify uses (readers.py) and refuses the whole archive before anything
is written when one member is unsafe or the archive is not one every tool reads
alike.
"""

from __future__ import annotations

import copy
import os
import posixpath
import re
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from dfbuild.core import readers
from dfbuild.core.errors import ArchiveError, UsageError, from_os_error

# the caps live with the strict readers, which apply them while they read; imported (not assigned), so
# Limits stays a type for the modules that annotate with it (tree_import, source)
from dfbuild.core.readers import LIMIT_FLAG, Limits, check_limits  # noqa: F401 - re-exported

# --- archives ---------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'500M', '4G', '123456' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"'{text}' is not a size", "write it like 500M, 4G or 8589934592")
    scale = 1 << (10 * " KMGT".index(match.group(2).upper() or " "))
    return int(float(match.group(1)) * scale)


def _is_zip(archive: Path) -> bool:
    """A zip begins with a local header (or, empty, its end record). zipfile.is_zipfile() looks for an end
    record anywhere in the last 64 KiB instead, and a .tar.gz's compressed bytes can hold one by chance."""
    try:
        with open(archive, "rb") as f:
            return f.read(4) in (b"PK\x03\x04", b"PK\x05\x06")
    except OSError:
        return False  # (the tarball reader then says what is wrong with the path)


def _strict(archive: Path, limits: Limits) -> list[readers.Member]:
    """The archive's members as the strict reader reads them (no data kept): the whole archive is read and
    vetted (gzip CRC, tar checksums and end, zip headers, names, kinds, caps) before anything is written."""
    try:
        if _is_zip(archive):
            return readers.read_zip(archive, limits, with_data=False)
        return readers.read_tar_gz(archive, limits, with_data=False)
    except readers.LimitError as exc:
        raise ArchiveError(exc.message, exc.hint) from None
    except readers.FormatError as exc:
        what = exc.message.removeprefix(f"{archive.name}: ")
        if what.startswith("unsafe member "):
            raise ArchiveError(f"archive {what.removeprefix('unsafe ')}; refusing the whole archive",
                               "only use archives from a source you trust") from None
        raise ArchiveError(f"cannot read archive {archive}: {what}; refusing the whole archive",
                           "the file is truncated, damaged, or not a .tar.gz/.zip that GNU tar, unzip and Python "
                           "read alike (docs/verify.md); download it again") from None


def extract(archive: Path, into: Path, limits: Limits | None = None) -> None:
    """Unpack ARCHIVE (.zip or a tarball) into INTO, refusing the whole archive if one member is unsafe.

    The strict reader (readers.py) vets the whole archive first; Python's zipfile or tarfile (with its
    "data" filter) then writes it, and must see the very members the strict reader saw."""
    archive, limits = Path(archive), limits or Limits()
    try:
        vetted = _strict(archive, limits)
        for member in vetted:
            if member.kind == "link":
                _check_link_target(member.name, member.link)
        expected = sorted((m.name, m.kind, m.size) for m in vetted)
        if _is_zip(archive):
            with zipfile.ZipFile(archive) as zf:
                seen = sorted((i.filename.rstrip("/"), "dir" if i.is_dir() else "file", i.file_size)
                              for i in zf.infolist())
                _same(archive, expected, seen)
                zf.extractall(into)
            return
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            seen = sorted((m.name, "dir" if m.isdir() else "link" if m.issym() else "file",
                           m.size if m.isfile() else 0) for m in members)
            _same(archive, expected, seen)
            # the "data" filter also drops owners, so root-extracted trees stay usable by git
            if hasattr(tarfile, "data_filter"):
                tf.extractall(into, members=members, filter="data")
            else:  # Python < 3.10.12 / 3.11.4 (Debian 12 has 3.11.2): the same checks by hand
                tf.extractall(into, members=[_data_member(m) for m in members])
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, KeyError, RuntimeError,
            NotImplementedError, zlib.error) as exc:
        known = from_os_error(exc) if isinstance(exc, OSError) else None
        if known is not None:  # a full disk is not a bad download
            raise known from None
        # tarfile lists every compression it tried on separate lines; one line is enough
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(":")
        raise ArchiveError(f"cannot read archive {archive}: {reason}",
                           "the file is truncated or not a .tar.gz/.zip; download it again") from None


def _same(archive: Path, expected: list, seen: list) -> None:
    """Python's reader must list what the strict reader vetted, member for member."""
    if expected != seen:
        # one None past the end of each: where one list is a prefix of the other, the first extra member shows
        differ = next((e, s) for e, s in zip(expected + [None], seen + [None], strict=False) if e != s)
        raise ArchiveError(f"archive {archive.name} reads differently in Python than in the strict reader "
                           f"({differ[0]} / {differ[1]}); refusing the whole archive",
                           "only use archives from a source you trust")


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


def _check_link_target(name: str, link: str | None) -> None:
    """A symlink NAME -> LINK must stay in the tree; one without a target (the strict reader refuses it) fails too."""
    if link is None or PurePosixPath(link).is_absolute() or ".." in PurePosixPath(
            posixpath.normpath(str(PurePosixPath(name).parent / link))).parts:
        raise ArchiveError(f"archive link '{name}' points outside the tree; refusing the whole archive",
                           "only use archives from a source you trust")


def check_links_stay_in(root: Path) -> None:
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
