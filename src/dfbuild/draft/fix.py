"""`dfbuild draft fix`: a copy of a plain-rope DFlash draft that carries `dflash.rope.dimension_sections`,
as llama.cpp's converter writes it for an M-RoPE target (`[head_dim // 2, 0, 0, 0]`: the draft ropes on
the temporal dimension only), so that llama-server b10662 and later load it as an M-RoPE draft, which
jumps over an image's positions instead of failing on them (llama.cpp #27408).

The copy is the draft's own bytes but for one key: the header is rewritten (the key count, the new
entry after the others, the tensor infos as they were: their offsets count from the data section,
which is aligned again), then the data section is streamed across in fixed-size chunks, so a draft of
any size needs a few MiB of memory. It is written to a temp file beside `--out`, fsynced, read back (its
header parsed again, every key's bytes and every tensor's sha256 compared with the draft's) and only
then renamed into place. The draft itself is only ever opened for reading.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import struct
from pathlib import Path

from dfbuild.core import errors, state
from dfbuild.draft.check import SECTIONS_KEY, draft_head_dim, judge, read_draft, read_target
from dfbuild.draft.header import MAGIC, Header, TensorInfo, encode_int32_array, pad, read_header

CHUNK = 8 << 20  # bytes per read and write of the data section
SPACE_MARGIN = 1 << 20  # free space kept beyond the copy's size
_TEMP_SUFFIX = ".dfbuild-tmp"


def fixed_sections(head_dim: int) -> list[int]:
    """What conversion/qwen.py's DFlashModel writes for an M-RoPE target (b10662 and later)."""
    return [head_dim // 2, 0, 0, 0]


def new_header_bytes(draft: Header, sections: list[int]) -> bytes:
    """The fixed file's bytes up to its data section: every key but an old (all-zero) sections key, verbatim,
    the sections key after them, the tensor infos verbatim, zero padding to the file's alignment."""
    kept = [key for key in draft.value_ranges if key != SECTIONS_KEY]
    with open(draft.path, "rb") as handle:
        def read(start: int, end: int) -> bytes:
            handle.seek(start)
            return handle.read(end - start)

        kv = b"".join(read(*draft.value_ranges[key]) for key in kept)
        tensor_infos = read(draft.kv_end, draft.ti_end)
    order = draft.byte_order
    counts = struct.pack(order + "IQQ", draft.version, len(draft.tensors), len(kept) + 1)
    head = (MAGIC + counts + kv + encode_int32_array(SECTIONS_KEY, sections, order) + tensor_infos)
    return head + b"\0" * (pad(len(head), draft.alignment) - len(head))


def stream_tensors(src, start: int, length: int, tensors: list[TensorInfo], sink=None,
                   chunk: int = CHUNK) -> dict[str, str]:
    """Read LENGTH bytes of a data section from START in chunks (writing each to SINK when given) and
    return each tensor's sha256: one pass, one chunk of memory, whatever the file's size."""
    hashers = {t.name: hashlib.sha256() for t in tensors}
    order = sorted(tensors, key=lambda t: t.offset)
    buffer = bytearray(min(chunk, max(length, 1)))
    view = memoryview(buffer)
    src.seek(start)
    pos, first = 0, 0
    while pos < length:
        got = src.readinto(view[:min(len(buffer), length - pos)])
        if not got:
            raise errors.DraftDamagedError(f"{src.name} ended at byte {start + pos} while being copied",
                                           "was it changed or truncated meanwhile? run again on a whole file")
        if sink is not None:
            sink.write(view[:got])
        end = pos + got
        while first < len(order) and order[first].offset + order[first].n_bytes <= pos:
            first += 1
        for tensor in order[first:]:
            if tensor.offset >= end:
                break
            lo, hi = max(tensor.offset, pos), min(tensor.offset + tensor.n_bytes, end)
            if lo < hi:
                hashers[tensor.name].update(view[lo - pos:hi - pos])
        pos = end
    return {name: h.hexdigest() for name, h in hashers.items()}


def _temp_path(out: Path) -> Path:
    return out.parent / f".{out.name}.{os.getpid()}{_TEMP_SUFFIX}"


def sweep_stale(out: Path) -> list[Path]:
    """Remove the temp files an earlier `draft fix` to OUT left behind when it was killed (its pid is gone)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(\d+){re.escape(_TEMP_SUFFIX)}$")
    removed: list[Path] = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match and not state.pid_alive(int(match.group(1))) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _refuse_out(out: Path, inputs: list[Path], force: bool) -> None:
    if not out.parent.is_dir():
        raise errors.UsageError(f"--out {out}: the folder {out.parent} does not exist", "make it, or name another")
    if not out.exists() and not out.is_symlink():
        return
    for given in inputs:
        try:
            same = out.samefile(given)
        except OSError:
            same = False
        if same:
            raise errors.DraftFixRefusedError(f"--out {out} is the input {given} itself; nothing was written",
                                              "write the fixed draft beside it (the input is never changed)")
    if out.is_dir():
        raise errors.DraftFixRefusedError(f"--out {out} is a directory; nothing was written", "name the file to write")
    if not force:
        raise errors.DraftFixRefusedError(f"--out {out} exists; nothing was written",
                                          "pass --force to replace it, or name another file")


def _check_space(folder: Path, needed: int) -> None:
    info = os.statvfs(folder)
    free = info.f_bavail * info.f_frsize
    if free < needed + SPACE_MARGIN:
        raise errors.CannotWriteError(
            f"not enough free space in {folder} for the fixed draft: it needs {_mib(needed)}, {_mib(free)} are free; "
            "nothing was written", "free some space there, or write --out on another disk")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _verify(draft: Header, written: Path, sections: list[int], digests: dict[str, str]) -> Header:
    """The written copy parsed again: the draft's keys byte for byte, the new key, the same tensors with the
    same sha256. Any difference is refused (63); the caller removes the copy."""
    copy = read_header(written)
    problems = []
    if copy.get(SECTIONS_KEY) != sections:
        problems.append(f"{SECTIONS_KEY} reads {copy.get(SECTIONS_KEY)!r}")
    kept = [key for key in draft.value_ranges if key != SECTIONS_KEY]
    if [key for key in copy.value_ranges if key != SECTIONS_KEY] != kept:
        problems.append("its keys differ from the draft's")
    else:
        with open(draft.path, "rb") as a, open(written, "rb") as b:
            for key in kept:
                (s0, s1), (c0, c1) = draft.value_ranges[key], copy.value_ranges[key]
                a.seek(s0)
                b.seek(c0)
                if a.read(s1 - s0) != b.read(c1 - c0):
                    problems.append(f"key {key!r} differs")
    if copy.tensors != draft.tensors:
        problems.append("its tensor infos differ from the draft's")
    else:
        with open(written, "rb") as handle:
            again = stream_tensors(handle, copy.data_start, copy.data_end - copy.data_start, copy.tensors)
        problems += [f"tensor {name!r} hashes differently" for name in digests if again.get(name) != digests[name]]
    if problems:
        raise errors.DraftFixRefusedError(f"the fixed copy did not read back equal to {draft.path}: "
                                          + "; ".join(problems[:5]) + "; it was removed, nothing was written",
                                          "check the disk (dmesg), then run again")
    return copy


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename TMP to OUT: over it with --force, else only while OUT does not exist (a link fails if it does)."""
    if force:
        state.move(tmp, out)
        return
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise errors.DraftFixRefusedError(f"--out {out} appeared while the copy was written; nothing was replaced",
                                          "pass --force to replace it, or name another file") from None
    except OSError as exc:  # a filesystem without hard links (FAT, some FUSE mounts): rename, as checked above
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        state.move(tmp, out)
        return
    tmp.unlink()


def fix_draft(draft_path: Path, target_path: Path, out: Path, *, force: bool = False, chunk: int = CHUNK) -> dict:
    """Write the fixed copy of DRAFT_PATH to OUT; return what was done (`changed` False: nothing was needed)."""
    draft, target = read_draft(Path(draft_path)), read_target(Path(target_path))
    before = judge(draft, target)
    out = Path(os.path.abspath(out))
    result: dict = {"draft": str(draft.path), "target": str(target.path), "out": str(out), "changed": False,
                    "before": before.to_dict()}
    if not before.target_mrope:
        raise errors.DraftFixRefusedError(
            f"--target {target.path} ({before.target_arch}) is not M-RoPE, so its image requests open no hole in "
            "the draft's cache: nothing to fix, nothing was written",
            "the draft works as it is; a target without M-RoPE keeps a plain-rope draft (the loader would make "
            "a draft with sections M-RoPE, against its target's positions)")
    if before.draft_rope == "sections":
        result["sections"] = before.draft_sections
        result["after"] = before.to_dict()
        return result
    _refuse_out(out, [draft.path, target.path], force)
    sections = fixed_sections(draft_head_dim(draft))
    head = new_header_bytes(draft, sections)
    data_length = draft.size - draft.data_start  # the data section and whatever padding follows it, as it is
    _check_space(out.parent, len(head) + data_length)
    sweep_stale(out)
    tmp = _temp_path(out)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as sink, open(draft.path, "rb") as src:
            sink.write(head)
            digests = stream_tensors(src, draft.data_start, data_length, draft.tensors, sink, chunk)
            sink.flush()
            os.fsync(sink.fileno())
        state.fault_point("draft-fix-written")
        copy = _verify(draft, tmp, sections, digests)
        _publish(tmp, out, force)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    state.fsync_dir(out.parent)
    after = judge(copy, target)
    result.update(changed=True, sections=sections, bytes=len(head) + data_length, tensors=len(draft.tensors),
                  verified=True, after=after.to_dict())
    return result
