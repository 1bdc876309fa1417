"""Issue 39, class by class: verify and the state readers under a fuzzer.

Nothing outside the work dir or the cache is removed or written whatever a state
file says; every reader ends in a documented code, never a traceback; verify
passes only what GNU tar, unzip and `sha256sum -c` read the same way. The
synthetic llama.cpp, series and crash world come from test_crash_safety.py, the
fake release from test_release_unit.py (as in test_bad_luck_round3.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import dfbuild, said
from test_crash_safety import apply_args, assert_fully_patched, fresh_copy, world  # noqa: F401
from test_series import head, template  # noqa: F401  (template: the module fixture world uses)

from dfbuild.core import journal

IN_USE = 15  # errors.LockedError / StateFileError (literal, so that this file also runs against older code)
posix_only = pytest.mark.skipif(os.name != "posix", reason="symlinks and FIFOs are POSIX")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    from helpers import private_cache

    return private_cache(tmp_path, monkeypatch)


def no_traceback(result) -> str:
    text = said(result)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text, text
    return text


# --- a crafted journal: nothing outside the tree is removed, and apply refuses it ------------------------------


@posix_only
@pytest.mark.parametrize("op", ["stash", "apply", "checkout"])
def test_a_crafted_journal_branch_never_unlinks_a_file_outside(world, tmp_path, op):
    """The issue's journal: a stash journal whose branch climbs out of .git/refs/heads to a user's file."""
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    victim = tmp_path / "x" / "victim.lock"
    victim.parent.mkdir()
    victim.write_text("a user's file\n")
    climb = os.path.relpath(victim.with_suffix(""), dest / ".git" / "refs" / "heads")
    record = {"op": op, "pid": 999999, "branch": climb}
    if op == "apply":
        record.update(original_head=head(dest), paths=[])
    elif op == "checkout":
        record.update(commit=head(dest))
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps(record))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert victim.read_text() == "a user's file\n"
    assert result.exit_code == IN_USE, text
    assert str(journal.journal_path(dest)) in text and "branch" in text
    assert journal.journal_path(dest).exists()  # refused, never acted on: the user looks at it
    assert head(dest) != expected


@posix_only
def test_a_300_character_journal_branch_is_refused_not_a_traceback(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps({"op": "checkout", "commit": head(dest), "branch": "b" * 300}))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == IN_USE, text
    assert "branch" in text


@posix_only
@pytest.mark.parametrize("field", ["foreign_locks outside", "unknown key", "stash with paths"])
def test_every_name_a_journal_holds_is_checked_for_every_op(world, tmp_path, field):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    record = {"op": "stash", "pid": 999999}
    if field == "foreign_locks outside":
        record["foreign_locks"] = ["../../../outside.lock"]
    elif field == "unknown key":
        record["rm"] = "-rf /"
    else:
        record["paths"] = ["../outside"]
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps(record))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == IN_USE, text
    assert "journal" in text


@posix_only
def test_after_the_user_removes_a_refused_journal_apply_goes_on(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps({"op": "stash", "branch": "../../x"}))
    assert dfbuild(*apply_args(syn, bare, dest)).exit_code == IN_USE
    journal.journal_path(dest).unlink()  # what the hint says

    result = dfbuild(*apply_args(syn, bare, dest))

    assert result.exit_code == 0, said(result)
    assert_fully_patched(dest, syn, expected)


# --- verify: one strict reader per format; what GNU tar, unzip or sha256sum -c read otherwise is refused -----

import gzip  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import shutil  # noqa: E402
import stat  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import zipfile  # noqa: E402

from test_bad_luck_round3 import _artifact, _edit_release, _resign, release_dir  # noqa: E402, F401
from test_release_unit import fake_wheel, inputs, write_wheel  # noqa: E402, F401

from dfbuild.verify import release_dir as verify  # noqa: E402

BAD = 51  # errors.VerifyError
REPOSITORY = 17  # errors.RepositoryError
REAL_RUN = verify._run_version  # release_dir replaces it with a stub that records the runs
has_gnu_tar = pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to show what it extracts")


def verify_fails(out: Path, ran: list, *words: str) -> str:
    result = dfbuild("verify", out, "--run")
    text = no_traceback(result)
    assert result.exit_code == BAD, text
    for word in words:
        assert word in text, (word, text)
    assert ran == [], f"verify --run ran {ran} after a failed check"
    return text


def raw_tar(out: Path) -> bytes:
    return gzip.decompress(_artifact(out, ".tar.gz").read_bytes())


def write_raw(out: Path, tar: bytes, *, gz: bytes | None = None) -> None:
    """Put TAR (gzipped, or the raw gzip bytes GZ) in place of the release's archive and re-sign, as a forger."""
    path = _artifact(out, ".tar.gz")
    path.write_bytes(gz if gz is not None else gzip.compress(tar, mtime=0))
    _resign(out)


def header(name: str, data: bytes, *, mode: int = 0o755, checksum_ok: bool = True) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    block = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    if not checksum_ok:
        block[148:156] = b"0000000\0"
    return bytes(block) + data + bytes(-len(data) % 512)


def end_of(tar: bytes) -> int:
    """Where the end-of-archive zero blocks start (after the last member)."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.getmembers()
        return t.offset


@posix_only
@has_gnu_tar
def test_a_header_with_a_bad_checksum_hides_no_member_from_verify(release_dir, tmp_path):
    """Python's tarfile stops at a bad header; GNU tar skips it and extracts the member after it."""
    out, ran = release_dir
    tar = raw_tar(out)
    root = tarfile.open(fileobj=io.BytesIO(tar)).getnames()[0].split("/")[0]
    evil = b"#!/bin/sh\necho evil\n"
    hidden = header(f"{root}/llama-server", b"x" * 10, checksum_ok=False) + header(f"{root}/llama-server", evil)
    at = end_of(tar)
    write_raw(out, tar[:at] + hidden + bytes(1024))
    unpacked = tmp_path / "gnu"
    unpacked.mkdir()
    subprocess.run(["tar", "-xzf", _artifact(out, ".tar.gz"), "-C", unpacked], capture_output=True)
    assert (unpacked / root / "llama-server").read_bytes() == evil  # the attack is real

    verify_fails(out, ran, "checksum")


@posix_only
@pytest.mark.parametrize("damage", ["gzip CRC", "gzip length", "bytes after the gzip stream", "a second gzip member",
                                    "data after the tar's end"])
def test_an_archive_gzip_or_tar_refuse_fails_verify(release_dir, damage):
    out, ran = release_dir
    tar = raw_tar(out)
    gz = gzip.compress(tar, mtime=0)
    if damage == "gzip CRC":
        gz = gz[:-8] + bytes([gz[-8] ^ 1]) + gz[-7:]
    elif damage == "gzip length":
        gz = gz[:-4] + struct.pack("<I", (len(tar) + 512) & 0xFFFFFFFF)
    elif damage == "bytes after the gzip stream":
        gz += b"trailing garbage"
    elif damage == "a second gzip member":
        gz += gzip.compress(header("x/bin/hidden", b"hidden") + bytes(1024), mtime=0)
    else:
        at = end_of(tar)
        gz = gzip.compress(tar[:at + 1024] + b"hidden data" + bytes(1024), mtime=0)
    write_raw(out, tar, gz=gz)
    if damage.startswith("gzip") or damage.startswith("bytes"):
        assert subprocess.run(["gzip", "-t"], input=gz, capture_output=True).returncode != 0  # gzip refuses it
    verify_fails(out, ran, "gzip" if "gzip" in damage or "bytes" in damage else "end")


@posix_only
def test_a_member_name_over_255_bytes_is_51_not_a_traceback(release_dir):
    out, ran = release_dir
    tar = raw_tar(out)
    root = tarfile.open(fileobj=io.BytesIO(tar)).getnames()[0].split("/")[0]
    info = tarfile.TarInfo(f"{root}/{'n' * 300}")
    info.size = 1
    block = info.tobuf(tarfile.PAX_FORMAT) + b"x" + bytes(511)
    at = end_of(tar)
    write_raw(out, tar[:at] + block + bytes(1024))
    verify_fails(out, ran, "255 bytes")


@posix_only
@pytest.mark.parametrize("bits", [0o4755, 0o2755])
@pytest.mark.parametrize("recorded", [False, True])
def test_setuid_or_setgid_fails_whatever_the_manifest_says(release_dir, bits, recorded):
    """Only mode & 0o777 was compared: a setuid llama-server beside a manifest saying 0755 passed."""
    out, ran = release_dir

    def setuid(items):
        for info, _ in items:
            if info.name.endswith("/llama-server"):
                info.mode = bits
        return items

    def record(manifest):
        for entry in manifest["release"]["files"]:
            if entry["path"] == "llama-server":
                entry["mode"] = f"{bits:04o}"

    _edit_release(out, members=setuid, manifest=record if recorded else None)
    verify_fails(out, ran, "setuid")


@posix_only
def test_a_member_owned_by_a_user_fails(release_dir):
    out, ran = release_dir

    def owned(items):
        for info, _ in items:
            if info.name.endswith("/llama-server"):
                info.uid, info.uname = 1000, "someone"
        return items

    _edit_release(out, members=owned)
    verify_fails(out, ran, "owned by someone")


@posix_only
def test_a_key_twice_in_the_archives_manifest_fails(release_dir):
    out, ran = release_dir

    def doubled(items):
        for number, (info, data) in enumerate(items):
            if info.name.endswith("/manifest.json") and info.name.count("/") == 1:
                text = data.decode()
                data = ("{" + '"release": {}, ' + text.lstrip()[1:]).encode()
                info.size = len(data)
                items[number] = (info, data)
        return items

    _edit_release(out, members=doubled)
    verify_fails(out, ran, "appears twice")


def _zip_release(tmp_path: Path, entries: list[tuple[zipfile.ZipInfo, bytes]], manifest: dict | None = None) -> Path:
    """A release dir holding one Windows-style zip made of ENTRIES (its manifest.json added), re-signed."""
    out = tmp_path / "zipout"
    out.mkdir()
    archive = out / "llama-t-dflash-bin-win-cpu-x64.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for info, data in entries:
            zf.writestr(info, data)
        zf.writestr("llama-t-dflash-bin-win-cpu-x64/manifest.json", json.dumps(manifest or {}))
    (out / "SHA256SUMS").write_text(f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  {archive.name}\n")
    return out


def _unix(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, (2000, 1, 1, 0, 0, 0))
    info.create_system, info.external_attr = 3, mode << 16
    return info


@posix_only
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_zip_entry_of_another_unix_file_type_fails(tmp_path, kind):
    """unzip makes a symlink of an S_IFLNK entry (bin/libllama.so -> ../../../etc/passwd); Python reads a file."""
    mode = (stat.S_IFLNK | 0o777) if kind == "symlink" else (stat.S_IFIFO | 0o644)
    out = _zip_release(tmp_path, [(_unix("llama-t-dflash-bin-win-cpu-x64/", stat.S_IFDIR | 0o755), b""),
                                  (_unix("llama-t-dflash-bin-win-cpu-x64/libllama.so", mode), b"../../../etc/passwd")])
    result = dfbuild("verify", out, "--run")
    text = no_traceback(result)
    assert result.exit_code == BAD, text
    assert ("symlink" if kind == "symlink" else "file type") in text


@posix_only
def test_an_empty_zip_entry_name_is_51_not_an_index_error(tmp_path):
    out = _zip_release(tmp_path, [(_unix("", stat.S_IFREG | 0o644), b"x")])
    result = dfbuild("verify", out, "--run")
    text = no_traceback(result)
    assert result.exit_code == BAD and "empty name" in text, text


@posix_only
def test_a_zip_whose_local_header_disagrees_fails(tmp_path):
    out = _zip_release(tmp_path, [(_unix("llama-t-dflash-bin-win-cpu-x64/", stat.S_IFDIR | 0o755), b""),
                                  (_unix("llama-t-dflash-bin-win-cpu-x64/a.dll", stat.S_IFREG | 0o644), b"MZ" * 50)])
    archive = next(out.glob("*.zip"))
    data = bytearray(archive.read_bytes())
    second = data.find(b"PK\x03\x04", 4)
    struct.pack_into("<H", data, second + 10, 0x1234)  # the local header's mod time, not the central one's
    archive.write_bytes(bytes(data))
    (out / "SHA256SUMS").write_text(f"{hashlib.sha256(bytes(data)).hexdigest()}  {archive.name}\n")
    result = dfbuild("verify", out, "--run")
    text = no_traceback(result)
    assert result.exit_code == BAD and "local header" in text, text


@posix_only
@pytest.mark.skipif(shutil.which("unzip") is None, reason="needs unzip to show what it makes of the entry")
def test_a_zip_entry_whose_internal_attributes_unzip_reads_fails(tmp_path):
    """Found by the zzuf campaign: internal attribute bit 2 makes unzip write the file with mode 000, while
    Python (and verify) read 0644; the manifest's mode matched what verify read."""
    from dfbuild.core import readers

    info = _unix("a/f.txt", stat.S_IFREG | 0o644)
    info.internal_attr = 4
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(_unix("a/", stat.S_IFDIR | 0o755), b"")
        zf.writestr(info, b"hello\n")
        zf.writestr(_unix("a/g.txt", stat.S_IFREG | 0o644), b"an entry after it\n")
    subprocess.run(["unzip", "-qq", "-o", str(path), "-d", str(tmp_path / "x")], check=True)
    assert stat.S_IMODE((tmp_path / "x" / "a" / "f.txt").stat().st_mode) == 0  # what unzip makes of it

    with pytest.raises(readers.FormatError, match="internal attributes"):
        readers.read_zip(path)


def test_the_zip_reader_refuses_hidden_bytes_and_comments(tmp_path):
    from dfbuild.core import readers  # (here: the module is new; the other tests also run against older code)

    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr(_unix("a/", stat.S_IFDIR | 0o755), b"")
        zf.writestr(_unix("a/b", stat.S_IFREG | 0o644), b"hello")
    assert [m.name for m in readers.read_zip(good)] == ["a", "a/b"]
    for label, change in (("prepended", lambda d: b"junk" + d), ("comment", None), ("lzma", None)):
        bad = tmp_path / f"{label}.zip"
        if label == "comment":
            shutil.copy(good, bad)
            with zipfile.ZipFile(bad, "a") as zf:
                zf.comment = b"hello"
        elif label == "lzma":
            with zipfile.ZipFile(bad, "w") as zf:
                zf.writestr(_unix("a/b", stat.S_IFREG | 0o644), b"hello", compress_type=zipfile.ZIP_LZMA)
        else:
            bad.write_bytes(change(good.read_bytes()))
        with pytest.raises(readers.FormatError):
            readers.read_zip(bad)


@posix_only
@has_gnu_tar
def test_sha256sums_listing_a_file_twice_fails_as_sha256sum_c_does(release_dir):
    out, ran = release_dir
    sums = (out / "SHA256SUMS").read_text()
    first = sums.splitlines()[0]
    name = first.split("  ", 1)[1]
    (out / "SHA256SUMS").write_text(f"{'0' * 64}  {name}\n" + sums)
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True).returncode != 0
    verify_fails(out, ran, "twice")


@pytest.mark.parametrize("text", ["\ufeff" + "0" * 64 + "  a\n", "0" * 64 + "  a", "0" * 64 + "  a\r\n",
                                  "0" * 64 + " *a\n", "A" * 64 + "  a\n", "0" * 64 + "  a\n\n",
                                  "0" * 64 + "  a\x1cb\n", "0" * 64 + "  " + "n" * 256 + "\n"])
def test_the_sums_reader_takes_only_what_sha256sum_c_reads_alike(tmp_path, text):
    from dfbuild.core import readers  # (here: the module is new; the other tests also run against older code)

    path = tmp_path / "SHA256SUMS"
    path.write_bytes(text.encode())
    with pytest.raises(readers.FormatError):
        readers.read_sha256sums(path)


@posix_only
def test_a_zip_copy_of_a_link_is_compared_with_its_target(inputs, fake_wheel, tmp_path):
    """A Windows-style zip carries a link as a copy of its target: that copy is checked, not skipped."""
    from test_release_unit import write_full_release

    out = tmp_path / "out"
    write_full_release(inputs, out)
    tar_path = _artifact(out, ".tar.gz")
    root = tar_path.name[:-len(".tar.gz")]
    zip_path = out / (root + ".zip")
    with tarfile.open(tar_path) as tar:
        members = tar.getmembers()
        blobs = {m.name: tar.extractfile(m).read() for m in members if m.isfile()}
        links = {m.name: m.linkname for m in members if m.issym()}
    with zipfile.ZipFile(zip_path, "w") as zf:
        for m in members:
            target = m.name
            while target in links:
                target = str(Path(target).parent / links[target])
            name = m.name
            if m.isdir():
                zf.writestr(_unix(name + "/", stat.S_IFDIR | 0o755), b"")
            else:
                data = blobs[target]
                if m.name in links:
                    data = b"\x7fELF not the library the manifest names" + bytes(100)
                zf.writestr(_unix(name, stat.S_IFREG | (0o755 if m.name in links else m.mode)), data)
    tar_path.unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["release"]["archive"] = zip_path.name
    for artifact in manifest["release"]["artifacts"]:
        if artifact["kind"] == "archive":
            artifact["name"] = zip_path.name
    (out / "manifest.json").write_text(json.dumps(manifest))
    _resign(out)
    problems = verify.verify(out, run_binaries=False)["problems"]
    assert any("libllama.so" in p and "does not match its sha256" in p for p in problems), problems


@posix_only
def test_a_stray_manifest_beside_manifest_json_fails(release_dir):
    out, ran = release_dir
    (out / "manifest-x.json").write_text("{}")
    verify_fails(out, ran, "manifest-x.json")


@posix_only
def test_a_marker_that_is_not_dfbuilds_fails(release_dir):
    out, ran = release_dir
    (out / ".dfbuild-owned.json").write_text(json.dumps({"written_by": "dfbuild", "files": ["../x"]}))
    verify_fails(out, ran, ".dfbuild-owned.json")


@posix_only
@pytest.mark.parametrize("extra", ["sitecustomize.py", "evil.pth", "llama_dflash_cpu/extra.py",
                                   "llama_dflash_cpu/__init__.py"])
def test_a_python_file_the_builder_never_makes_fails_the_wheel(release_dir, extra):
    out, ran = release_dir
    wheel = _artifact(out, ".whl")
    with zipfile.ZipFile(wheel) as zf:
        files = {n: zf.read(n) for n in zf.namelist() if ".dist-info/" not in n and not n.endswith("/")}
    files[extra] = b"import os; os.system('echo evil')\n"
    write_wheel(wheel, files)  # a consistent RECORD: pip would install it as it is
    _resign(out)
    verify_fails(out, ran, extra)


# --- tracebacks: every reader ends in a code -------------------------------------------------------------------


DEEP = b"[" * 100_000 + b"]" * 100_000


def test_deep_json_is_refused_by_the_json_reader():
    from dfbuild.core import readers  # (here: the module is new; the other tests also run against older code)

    with pytest.raises(readers.FormatError, match="deeper"):
        readers.loads_json(DEEP)
    with pytest.raises(readers.FormatError, match="deeper"):
        readers.loads_json(b'{"a":' * 70 + b"1" + b"}" * 70)
    with pytest.raises(readers.FormatError, match="twice"):
        readers.loads_json(b'{"a": 1, "a": 2}')
    with pytest.raises(readers.FormatError):
        readers.loads_json(b'{"a": NaN}')
    assert readers.loads_json(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


@posix_only
def test_a_deep_manifest_in_the_archive_is_51_not_a_recursion_error(release_dir):
    out, ran = release_dir

    def deep(items):
        for number, (info, data) in enumerate(items):
            if info.name.endswith("/manifest.json") and info.name.count("/") == 1:
                info.size = len(DEEP)
                items[number] = (info, DEEP)
        return items

    _edit_release(out, members=deep)
    verify_fails(out, ran, "deeper")


@posix_only
def test_deep_state_files_are_ignored_with_a_warning_not_a_traceback(world, tmp_path):
    """The journal, the tree record, curate.json and produced.json, each nested 100,000 deep."""
    from dfbuild.core import manifest, owned, paths

    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    curate = dest / ".git" / "dfbuild" / "curate.json"
    for path in (journal.journal_path(dest), manifest.tree_manifest_path(dest), curate):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(DEEP)
    paths.cache_dir().mkdir(parents=True, exist_ok=True)
    (paths.cache_dir() / "produced.json").write_bytes(DEEP)

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == 0, text
    assert "deeper" in text
    assert owned.was_produced(paths.cache_dir() / "produced.json") is False


@posix_only
def test_run_with_a_file_below_a_symlink_member_is_51_not_file_exists(release_dir):
    out, ran = release_dir

    def below(items):
        root = items[0][0].name.split("/")[0]
        link = tarfile.TarInfo(f"{root}/dir-link")
        link.type, link.linkname, link.mode = tarfile.SYMTYPE, "libllama.so", 0o777
        under = tarfile.TarInfo(f"{root}/dir-link/x")
        under.size = 1
        return [*items, (link, None), (under, b"x")]

    def listed(manifest):  # the manifest lists both, as a forger would: every other check passes
        manifest["release"]["files"] += [{"path": "dir-link", "link": "libllama.so"},
                                         {"path": "dir-link/x", "sha256": hashlib.sha256(b"x").hexdigest(),
                                          "mode": "0644"}]

    _edit_release(out, members=below, manifest=listed)
    verify_fails(out, ran, "dir-link")


@posix_only
def test_a_file_where_the_caches_tmp_belongs_is_15_not_a_traceback(release_dir, monkeypatch):
    from dfbuild.core import paths

    out, ran = release_dir
    monkeypatch.setattr(verify, "_run_version", REAL_RUN)
    tmp = paths.cache_dir() / "tmp"
    if tmp.is_dir():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text("a file of the user's\n")
    from dfbuild.core import owned

    owned.record_produced(_artifact(out, ".tar.gz"))  # verify runs it by default: it unpacks into CACHE/tmp

    result = dfbuild("verify", out)

    text = no_traceback(result)
    assert result.exit_code == IN_USE, text
    assert str(tmp) in text and tmp.read_text() == "a file of the user's\n"


@posix_only
def test_a_directory_where_a_cache_lock_belongs_is_15_not_a_traceback(release_dir):
    from dfbuild.core import owned, paths

    out, ran = release_dir
    lock = paths.cache_dir() / "produced.json.lock"
    if lock.exists():
        lock.unlink()
    lock.mkdir(parents=True)
    (lock / "something").write_text("kept\n")

    with pytest.raises(Exception) as caught:
        owned.record_produced(_artifact(out, ".tar.gz"))

    assert getattr(caught.value, "exit_code", None) == IN_USE, repr(caught.value)
    assert str(lock) in str(caught.value) and (lock / "something").read_text() == "kept\n"


# --- git's own errors: a corrupt index, a damaged import repo --------------------------------------------------


@posix_only
def test_a_corrupt_index_is_a_code_and_a_hint_not_a_raw_git_error(world, tmp_path):
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    index = dest / ".git" / "index"
    index.write_bytes(b"DIRC" + os.urandom(64))

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == REPOSITORY, text
    assert "index file corrupt" in text and "rm .git/index && git reset" in text


@posix_only
def test_git_failing_while_a_journal_is_rolled_back_is_17_with_gits_words_and_the_journal_kept(world, tmp_path):
    """A killed apply's journal, and an index git cannot read: the rollback's `git reset` fails. That is damage
    (exit 17, git's own words, how to rebuild the index), not a traceback; the journal stays for the next run."""
    syn, bare, expected, prepared = world
    dest = fresh_copy(prepared, tmp_path / "llama")
    journal.journal_path(dest).parent.mkdir(parents=True, exist_ok=True)
    journal.journal_path(dest).write_text(json.dumps({"op": "apply", "pid": 999999, "original_head": head(dest),
                                                      "paths": ["common/speculative.cpp"]}))
    (dest / ".git" / "index").write_bytes(b"garbage\n")

    result = dfbuild(*apply_args(syn, bare, dest))

    text = no_traceback(result)
    assert result.exit_code == REPOSITORY, text
    assert "git reset failed: fatal: .git/index: index file smaller than expected" in text, text
    assert "rm .git/index && git reset" in text
    assert journal.journal_path(dest).exists()


@posix_only
@pytest.mark.parametrize("damage", ["objects gone", "HEAD garbage", "config garbage"])
def test_a_damaged_cache_repo_is_a_code_and_a_hint_not_a_raw_git_error(world, tmp_path, damage):
    from dfbuild.core import paths

    syn, bare, expected, prepared = world
    assert dfbuild(*apply_args(syn, bare, tmp_path / "first")).exit_code == 0  # fills the cache
    repos = [p for p in (paths.cache_dir() / "repos").iterdir() if p.name.endswith(".git")]
    assert repos
    for repo in repos:
        if damage == "objects gone":
            for pack in (repo / "objects").rglob("*"):
                if pack.is_file():
                    pack.write_bytes(b"garbage")
        elif damage == "HEAD garbage":
            (repo / "HEAD").write_bytes(b"\x00garbage")
        else:
            (repo / "config").write_bytes(b"[core\n\x00")

    result = dfbuild(*apply_args(syn, bare, tmp_path / "second"))

    text = no_traceback(result)
    assert result.exit_code == REPOSITORY, text
    assert "dfbuild cache clean" in text, text


@posix_only
@pytest.mark.parametrize("field", [{"branch": "../../x/victim"}, {"branch": "-f"}, {"stash": "--index"}])
def test_a_saved_changes_record_with_a_crafted_name_is_ignored(tmp_path, field):
    """series continue --restore hands a save's branch and stash to git: only names dfbuild writes get there."""
    from helpers import run_git

    from dfbuild.series import curate

    tree = tmp_path / "tree"
    tree.mkdir()
    run_git(tree, "init", "-q")
    run_git(tree, "commit", "-q", "--allow-empty", "-m", "base")
    head_ = run_git(tree, "rev-parse", "HEAD")
    ref = f"{curate.SAVED_REFS}/1"
    run_git(tree, "update-ref", ref, head_)
    folder = curate.curate_state_path(tree).parent / curate.SAVED_DIR
    folder.mkdir(parents=True)
    record = {"stamp": "1", "why": "abort", "ref": ref, "stash": None, "head": head_, "branch": None,
              "curation": None, "made_ns": 1}
    (folder / "1.json").write_text(json.dumps(record))
    assert [r["ref"] for r in curate.saved_records(tree)] == [ref]  # the positive control
    (folder / "1.json").write_text(json.dumps({**record, **field}))

    assert curate.saved_records(tree) == []
