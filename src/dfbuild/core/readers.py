"""The strict readers: one for each format dfbuild vouches for or unpacks, shared by verify and extraction.

A reader accepts a file only when GNU tar, unzip, `sha256sum -c` or pip would read
it the same way it does, and raises FormatError (a ValueError) for anything else:
what two tools could read differently is refused, not interpreted. docs/verify.md
says which rule comes from which tool.

- `read_archive` (.tar.gz, .zip): every member once, with a canonical name, its
  kind (file, dir, link), mode, owner, and contents (with_data). A .tar.gz is one
  gzip member (CRC and length checked) holding a POSIX ustar/pax tar whose every
  header checksum is right and which ends with zero blocks only; a zip is exactly
  its entries back to back, then its central directory, whose every local header
  agrees with its central one, stored or deflated, CRC checked.
- `read_sha256sums`: `HASH  NAME` lines, each name once.
- `loads_json`: UTF-8 JSON, no key twice, nested at most MAX_JSON_DEPTH deep.
- `read_record`: a wheel's RECORD, as pip reads it, each path once.

The readers know nothing of dfbuild's release layout (which paths a manifest
names); verify.py and unpack.py put their own rules on what they return.
"""

from __future__ import annotations

import csv
import io
import json
import re
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

NAME_MAX = 255          # bytes in one path component (Linux, macOS, NTFS)
PATH_MAX = 4095         # bytes in a whole path (Linux's PATH_MAX less the NUL)
MAX_JSON_DEPTH = 64     # dfbuild's records nest 5 deep; a deeper one is not dfbuild's
_CHUNK = 1 << 20


class FormatError(ValueError):
    """A file a strict reader refuses: MESSAGE says what and where; HINT, when given, what to do."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint


class LimitError(FormatError):
    """An archive that would unpack past the caps (Limits): refused before anything is unpacked."""


# --- limits ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Caps on what dfbuild unpacks from an archive (a small archive can unpack to a huge tree)."""

    unpacked_bytes: int = 4 << 30     # total size of the members
    members: int = 200_000
    ratio: int | None = 100           # unpacked / archive size, checked past 64 MiB; None: not checked

    @classmethod
    def raised_to(cls, size: int | None) -> Limits:
        """The default caps, or (--max-unpacked-size) SIZE bytes with the ratio check off."""
        return cls() if size is None else cls(unpacked_bytes=size, members=max(cls.members, size // 4096),
                                               ratio=None)


LIMIT_FLAG = "--max-unpacked-size"
_RATIO_FLOOR = 64 << 20


def check_limits(archive: Path, sizes: list[int], limits: Limits) -> None:
    """Refuse (LimitError) an archive whose members would unpack past LIMITS, before anything is unpacked."""
    total, packed = sum(sizes), max(Path(archive).stat().st_size, 1)
    hint = f"if you trust it, raise the cap with {LIMIT_FLAG} SIZE (e.g. {LIMIT_FLAG} 16G)"
    name = Path(archive).name
    if len(sizes) > limits.members:
        raise LimitError(f"archive {name} has {len(sizes)} members, more than the cap of "
                         f"{limits.members}; nothing was unpacked", hint)
    if total > limits.unpacked_bytes:
        raise LimitError(f"archive {name} unpacks to {total} bytes, more than the cap of "
                         f"{limits.unpacked_bytes}; nothing was unpacked", hint)
    if limits.ratio and total > _RATIO_FLOOR and total > limits.ratio * packed:
        raise LimitError(f"archive {name} ({packed} bytes) unpacks to {total} bytes, over "
                         f"{limits.ratio} times its size (an archive bomb?); nothing was unpacked", hint)


# --- names -------------------------------------------------------------------------------


def name_problem(name: str) -> str | None:
    """Why NAME (a member path, '/'-separated, no trailing slash) is not one every unpacker writes to the same
    place, or None: relative, no empty, '.' or '..' part, no backslash or control character, each part within
    NAME_MAX bytes and the whole within PATH_MAX."""
    if not name:
        return "has an empty name"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return f"{name!r} has an absolute or '..' path"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return f"{name!r} holds a control character"
    if "\\" in name:
        return f"{name!r} holds a backslash (a folder separator to Windows tools, a letter to others)"
    parts = name.split("/")
    if ".." in parts:
        return f"{name!r} has an absolute or '..' path"
    if "" in parts or "." in parts:
        return f"{name!r} is not in canonical form (an empty or '.' part)"
    encoded = name.encode("utf-8", "surrogateescape")
    if any(len(p.encode("utf-8", "surrogateescape")) > NAME_MAX for p in parts):
        return f"{name[:60]!r}... has a part over {NAME_MAX} bytes, which no file system holds"
    if len(encoded) > PATH_MAX:
        return f"{name[:60]!r}... is over {PATH_MAX} bytes"
    return None


def _decode_name(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what} {raw[:60]!r} is not UTF-8 (tools would name it differently)") from None


# --- members -----------------------------------------------------------------------------


@dataclass
class Member:
    """One archive member as every unpacker writes it. NAME has no trailing slash; MODE is the permission bits
    with setuid, setgid and sticky (None: a zip entry that records none); OWNER is (uid, gid, uname, gname) of a
    tar member (None in a zip); DATA is the file's bytes when read with_data; LINK a symlink's target."""

    name: str
    kind: str                     # file | dir | link
    mode: int | None
    data: bytes | None = None
    link: str | None = None
    owner: tuple | None = None
    size: int = 0


class _Tree:
    """The names read so far: each once, and no member below a file or a link (an unpacker would write
    through the link, or fail)."""

    def __init__(self, label: str):
        self.label = label
        self.kinds: dict[str, str] = {}   # name: file | dir | link
        self.below: set[str] = set()      # the names some member lies below

    def add(self, name: str, kind: str) -> None:
        if name in self.kinds:
            raise FormatError(f"{self.label}: member {name!r} appears more than once (which copy an unpacker "
                              "keeps depends on the tool)")
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if self.kinds.get(parent, "dir") != "dir":
                raise FormatError(f"{self.label}: member {name!r} lies below {parent!r}, which is a "
                                  f"{self.kinds[parent]}, not a directory")
            self.below.add(parent)
        if kind != "dir" and name in self.below:
            raise FormatError(f"{self.label}: member {name!r} is a {kind}, but other members lie below it")
        self.kinds[name] = kind


def read_archive(path: Path, limits: Limits | None = None, *, with_data: bool = True) -> list[Member]:
    """Every member of a .zip, or of a .tar.gz (by the file name), read strictly (see the module's doc)."""
    path = Path(path)
    if path.name.endswith(".zip") or path.name.endswith(".whl"):
        return read_zip(path, limits, with_data=with_data)
    return read_tar_gz(path, limits, with_data=with_data)


# --- gzip --------------------------------------------------------------------------------


class _Gunzip:
    """A .tar.gz's tar stream, read in order: exactly one gzip member (zlib checks its header CRC, data CRC and
    length), and nothing after it."""

    def __init__(self, handle, label: str):
        self.handle, self.label = handle, label
        self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip wrapper only
        self.buffer = bytearray()
        self.pos = 0             # where the unread tar starts in buffer
        self.done = False

    def _fill(self, want: int) -> None:
        if self.pos > _CHUNK:  # drop what was read, now and then (not at every block: that is quadratic)
            del self.buffer[:self.pos]
            self.pos = 0
        while len(self.buffer) - self.pos < want and not self.done:
            if self.inflater.unconsumed_tail:
                chunk = self.inflater.unconsumed_tail
            else:
                chunk = self.handle.read(_CHUNK)
                if not chunk:
                    raise FormatError(f"{self.label}: the gzip stream is truncated (gzip -t fails)")
            try:
                self.buffer += self.inflater.decompress(chunk, _CHUNK)
            except zlib.error as exc:
                raise FormatError(f"{self.label}: the gzip stream is damaged ({exc}; gzip -t fails)") from None
            if self.inflater.eof:
                self.done = True
                if self.inflater.unused_data or self.handle.read(1):
                    raise FormatError(f"{self.label}: bytes follow the gzip stream (a second gzip member or "
                                      "trailing garbage, which gzip and tar read differently)")

    def read(self, size: int) -> bytes:
        self._fill(size)
        if len(self.buffer) - self.pos < size:
            raise FormatError(f"{self.label}: the tar ends in the middle of a member (truncated)")
        data = bytes(self.buffer[self.pos:self.pos + size])
        self.pos += size
        return data

    def skip(self, size: int) -> None:
        while size > 0:
            step = min(size, _CHUNK)
            self._fill(step)
            if len(self.buffer) - self.pos < step:
                raise FormatError(f"{self.label}: the tar ends in the middle of a member (truncated)")
            self.pos += step
            size -= step

    def rest_is_zero(self) -> bool:
        """Read to the end of the gzip member: True when every byte left is zero."""
        while True:
            if any(memoryview(self.buffer)[self.pos:]):
                return False
            self.pos = len(self.buffer)
            if self.done:
                return True
            self._fill(_CHUNK)


# --- tar ---------------------------------------------------------------------------------

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_USTAR = b"ustar\x0000"          # POSIX ustar magic and version; GNU's old "ustar  \0" reads the prefix otherwise
_TYPES = {b"0": "file", b"5": "dir", b"2": "link"}
_PAX_KEYS = {"path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "comment"}
_PAX_NUMBER = re.compile(r"[0-9]{1,18}")
_PAX_TIME = re.compile(r"-?[0-9]{1,18}(\.[0-9]{1,9})?")


def _octal(field: bytes, what: str, label: str, blank_ok: bool = False) -> int:
    """A ustar number: octal digits (spaces before, NULs or spaces after), as GNU tar and Python both read it;
    no base-256, no blank field (GNU tar refuses it, Python reads 0) unless BLANK_OK (a device number)."""
    if blank_ok and not field.strip(b"\0 "):
        return 0
    match = re.fullmatch(rb" *([0-7]+)[ \0]*", field)
    if not match:
        raise FormatError(f"{label}: a tar header's {what} field {field!r} is not an octal number")
    return int(match.group(1), 8)


def _nts(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _pax_records(data: bytes, label: str) -> dict[str, str]:
    """A pax extended header: 'LEN key=value\\n' records covering DATA exactly, known keys, each once."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        match = re.match(rb"([1-9][0-9]{0,8}) ", data[pos:pos + 11])
        if not match:
            raise FormatError(f"{label}: a pax header record at {pos} has no length")
        length = int(match.group(1))
        record = data[pos:pos + length]
        if len(record) != length or not record.endswith(b"\n") or b"=" not in record:
            raise FormatError(f"{label}: a pax header record at {pos} is malformed")
        key, _, value = record[match.end():-1].partition(b"=")
        try:
            key_text, value_text = key.decode("utf-8"), value.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{label}: a pax header record is not UTF-8") from None
        if key_text not in _PAX_KEYS:
            raise FormatError(f"{label}: pax header keyword {key_text[:40]!r} is not one every tar honours "
                              "alike (GNU.sparse, SCHILY.xattr, hdrcharset ...)")
        if key_text in records:
            raise FormatError(f"{label}: pax header keyword {key_text!r} appears twice")
        if "\0" in value_text:
            raise FormatError(f"{label}: pax header {key_text!r} holds a NUL")
        if key_text in ("size", "uid", "gid") and not _PAX_NUMBER.fullmatch(value_text):
            raise FormatError(f"{label}: pax header {key_text!r} is {value_text[:20]!r}, not a number")
        if key_text in ("mtime", "atime", "ctime") and not _PAX_TIME.fullmatch(value_text):
            raise FormatError(f"{label}: pax header {key_text!r} is {value_text[:20]!r}, not a time")
        records[key_text] = value_text
        pos += length
    return records


def _tar_header(block: bytes, label: str) -> dict:
    stored = _octal(block[148:156], "checksum", label)
    if stored != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        # Python's tarfile stops reading here, GNU tar skips the block and reads the members after it
        raise FormatError(f"{label}: a tar header at the member after the last good one has a wrong checksum "
                          "(GNU tar would skip it and read on; Python's tarfile would stop)")
    if block[257:265] != _USTAR:
        raise FormatError(f"{label}: a tar header is not POSIX ustar (magic {block[257:265]!r}): GNU's old format "
                          "and v7 headers read their name fields differently")
    typeflag = block[156:157]
    # read by Python's tarfile for every member (a bad one stops it), ignored by GNU tar but for devices
    _octal(block[329:337], "devmajor", label, blank_ok=True)
    _octal(block[337:345], "devminor", label, blank_ok=True)
    return {"type": typeflag, "name": _nts(block[0:100]), "prefix": _nts(block[345:500]),
            "link": _nts(block[157:257]), "mode": _octal(block[100:108], "mode", label),
            "uid": _octal(block[108:116], "uid", label), "gid": _octal(block[116:124], "gid", label),
            "size": _octal(block[124:136], "size", label), "mtime": _octal(block[136:148], "mtime", label),
            "uname": _nts(block[265:297]), "gname": _nts(block[297:329])}


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def read_tar_gz(path: Path, limits: Limits | None = None, *, with_data: bool = True) -> list[Member]:
    """Every member of a .tar.gz, read strictly (see the module's doc); FormatError for anything else."""
    path = Path(path)
    limits = limits or Limits()
    label = path.name
    members: list[Member] = []
    tree = _Tree(label)
    sizes: list[int] = []
    with open(path, "rb") as handle:
        stream = _Gunzip(handle, label)
        pax: dict[str, str] | None = None
        while True:
            block = stream.read(_BLOCK)
            if block == _ZERO_BLOCK:
                if pax is not None:
                    raise FormatError(f"{label}: a pax header is followed by the end of the archive")
                # the end-of-archive marker: a second zero block, then zeros only (GNU tar -i, or a tool that
                # reads on, would find whatever a forger hid after it)
                if stream.read(_BLOCK) != _ZERO_BLOCK or not stream.rest_is_zero():
                    raise FormatError(f"{label}: data follows the tar's end-of-archive marker (GNU tar -i and "
                                      "Python's tarfile read it differently)")
                break
            header = _tar_header(block, label)
            kind_flag = header["type"]
            if kind_flag in (b"x", b"g"):
                if pax is not None:
                    raise FormatError(f"{label}: two pax headers in a row")
                if header["size"] > 1 << 20:
                    raise FormatError(f"{label}: a pax header of {header['size']} bytes")
                records = _pax_records(stream.read(_padded(header["size"]))[:header["size"]], label)
                if kind_flag == b"g":  # a global header (git archive's commit id): a comment and nothing else
                    if set(records) - {"comment"}:
                        raise FormatError(f"{label}: a global pax header sets {', '.join(sorted(records))}")
                    continue
                pax = records
                continue
            kind = _TYPES.get(kind_flag)
            if kind is None:
                raise FormatError(f"{label}: a member of tar type {kind_flag!r} (only files, directories and "
                                  "symlinks are vetted; hard links, devices, FIFOs and GNU's long-name "
                                  "headers are refused)")
            record = pax or {}
            pax = None
            if "path" in record:
                raw_name = record["path"]
            else:
                joined = header["prefix"] + b"/" + header["name"] if header["prefix"] else header["name"]
                raw_name = _decode_name(joined, "a tar member name")
            name = raw_name[:-1] if kind == "dir" and raw_name.endswith("/") else raw_name
            why = name_problem(name)
            if why:
                raise FormatError(f"{label}: unsafe member {why}")
            size = int(record["size"]) if "size" in record else header["size"]
            if kind != "file" and size:
                raise FormatError(f"{label}: member {name!r} is a {kind} with {size} bytes of data (tools skip "
                                  "them differently)")
            if header["mode"] > 0o7777:
                raise FormatError(f"{label}: member {name!r} has mode {header['mode']:o}")
            link = None
            if kind == "link":
                link = record.get("linkpath") or _decode_name(header["link"], "a symlink target")
                if not link or any(ord(c) < 0x20 for c in link):
                    raise FormatError(f"{label}: symlink {name!r} has an empty or unprintable target")
            owner = (int(record.get("uid", header["uid"])), int(record.get("gid", header["gid"])),
                     record.get("uname") if "uname" in record else _decode_name(header["uname"], "an owner"),
                     record.get("gname") if "gname" in record else _decode_name(header["gname"], "a group"))
            tree.add(name, kind)
            sizes.append(size)
            check_limits(path, sizes, limits)
            data = None
            if kind == "file":
                if with_data:
                    data = stream.read(size)
                    stream.skip(_padded(size) - size)
                else:
                    stream.skip(_padded(size))
            members.append(Member(name, kind, header["mode"], data, link, owner, size))
    if not members:
        raise FormatError(f"{label}: the tar holds no member")
    return members


# --- zip ---------------------------------------------------------------------------------

_EOCD = struct.Struct("<4sHHHHIIH")          # end of central directory, no comment
_CENTRAL = struct.Struct("<4sBBHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_ZIP_METHODS = {0: "stored", 8: "deflate"}   # what unzip, Python and every zip tool read alike
_ZIP_FLAGS_OK = 0x0800                       # bit 11: the name is UTF-8; no encryption, no data descriptor
_ZIP_EXTRAS_OK = {0x5455, 0x000A}            # timestamps only (no unicode-path 0x7075, no unix 0x756e links)
_UNIX = 3


def _zip_extras(extra: bytes, label: str, name: str) -> None:
    pos = 0
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise FormatError(f"{label}: entry {name!r} has a truncated extra field")
        tag, size = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + size > len(extra):
            raise FormatError(f"{label}: entry {name!r} has a truncated extra field")
        if tag not in _ZIP_EXTRAS_OK:
            raise FormatError(f"{label}: entry {name!r} has extra field 0x{tag:04x}, which some unzippers honour "
                              "and others ignore (a unicode path, unix link or owner, zip64)")
        pos += 4 + size


def read_zip(path: Path, limits: Limits | None = None, *, with_data: bool = True) -> list[Member]:
    """Every entry of a zip (an archive or a wheel), read strictly (see the module's doc)."""
    path = Path(path)
    limits = limits or Limits()
    label = path.name
    raw = path.read_bytes()
    if len(raw) < _EOCD.size or raw[-_EOCD.size:-_EOCD.size + 4] != b"PK\x05\x06":
        raise FormatError(f"{label}: no zip end record at the end of the file (a comment, trailing data, "
                          "or not a zip)")
    eocd_at = len(raw) - _EOCD.size
    _, disk, cd_disk, on_disk, total, cd_size, cd_offset, comment = _EOCD.unpack_from(raw, eocd_at)
    if disk or cd_disk or on_disk != total or comment:
        raise FormatError(f"{label}: a multi-disk zip, or one with a comment")
    if total == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        raise FormatError(f"{label}: a zip64 archive (dfbuild never writes one)")
    if cd_offset + cd_size != eocd_at:
        raise FormatError(f"{label}: the central directory does not end where the end record begins "
                          "(data hidden between them, or a zip64 record)")
    if total > limits.members:
        check_limits(path, [0] * total, limits)
    entries = []
    pos = cd_offset
    for _ in range(total):
        if pos + _CENTRAL.size > eocd_at:
            raise FormatError(f"{label}: the central directory is truncated")
        (sig, _made_version, made_system, need, flags, method, mtime, mdate, crc, csize, usize, name_len,
         extra_len, comment_len, disk_start, internal, external, offset) = _CENTRAL.unpack_from(raw, pos)
        if sig != b"PK\x01\x02":
            raise FormatError(f"{label}: a central directory entry has a bad signature")
        end = pos + _CENTRAL.size + name_len + extra_len + comment_len
        if end > eocd_at:
            raise FormatError(f"{label}: the central directory is truncated")
        raw_name = raw[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]
        extra = raw[pos + _CENTRAL.size + name_len:pos + _CENTRAL.size + name_len + extra_len]
        entries.append((made_system, need, flags, method, mtime, mdate, crc, csize, usize, raw_name, extra,
                        comment_len, disk_start, internal, external, offset))
        pos = end
    if pos != eocd_at:
        raise FormatError(f"{label}: the central directory holds more than its {total} entries")
    sizes = [e[8] for e in entries]
    check_limits(path, sizes, limits)
    members: list[Member] = []
    tree = _Tree(label)
    expected_at = 0
    for (made_system, need, flags, method, mtime, mdate, crc, csize, usize, raw_name, extra, comment_len,
         disk_start, internal, external, offset) in sorted(entries, key=lambda e: e[-1]):
        if flags & ~_ZIP_FLAGS_OK:
            refused = "is encrypted" if flags & 0x1 else f"has flags 0x{flags:04x} (a data descriptor or more)"
            raise FormatError(f"{label}: entry {raw_name[:60]!r} {refused}; it cannot be vetted")
        if flags & 0x0800:
            name = _decode_name(raw_name, "a zip entry name")
        else:  # no UTF-8 flag: the name is in the zip's old code page (cp437), which tools read differently
            if any(b >= 0x80 for b in raw_name):
                raise FormatError(f"{label}: entry {raw_name[:60]!r} has a non-ASCII name without the UTF-8 flag")
            name = raw_name.decode("ascii")
        if method not in _ZIP_METHODS:
            raise FormatError(f"{label}: entry {name!r} uses compression method {method} (not stored or deflate: "
                              "e.g. deflate64, bzip2, lzma, which unzip or Python cannot read)")
        if need > 20 or comment_len or disk_start:
            raise FormatError(f"{label}: entry {name!r} needs zip version {need / 10:.1f}, or has a comment")
        if internal > 1:  # bit 0: text (only unzip -a reads it); unzip gives a file with bit 2 set mode 000
            raise FormatError(f"{label}: entry {name!r} has internal attributes 0x{internal:04x}, which unzip "
                              "reads (bit 2: it writes the file with mode 000) and Python ignores")
        _zip_extras(extra, label, name)
        is_dir = name.endswith("/")
        clean = name[:-1] if is_dir else name
        why = name_problem(clean)
        if why:
            raise FormatError(f"{label}: unsafe member {why}")
        mode = None
        if made_system == _UNIX and external >> 16:
            unix = external >> 16
            file_type = stat.S_IFMT(unix)
            if file_type == 0 and not is_dir and unix & 0o111:
                # no file type (Python's writestr writes 0o600 so): unzip makes it executable, pip does not
                raise FormatError(f"{label}: entry {clean!r} has executable bits but no file type in its unix "
                                  "mode (unzip and pip disagree on whether it is executable)")
            if file_type not in (0, stat.S_IFDIR if is_dir else stat.S_IFREG):
                kind_words = "a symlink" if stat.S_ISLNK(unix) else f"file type 0o{file_type:o}"
                raise FormatError(f"{label}: entry {clean!r} is {kind_words} in its unix mode, not a "
                                  f"{'directory' if is_dir else 'regular file'} (unzip would make "
                                  f"{'a link' if stat.S_ISLNK(unix) else 'something else'})")
            mode = stat.S_IMODE(unix)
        elif made_system != _UNIX and (made_system != 0 or external >> 16):
            # MS-DOS (no mode) or unix only: pip reads a unix mode whatever the system, unzip only from unix
            raise FormatError(f"{label}: entry {clean!r} was made on system {made_system} with attributes "
                              f"0x{external:08x}, which unzip and pip read differently")
        if bool(external & 0x10) and not is_dir:
            raise FormatError(f"{label}: entry {clean!r} has the MS-DOS directory bit but a file's name")
        if is_dir and (usize or csize):
            raise FormatError(f"{label}: directory entry {clean!r} holds data")
        # its local header, right where the previous entry's data ended, saying what the central one says
        if offset != expected_at:
            raise FormatError(f"{label}: entry {clean!r} starts at {offset}, not at {expected_at} where the "
                              "previous one ends (data hidden between entries, or entries that overlap)")
        if offset + _LOCAL.size > cd_offset:
            raise FormatError(f"{label}: entry {clean!r} has no local header")
        (lsig, lneed, lflags, lmethod, lmtime, lmdate, lcrc, lcsize, lusize, lname_len,
         lextra_len) = _LOCAL.unpack_from(raw, offset)
        data_at = offset + _LOCAL.size + lname_len + lextra_len
        if (lsig != b"PK\x03\x04" or (lneed, lflags, lmethod, lmtime, lmdate, lcrc, lcsize, lusize)
                != (need, flags, method, mtime, mdate, crc, csize, usize)
                or raw[offset + _LOCAL.size:offset + _LOCAL.size + lname_len] != raw_name):
            raise FormatError(f"{label}: entry {clean!r}'s local header disagrees with the central directory "
                              "(unzip and Python would read different things)")
        _zip_extras(raw[offset + _LOCAL.size + lname_len:data_at], label, clean)
        expected_at = data_at + csize
        if expected_at > cd_offset:
            raise FormatError(f"{label}: entry {clean!r}'s data runs into the central directory")
        tree.add(clean, "dir" if is_dir else "file")
        data = None
        if not is_dir and with_data:
            data = _inflate(raw[data_at:expected_at], method, usize, label, clean)
            if zlib.crc32(data) != crc:
                raise FormatError(f"{label}: entry {clean!r} fails its CRC check (unzip -t fails)")
        elif not is_dir:
            _inflate(raw[data_at:expected_at], method, usize, label, clean, crc=crc)
        members.append(Member(clean, "dir" if is_dir else "file", mode, data, None, None, usize))
    if expected_at != cd_offset:
        raise FormatError(f"{label}: {cd_offset - expected_at} bytes lie between the last entry and the central "
                          "directory")
    if not members:
        raise FormatError(f"{label}: the zip holds no entry")
    return members


def _inflate(raw: bytes, method: int, usize: int, label: str, name: str, crc: int | None = None) -> bytes:
    if method == 0:
        data = raw
    else:
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            data = inflater.decompress(raw, usize + 1)
        except zlib.error as exc:
            raise FormatError(f"{label}: entry {name!r} does not inflate ({exc})") from None
        if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
            raise FormatError(f"{label}: entry {name!r}'s deflate stream does not end where its data does")
    if len(data) != usize:
        raise FormatError(f"{label}: entry {name!r} holds {len(data)} bytes, not the {usize} its header says")
    if crc is not None and zlib.crc32(data) != crc:
        raise FormatError(f"{label}: entry {name!r} fails its CRC check (unzip -t fails)")
    return data


# --- SHA256SUMS --------------------------------------------------------------------------

_SUMS_LINE = re.compile(r"([0-9a-f]{64})  ([^\n]+)")


def read_sha256sums(path: Path) -> dict[str, str]:
    """{name: sha256} from a SHA256SUMS file as `sha256sum -c` reads it, and only such a file: UTF-8,
    '\\n'-ended 'HASH  NAME' lines (lower-case hex, two spaces), each NAME a plain file name listed once."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{path.name} is not UTF-8 text") from None
    if not text.endswith("\n"):
        raise FormatError(f"{path.name} is empty or does not end with a newline")
    sums: dict[str, str] = {}
    for number, line in enumerate(text[:-1].split("\n"), 1):
        match = _SUMS_LINE.fullmatch(line)
        if not match:
            raise FormatError(f"{path.name} line {number} is not '<sha256>  <name>' (lower-case hex, two spaces)")
        name = match.group(2)
        why = name_problem(name)
        if why or "/" in name:
            raise FormatError(f"{path.name} line {number} names {name[:80]!r}, which is not a file of this "
                              f"directory{f' ({why})' if why else ''}")
        if name in sums:
            # sha256sum -c checks every line: a wrong first sum fails it even when a later one is right
            raise FormatError(f"{path.name} lists {name} twice (line {number})")
        sums[name] = match.group(1)
    return sums


# --- JSON --------------------------------------------------------------------------------


def _no_twice(pairs: list[tuple[str, object]]) -> dict:
    record = {}
    for key, value in pairs:
        if key in record:
            raise FormatError(f"the key {key[:40]!r} appears twice (readers disagree on which one wins)")
        record[key] = value
    return record


def _no_constant(name: str):
    raise FormatError(f"{name} is not JSON")


def loads_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH):
    """DATA as JSON, strictly: UTF-8 (no BOM, no UTF-16), no key twice, no NaN, nested at most MAX_DEPTH."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError("not UTF-8") from None
    try:
        value = json.loads(data, object_pairs_hook=_no_twice, parse_constant=_no_constant)
    except RecursionError:
        raise FormatError(f"nested deeper than {max_depth}") from None
    except FormatError:
        raise
    except ValueError as exc:
        raise FormatError(f"not JSON ({str(exc)[:80]})") from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise FormatError(f"nested deeper than {max_depth}")
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


# --- a wheel's RECORD --------------------------------------------------------------------


def read_record(text: str, label: str) -> dict[str, tuple[str, str]]:
    """{path: (hash, size)} from a wheel's RECORD as pip reads it (csv), each path once and canonical."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise FormatError(f"{label} is not a CSV file ({exc})") from None
    listed: dict[str, tuple[str, str]] = {}
    for number, row in enumerate(rows, 1):
        if not row:
            continue
        if len(row) != 3 or name_problem(row[0]) or row[0] in listed:
            raise FormatError(f"{label} line {number} is not a new 'path,hash,size' row")
        listed[row[0]] = (row[1], row[2])
    return listed
