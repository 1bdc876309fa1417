"""A GGUF file's header, read strictly and fast: its keys, its tensor infos, and where each part lies.

`dfbuild draft check` and `draft fix` need the metadata of two files that may each be several GB,
and must never read their tensors. gguf-py's GGUFReader memory-maps the file, but it parses every
element of every array into its own numpy view: on a draft with a real vocabulary (250,000 tokens
and as many merges) it took 20 s and 840 MB of RSS here (bench/draft_fix.py measures it beside this
reader). This reader walks the same layout (gguf-py's constants: the value types, the tensor types'
block sizes) over a memory map, decodes scalars and short arrays, and steps over long arrays by their
lengths, keeping each key's byte range so `draft fix` can copy every other key verbatim.

Every length is checked against the file's size before it is used: a truncated or damaged file is a
`DraftDamagedError` (61), a file that is not a GGUF at all a `NotGgufError` (60), never an exception
from struct or numpy.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from dfbuild.core import errors

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# arrays up to this many elements are decoded (rope sections, target layers); longer ones (a vocabulary)
# are stepped over and kept as their type and length
DECODE_ARRAY_MAX = 64
# what no real file holds: a guard against a damaged count that would loop for hours
MAX_DIMS = 8
MAX_STRING = 1 << 30

# GGUF value types (gguf-py's GGUFValueType, gguf's spec): struct formats of the fixed-size ones
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_FORMATS = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
                   _FLOAT32: "f", _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}
INT32 = _INT32
ARRAY = _ARRAY
STRING = _STRING


@dataclass(frozen=True)
class LongArray:
    """An array too long to decode here: its element type and length (a vocabulary, its merges)."""

    element_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order (ne0 first), as the file stores it
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass
class Header:
    """What a GGUF file says about itself, and the byte ranges `draft fix` copies."""

    path: Path
    size: int
    version: int
    byte_order: str  # struct's "<" or ">"
    values: dict[str, object] = field(default_factory=dict)
    value_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> [start, end) of its entry
    tensors: list[TensorInfo] = field(default_factory=list)
    counts_end: int = 0  # end of magic, version and the two counts: the first key starts here
    kv_end: int = 0
    ti_end: int = 0
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0

    @property
    def arch(self) -> str | None:
        value = self.values.get("general.architecture")
        return value if isinstance(value, str) else None

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    @property
    def data_end(self) -> int:
        """Where the last tensor's bytes end (the file may hold padding after it)."""
        return self.data_start + max((t.offset + t.n_bytes for t in self.tensors), default=0)


class _Cursor:
    """Reads from the mapped file at an offset, refusing any read past its end."""

    def __init__(self, buf, size: int, byte_order: str, path: Path):
        self.buf, self.size, self.order, self.path, self.pos = buf, size, byte_order, path, 0

    def damaged(self, what: str) -> errors.DraftDamagedError:
        return errors.DraftDamagedError(
            f"{self.path} is a damaged or truncated GGUF file: {what} (at byte {self.pos} of {self.size})",
            "download or copy the file again; `sha256sum` against the publisher's checksum shows whether it is whole")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.damaged(f"{what} runs past the end of the file")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(self.order + fmt)
        self.need(n, what)
        values = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        length = self.unpack("Q", what)
        if length > MAX_STRING:
            raise self.damaged(f"{what} claims a string of {length} bytes")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        length = self.unpack("Q", what)
        self.need(length, what)
        self.pos += length

    def value(self, value_type: int, what: str):
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            element_type, length = self.unpack("IQ", what)
            if element_type not in _SCALAR_FORMATS and element_type not in (_STRING, _ARRAY):
                raise self.damaged(f"{what} has an unknown element type {element_type}")
            if length <= DECODE_ARRAY_MAX:
                return [self.value(element_type, what) for _ in range(length)]
            self.skip(element_type, length, what)
            return LongArray(element_type, length)
        raise self.damaged(f"{what} has an unknown value type {value_type}")

    def skip(self, element_type: int, length: int, what: str) -> None:
        if element_type in _SCALAR_FORMATS:
            n = struct.calcsize(_SCALAR_FORMATS[element_type]) * length
            self.need(n, what)
            self.pos += n
        elif element_type == _STRING:
            for _ in range(length):  # a vocabulary: ~0.1 s for 500,000 strings
                self.skip_string(what)
        else:
            for _ in range(length):
                self.value(_ARRAY, what)


def _tensor_bytes(ggml_type: int, shape: tuple[int, ...], cursor: _Cursor, name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise cursor.damaged(f"tensor {name!r} has a type ({ggml_type}) this gguf package does not know") from None
    elements = 1
    for n in shape:
        elements *= n
    if shape and shape[0] % block:
        raise cursor.damaged(f"tensor {name!r}: its first dimension {shape[0]} is not a multiple of {block}")
    return elements // block * type_size


def read_header(path: Path) -> Header:
    """The header of the GGUF file at PATH, read through a memory map: no tensor byte is read."""
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the open, a directory has no bytes
            raise _not_gguf(path, "it is not a regular file")
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise errors.NotGgufError(f"{path} does not exist", "check the path") from None
    except PermissionError:
        raise errors.NotGgufError(f"{path} cannot be read (permission denied)",
                                  "run as a user who may read it") from None
    try:
        size = os.fstat(fd).st_size
        if size < 24:
            raise _not_gguf(path, f"it holds {size} bytes, fewer than a GGUF header")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, size, path)
    finally:
        os.close(fd)


def _not_gguf(path: Path, why: str) -> errors.NotGgufError:
    return errors.NotGgufError(f"{path} is not a GGUF file: {why}",
                               "dfbuild draft reads llama.cpp's GGUF models (.gguf); convert safetensors with "
                               "llama.cpp's convert_hf_to_gguf.py first")


def _parse(buf, size: int, path: Path) -> Header:
    if bytes(buf[0:4]) != MAGIC:
        raise _not_gguf(path, f"it starts with {bytes(buf[0:4])!r}, not {MAGIC!r}")
    version_le = struct.unpack_from("<I", buf, 4)[0]
    byte_order = "<" if version_le & 0xFFFF else ">"  # a big-endian file's version reads as 0x03000000 here
    version = struct.unpack_from(byte_order + "I", buf, 4)[0]
    if version not in (2, 3):
        raise _not_gguf(path, f"GGUF version {version} (llama.cpp reads versions 2 and 3)")
    cursor = _Cursor(buf, size, byte_order, path)
    cursor.pos = 8
    n_tensors, n_kv = cursor.unpack("QQ", "the tensor and key counts")
    header = Header(path=path, size=size, version=version, byte_order=byte_order, counts_end=cursor.pos)
    # every key takes at least 12 bytes, every tensor info 24: a count beyond that is damage, not a file
    if n_kv * 12 > size or n_tensors * 24 > size:
        raise cursor.damaged(f"it claims {n_kv} keys and {n_tensors} tensors")
    for index in range(n_kv):
        start = cursor.pos
        key = cursor.string(f"key {index}")
        value_type = cursor.unpack("I", f"the type of {key!r}")
        header.values[key] = cursor.value(value_type, f"the value of {key!r}")
        header.value_ranges[key] = (start, cursor.pos)
    header.kv_end = cursor.pos
    for index in range(n_tensors):
        name = cursor.string(f"tensor info {index}")
        n_dims = cursor.unpack("I", f"the dimensions of tensor {name!r}")
        if not 0 < n_dims <= MAX_DIMS:
            raise cursor.damaged(f"tensor {name!r} claims {n_dims} dimensions")
        shape = tuple(cursor.unpack("Q", f"the shape of tensor {name!r}") for _ in range(n_dims))
        ggml_type, offset = cursor.unpack("IQ", f"the type and offset of tensor {name!r}")
        header.tensors.append(TensorInfo(name, ggml_type, shape, offset, _tensor_bytes(ggml_type, shape, cursor, name)))
    header.ti_end = cursor.pos
    alignment = header.values.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.damaged(f"general.alignment is {alignment!r}, not a power of two")
    header.alignment = alignment
    header.data_start = pad(header.ti_end, alignment)
    if header.data_end > size:
        last = max(header.tensors, key=lambda t: t.offset + t.n_bytes)
        cursor.pos = size
        raise cursor.damaged(f"its tensor data ends at byte {header.data_end} (tensor {last.name!r}), "
                             f"{header.data_end - size} bytes past the end")
    return header


def pad(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def encode_int32_array(key: str, values: list[int], byte_order: str = "<") -> bytes:
    """One key entry as GGUF stores it: the key, ARRAY, INT32 and the values (the converter's
    `add_rope_dimension_sections` writes the same bytes)."""
    raw = key.encode("utf-8")
    return (struct.pack(byte_order + "Q", len(raw)) + raw + struct.pack(byte_order + "IIQ", _ARRAY, _INT32, len(values))
            + struct.pack(byte_order + f"{len(values)}i", *values))
