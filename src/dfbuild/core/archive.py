"""The archive format: reproducible .tar.gz and .zip files, read back safely.

Archives are reproducible: sorted entries, one mtime, uid/gid 0 with no
names, fixed modes, and a gzip header with mtime 0 and no file name. Reading
gives every member with its contents (dfbuild's archives are small);
`unsafe_member` says why a member name must not be extracted.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dfbuild.core import readers
from dfbuild.core.errors import ReleaseError, VerifyError

ARCHIVE_SUFFIXES = (".tar.gz", ".zip")
ZIP_EPOCH_MIN = 315532800            # 1980-01-01: the earliest date a zip entry can hold


def archive_root(name: str) -> str:
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def payload_prefix(packed: dict) -> str:
    """Where an archive's binaries are, from its manifest's release section: at the top (it names a layout:
    llama.cpp's, issue 36), or in bin/ (an archive packed before: no layout in its manifest)."""
    return "" if packed.get("layout") else "bin/"



@dataclass(frozen=True)
class Entry:
    """One file of the archive, relative to its root directory."""

    path: str                     # posix, relative to the archive's folder, e.g. "llama-server"
    mode: int = 0o644
    source: Path | None = None    # a file on disk ...
    data: bytes | None = None     # ... or bytes
    link: str | None = None       # a symlink to a sibling (shared library version links)

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        if self.source is None:
            raise ValueError(f"archive entry {self.path} has neither data nor a source file")
        return Path(self.source).read_bytes()



def _resolve_link(entries_by_path: dict[str, Entry], entry: Entry) -> Entry:
    seen = set()
    while entry.link is not None:
        if entry.path in seen:
            raise ReleaseError(f"symlink loop at {entry.path}", "rebuild with --fresh")
        seen.add(entry.path)
        target = str(PurePosixPath(entry.path).parent / entry.link)
        if target not in entries_by_path:
            raise ReleaseError(f"{entry.path} links to {entry.link}, which is not shipped", "rebuild with --fresh")
        entry = entries_by_path[target]
    return entry



# --- archives ----------------------------------------------------------------------


def unsafe_member(name: str) -> str | None:
    """Why an archive member name is unsafe to extract, or None (readers.name_problem: also a backslash,
    an empty or '.' part, a part over 255 bytes)."""
    return readers.name_problem(name)


def _member_name(root: str | None, path: str) -> str:
    return f"{root}/{path}" if root else path


def _directories(root: str | None, entries: list[Entry]) -> list[str]:
    if not root:  # a flat archive (the CUDA runtime bundle): files only
        return []
    dirs = {root}
    for entry in entries:
        parent = PurePosixPath(root, entry.path).parent
        while str(parent) != root and str(parent) != ".":
            dirs.add(str(parent))
            parent = parent.parent
    return sorted(dirs)


def _check_names(root: str | None, entries: list[Entry]) -> None:
    for entry in entries:
        problem = unsafe_member(entry.path) or unsafe_member(_member_name(root, entry.path))
        if problem:
            raise ReleaseError(f"refusing to archive {problem}", "this is a dfbuild bug; please report it")


def write_tar_gz(path: Path, root: str | None, entries: list[Entry], mtime: int) -> None:
    _check_names(root, entries)
    members = [(d, None) for d in _directories(root, entries)] + [(_member_name(root, e.path), e) for e in entries]
    members.sort(key=lambda member: member[0])
    tmp = path.with_name(path.name + ".tmp")
    # filename="" keeps the name out of the gzip header; mtime=0 keeps the time out
    with open(tmp, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, entry in members:
            info = tarfile.TarInfo(name)
            info.mtime = mtime
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if entry is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif entry.link is not None:
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.link
                tar.addfile(info)
            else:
                data = entry.read()
                info.mode, info.size = entry.mode, len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def write_zip(path: Path, root: str | None, entries: list[Entry], mtime: int) -> None:
    """A zip for Windows: symlinks become copies of their target (Windows builds have none)."""
    _check_names(root, entries)
    by_path = {e.path: e for e in entries}
    date_time = time.gmtime(max(mtime, ZIP_EPOCH_MIN))[:6]
    members = ([(d + "/", None) for d in _directories(root, entries)]
               + [(_member_name(root, e.path), e) for e in entries])
    members.sort(key=lambda member: member[0])
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for name, entry in members:
            info = zipfile.ZipInfo(name, date_time=date_time)
            info.create_system = 3  # unix, so the modes below are honoured by unzip
            if entry is None:
                info.external_attr = ((stat.S_IFDIR | 0o755) << 16) | 0x10
                zf.writestr(info, b"")
                continue
            real = _resolve_link(by_path, entry)
            info.external_attr = (stat.S_IFREG | real.mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, real.read(), compresslevel=9)
    os.replace(tmp, path)


def write_archive(path: Path, root: str | None, entries: list[Entry], mtime: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".zip"):
        write_zip(path, root, entries, mtime)
    elif path.name.endswith(".tar.gz"):
        write_tar_gz(path, root, entries, mtime)
    else:
        raise ReleaseError(f"{path.name}: unknown archive type", "name it .tar.gz or .zip")
    return path


# --- reading back: readers.py's strict readers (one for each format, shared with unpack.py) -----------------

Member = readers.Member


def read_members(path: Path, limits=None) -> list[Member]:
    """Every member of a .tar.gz or .zip, with file contents, read strictly (readers.read_archive) within
    LIMITS; VerifyError (51) for anything the strict reader refuses."""
    try:
        return readers.read_archive(Path(path), limits)
    except readers.FormatError as exc:
        raise VerifyError(exc.message if exc.message.startswith(Path(path).name) else f"{Path(path).name}: "
                          f"{exc.message}", exc.hint or "rebuild the archive with dfbuild release") from None
    except OSError as exc:
        raise VerifyError(f"{Path(path).name} cannot be read: {exc.strerror or exc}", "download it again") from None


def extract_members(members: list[Member], into: Path) -> None:
    """Write already-checked members under INTO, restoring modes and links.

    Every file is made new (O_EXCL, never through a symlink) and every folder must be a real directory
    made here: should two members still collide, VerifyError, never a write outside INTO."""
    into = Path(into)
    for member in sorted(members, key=lambda m: m.name):
        target = into / member.name
        try:
            for parent in reversed(target.relative_to(into).parents[:-1]):
                folder = into / parent
                if not folder.is_dir() or folder.is_symlink():
                    folder.mkdir()
            if member.kind == "dir":
                target.mkdir()
            elif member.kind == "file":
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(member.data or b"")
                if os.name != "nt" and member.mode is not None:
                    target.chmod(member.mode & 0o755)
            elif member.kind == "link":
                os.symlink(member.link or "", target)  # (a link member always has its target: readers.py)
        except (FileExistsError, NotADirectoryError) as exc:
            raise VerifyError(f"cannot unpack {member.name}: {exc.strerror} ({exc.filename})",
                              "the archive is not one dfbuild wrote; do not publish it") from None
