"""Property-based fuzzing (Hypothesis) of the strict readers and the state readers (issue 39).

Each property mutates a valid input (bit flips, byte writes, inserts, deletes,
truncation; for a tar also with every header checksum made right again, as a
forger would, so the mutants reach past the checksum) and asserts what the
readers promise: a reader either refuses the input (FormatError) or reads it
exactly as the standard tool does (Python's tarfile and zipfile always; GNU tar,
unzip and the `sha256sum -c` model on a share of the examples); a state reader
never raises; a journal that passes its check names nothing outside the git dir.

The bounded run is part of the test suite (derandomized, no example database, so
CI is stable): DFBUILD_FUZZ_EXAMPLES=N raises every property to N examples and
draws them at random (`scripts/fuzz.sh` runs that long run; docs/verify.md has
its figures).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dfbuild.core import archive, journal, readers, state  # noqa: E402

LONG = int(os.environ.get("DFBUILD_FUZZ_EXAMPLES", "0") or 0)
settings.register_profile("dfbuild-ci", max_examples=120, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("dfbuild-long", max_examples=max(LONG, 1), derandomize=False, database=None,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
PROFILE = "dfbuild-long" if LONG else "dfbuild-ci"
GNU_SHARE = 1 if LONG else 4   # every Nth example is also unpacked by GNU tar / unzip (slow: a process each)
CI_EXAMPLES = {"tar": 150, "zip": 150, "sums": 200, "json": 200, "state": 150, "journal": 150}


def examples(kind: str):
    return settings(settings.get_profile(PROFILE), max_examples=LONG or CI_EXAMPLES[kind])


# --- mutations --------------------------------------------------------------------------------------------------

MUTATION = st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
                     st.integers(min_value=0, max_value=1 << 20), st.integers(min_value=0, max_value=255))
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=6)


def mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for kind, where, value in mutations:
        if not out:
            break
        at = where % len(out)
        if kind == "flip":
            out[at] ^= 1 << (value % 8)
        elif kind == "set":
            out[at] = value
        elif kind == "insert":
            out[at:at] = bytes([value]) * (1 + value % 4)
        elif kind == "delete":
            del out[at:at + 1 + value % 16]
        else:
            del out[at:]
    return bytes(out)


def fix_checksums(tar: bytes) -> bytes:
    """Every 512-byte block that looks like a ustar header gets a right checksum again (a forger's touch)."""
    out = bytearray(tar)
    for at in range(0, len(out) - 511, 512):
        block = out[at:at + 512]
        if block[257:262] == b"ustar":
            block[148:156] = b" " * 8
            out[at + 148:at + 156] = b"%06o\0 " % sum(block)
    return bytes(out)


# --- samples: archives as dfbuild writes them -------------------------------------------------------------------


def _entries() -> list[archive.Entry]:
    return [archive.Entry("bin/llama-server", 0o755, data=b"#!/bin/sh\necho version\n"),
            archive.Entry("bin/libllama.so.0.2.0", 0o755, data=b"\x7fELF" + bytes(range(256)) * 3),
            archive.Entry("bin/libllama.so.0", link="libllama.so.0.2.0"),
            archive.Entry("LICENSE", data=b"MIT License\n" * 20),
            archive.Entry("licenses/" + "long-name-" * 12 + ".txt", data=b"a pax path header\n"),
            archive.Entry("manifest.json", data=json.dumps({"release": {"files": []}}).encode())]


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("samples")
    tar = folder / "llama-t-dflash-bin-ubuntu-x64.tar.gz"
    archive.write_archive(tar, "llama-t-dflash-bin-ubuntu-x64", _entries(), 1_700_000_000)
    zipped = folder / "llama-t-dflash-bin-win-cpu-x64.zip"
    archive.write_archive(zipped, "llama-t-dflash-bin-win-cpu-x64", _entries(), 1_700_000_000)
    return {"tar.gz": tar.read_bytes(), "zip": zipped.read_bytes()}


# --- what the standard tools read ---------------------------------------------------------------------------------


def _python_tar(data: bytes) -> list[tuple]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        found = []
        for info in tar.getmembers():
            kind = "dir" if info.isdir() else "link" if info.issym() else "file" if info.isfile() else "other"
            content = tar.extractfile(info).read() if info.isfile() else None
            found.append((info.name, kind, info.mode, content, info.linkname if info.issym() else None))
        return found


def _ours(members: list[readers.Member]) -> list[tuple]:
    return [(m.name, m.kind, m.mode, m.data, m.link) for m in members]


def _tree(root: Path) -> dict[str, tuple]:
    """What an unpacker wrote under ROOT: {relative name: (kind, mode, bytes or link)} (links never followed)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", None, os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                found[rel] = ("dir", None, None)
            else:
                found[rel] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
    return found


def _expected_tree(members: list[readers.Member]) -> dict[str, tuple]:
    """What an unpacker must write for MEMBERS: each member, and the folders above them it makes on its way."""
    tree = {m.name: (m.kind, m.mode if m.kind == "file" else None,
                     m.data if m.kind == "file" else m.link if m.kind == "link" else None) for m in members}
    for name in list(tree):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            tree.setdefault("/".join(parts[:depth]), ("dir", None, None))
    return tree


def gnu_tar_agrees(data: bytes, members: list[readers.Member]) -> None:
    """GNU tar unpacks DATA without complaint, to exactly the members the strict reader returned."""
    if shutil.which("tar") is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a.tar.gz").write_bytes(data)
        (Path(tmp) / "x").mkdir()
        done = subprocess.run(["tar", "-xzf", "a.tar.gz", "-C", "x", "--no-same-owner"], cwd=tmp,
                              capture_output=True)
        assert done.returncode == 0, done.stderr
        unpacked = _tree(Path(tmp) / "x")
    expected = _expected_tree(members)
    if os.geteuid() != 0:  # GNU tar drops the umask's bits for a user; root keeps the archive's modes
        expected = {k: (v[0], None if v[1] is None else v[1] & ~0o022, v[2]) for k, v in expected.items()}
    assert unpacked == expected


def unzip_agrees(data: bytes, members: list[readers.Member]) -> None:
    if shutil.which("unzip") is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a.zip").write_bytes(data)
        done = subprocess.run(["unzip", "-qq", "-o", "a.zip", "-d", "x"], cwd=tmp, capture_output=True)
        assert done.returncode == 0, done.stderr + done.stdout
        unpacked = _tree(Path(tmp) / "x")
    # unzip drops setuid, setgid and sticky bits (without -K): verify refuses them in its own rules
    expected = {k: (v[0], None if v[1] is None else v[1] & 0o777, v[2]) for k, v in _expected_tree(members).items()}
    if os.geteuid() != 0:
        expected = {k: (v[0], None if v[1] is None else v[1] & ~0o022, v[2]) for k, v in expected.items()}
    # a zip entry without a unix mode is written with unzip's default mode: compare the bytes only
    unpacked = {k: (v[0], v[1] if expected.get(k, (0, None))[1] is not None else None, v[2])
                for k, v in unpacked.items()}
    assert unpacked == expected


def _read(path_bytes: bytes, suffix: str, reader):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"llama-t{suffix}"
        path.write_bytes(path_bytes)
        try:
            return reader(path)
        except readers.FormatError:
            return None


# --- properties ---------------------------------------------------------------------------------------------------


@examples("tar")
@given(level=st.sampled_from(["gzip", "tar", "tar, checksums made right"]), mutations=MUTATIONS,
       count=st.integers(min_value=0))
def test_the_tar_reader_refuses_or_reads_as_tarfile_and_gnu_tar_do(samples, level, mutations, count):
    data = samples["tar.gz"]
    if level == "gzip":
        mutant = mutate(data, mutations)
    else:
        tar = mutate(gzip.decompress(data), mutations)
        mutant = gzip.compress(fix_checksums(tar) if "checksums" in level else tar, mtime=0)
    members = _read(mutant, ".tar.gz", lambda p: readers.read_tar_gz(p, readers.Limits(unpacked_bytes=1 << 24)))
    if members is None:
        return  # refused: nothing to compare
    assert _ours(members) == _python_tar(mutant)
    if count % GNU_SHARE == 0:
        gnu_tar_agrees(mutant, members)


@examples("zip")
@given(mutations=MUTATIONS, count=st.integers(min_value=0))
def test_the_zip_reader_refuses_or_reads_as_zipfile_and_unzip_do(samples, mutations, count):
    mutant = mutate(samples["zip"], mutations)
    members = _read(mutant, ".zip", lambda p: readers.read_zip(p, readers.Limits(unpacked_bytes=1 << 24)))
    if members is None:
        return
    with zipfile.ZipFile(io.BytesIO(mutant)) as zf:
        theirs = [(i.filename.rstrip("/"), "dir" if i.is_dir() else "file", None if i.is_dir() else zf.read(i))
                  for i in sorted(zf.infolist(), key=lambda i: i.header_offset)]
    assert [(m.name, m.kind, m.data) for m in members] == theirs
    if count % GNU_SHARE == 0:
        unzip_agrees(mutant, members)


def sha256sum_c_model(text: bytes) -> dict[str, list[str]] | None:
    """What `sha256sum -c` (GNU coreutils, default mode) checks: {name: [every sum listed for it]}, or None when a
    line is not one it reads as '<hex>  <name>' (escaped names, BSD tags and binary-mode lines are not dfbuild's)."""
    try:
        lines = text.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return None
    if lines[-1] != "":
        return None
    checked: dict[str, list[str]] = {}
    for line in lines[:-1]:
        if len(line) < 67 or line[64:66] != "  " or any(c not in "0123456789abcdef" for c in line[:64]):
            return None
        checked.setdefault(line[66:], []).append(line[:64])
    return checked


SUM_LINE = st.builds(lambda digest, name, sep: f"{digest}{sep}{name}\n",
                     st.sampled_from([hashlib.sha256(bytes([i])).hexdigest() for i in range(4)] + ["A" * 64]),
                     st.sampled_from(["a.tar.gz", "b.whl", "a.tar.gz", "../x", "d/e", "\\x", "n" * 256, "", "é.zip"]),
                     st.sampled_from(["  ", " *", " ", "\t"]))


@examples("sums")
@given(lines=st.lists(SUM_LINE, max_size=5), mutations=st.one_of(st.none(), MUTATIONS))
def test_the_sums_reader_agrees_with_sha256sum_c(tmp_path_factory, lines, mutations):
    text = "".join(lines).encode("utf-8")
    if mutations:
        text = mutate(text, mutations)
    path = tmp_path_factory.mktemp("sums") / "SHA256SUMS"
    path.write_bytes(text)
    try:
        sums = readers.read_sha256sums(path)
    except readers.FormatError:
        return
    model = sha256sum_c_model(text)
    assert model is not None, text
    assert {name: [digest] for name, digest in sums.items()} == model  # each name once, as sha256sum -c reads it
    assert all(readers.name_problem(name) is None and "/" not in name for name in sums)


JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=20)


@examples("json")
@given(value=JSON_VALUE, depth=st.integers(min_value=0, max_value=3000), mutations=st.one_of(st.none(), MUTATIONS))
def test_the_json_reader_refuses_or_agrees_with_json(value, depth, mutations):
    data = ("[" * depth + json.dumps(value) + "]" * depth).encode()
    if mutations:
        data = mutate(data, mutations)
    try:
        read = readers.loads_json(data)
    except readers.FormatError:
        return
    assert read == json.loads(data.decode("utf-8"))
    pending, deepest = [(read, 1)], 0  # what the reader returns is never deeper than its cap
    while pending:
        item, level = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            pending.extend((c, level + 1) for c in (item.values() if isinstance(item, dict) else item))
    assert deepest <= readers.MAX_JSON_DEPTH


@examples("state")
@given(data=st.one_of(st.binary(max_size=300), JSON_VALUE.map(lambda v: json.dumps(v).encode())),
       mutations=st.one_of(st.none(), MUTATIONS))
def test_a_state_record_of_any_bytes_reads_as_a_dict_or_absent(tmp_path_factory, data, mutations):
    path = tmp_path_factory.mktemp("state") / "record.json"
    path.write_bytes(mutate(data, mutations) if mutations and data else data)
    assert isinstance(state.read_json(path, "record"), dict)


NAMES = st.sampled_from(["dfbuild/b1", "main", "../../../x/victim", "a/../b", "refs/heads/x", "-x", "b" * 300,
                         "a\0b", "ok/ok", "", ".git/config", "/etc/passwd", "common/speculative.cpp"])
JOURNAL = st.fixed_dictionaries({"op": st.sampled_from(["apply", "checkout", "stash", "rm"])}, optional={
    "branch": st.one_of(NAMES, st.integers()), "paths": st.lists(NAMES, max_size=3),
    "foreign_locks": st.lists(st.sampled_from(["index.lock", "refs/heads/main.lock", "../x.lock", 5]), max_size=2),
    "pid": st.one_of(st.integers(), st.text(max_size=3)), "wrote": st.dictionaries(NAMES, st.lists(NAMES)),
    "extra": st.text(max_size=3)})


@pytest.fixture(scope="module")
def git_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-q",
                    "--allow-empty", "-m", "base"], check=True)
    return tree


@examples("journal")
@given(record=JOURNAL)
def test_a_journal_that_passes_its_check_names_nothing_outside_the_git_dir(git_tree, record):
    head = subprocess.run(["git", "-C", str(git_tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    if record["op"] == "apply":
        record.setdefault("original_head", head.strip())
    elif record["op"] == "checkout":
        record.setdefault("commit", head.strip())
    why = journal.problem(git_tree, record)  # never raises, whatever the record holds
    if why is not None:
        return
    git_dir = (git_tree / ".git").resolve()
    for lock in journal.git_locks(git_tree, record.get("branch")) + [git_dir / n for n in
                                                                     journal._lock_names(record.get("branch"))]:
        assert os.path.realpath(lock).startswith(str(git_dir) + os.sep), lock
    for rel in record.get("paths") or []:
        assert not os.path.realpath(git_tree / rel).startswith(str(git_dir))
        assert os.path.realpath(git_tree / rel).startswith(str(git_tree.resolve()) + os.sep)
