"""`dfbuild draft check` and `draft fix` (issue 43) on `dfbuild fixtures`' models: the plain-rope draft and the
M-RoPE qwen35 target, the llama (linear) target, the sections draft; and every bad input and bad luck a
user's two GGUF files can meet. gguf-py's GGUFReader reads the fixed copies back: a reader that is not ours."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import dfbuild, said

from dfbuild.core.paths import sha256_file
from dfbuild.draft import fix as draft_fix
from dfbuild.draft import header as draft_gguf
from dfbuild.smoke import fixtures

gguf = pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import draft_fix as bench_draft_fix  # noqa: E402  (bench/ is scripts, not a package)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft-fixtures")
    fixtures.write_fixtures(out)
    return out


@pytest.fixture
def files(fx, tmp_path) -> dict[str, Path]:
    """The fixture files a test uses, copied so no test can spoil another's."""
    names = {"plain": "draft-plain-agree", "random": "draft-random", "sections": "draft-sections-agree",
             "qwen35": "qwen35-random", "llama": "llama-random", "mmproj": "mmproj-grid"}
    copied = {}
    for key, name in names.items():
        copied[key] = tmp_path / fixtures.FILES[name]
        shutil.copyfile(fx / fixtures.FILES[name], copied[key])
    return copied


def _check(draft, target):
    result = dfbuild("draft", "check", draft, "--target", target, "--json")
    assert result.exit_code == 0, said(result)
    return json.loads(result.stdout)


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {name: (field.types, field.contents()) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _tensor_hashes(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type, list(t.shape), hashlib.sha256(t.data.tobytes()).hexdigest())
            for t in reader.tensors}


# --- check -----------------------------------------------------------------------------------------

def test_check_the_bugs_pair_is_affected(files):
    report = _check(files["plain"], files["qwen35"])
    assert report["draft_rope"] == "plain" and report["target_mrope"] is True and report["affected"] is True
    assert report["affected_releases"] == "b9837 and later" and report["fixable"] is True
    assert report["draft_head_dim"] == fixtures.HEAD_DIM and report["target_arch"] == "qwen35"
    assert "draft fix" in report["way_out"] and "b10662" in report["way_out"]


def test_check_says_it_in_words_on_stdout(files):
    result = dfbuild("draft", "check", files["plain"], "--target", files["qwen35"])
    assert result.exit_code == 0
    assert "plain rope" in result.stdout and "M-RoPE" in result.stdout
    assert "affected: image requests fail on unpatched llama-server b9837 and later" in result.stdout
    assert "next: dfbuild draft fix" in result.stderr and "next:" not in result.stdout


def test_check_a_sections_draft_is_affected_only_before_b10662(files):
    report = _check(files["sections"], files["qwen35"])
    assert report["draft_rope"] == "sections" and report["draft_sections"] == [fixtures.HEAD_DIM // 2, 0, 0, 0]
    assert report["affected"] is False and report["affected_releases"] == "b9837 to b10644"
    assert report["fixable"] is False


def test_check_a_linear_target_is_not_affected(files):
    report = _check(files["plain"], files["llama"])
    assert report["target_mrope"] is False and report["affected"] is False and report["affected_releases"] == "none"


def test_check_reads_only_the_header(files, tmp_path):
    """A draft whose data section is multi-GB (sparse) and whose vocabulary is a real one's size."""
    big = bench_draft_fix.write_large_draft(tmp_path / "big.gguf", vocab=50_000, data_bytes=3 << 30, dense=False)
    assert big.stat().st_size > 3 << 30
    report = _check(big, files["qwen35"])
    assert report["affected"] is True and report["draft_head_dim"] == 128
    header = draft_gguf.read_header(big)
    assert header.values["tokenizer.ggml.tokens"] == draft_gguf.LongArray(draft_gguf.STRING, 50_000)


# --- fix ---------------------------------------------------------------------------------------------

def test_fix_writes_the_converters_key_and_keeps_every_byte_else(files, tmp_path):
    draft, target, out = files["plain"], files["qwen35"], tmp_path / "fixed.gguf"
    before = sha256_file(draft)
    result = dfbuild("draft", "fix", draft, "--target", target, "--out", out)
    assert result.exit_code == 0, said(result)
    assert "wrote" in result.stdout and "not affected on llama-server b10662 and later" in result.stdout
    assert sha256_file(draft) == before  # the input is never touched
    assert _tensor_hashes(out) == _tensor_hashes(draft)
    fixed, original = _fields(out), _fields(draft)
    types, value = fixed.pop("dflash.rope.dimension_sections")
    assert value == [fixtures.HEAD_DIM // 2, 0, 0, 0] and types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert fixed == original and list(fixed) == list(original)  # every other key, in its order
    report = _check(out, target)
    assert report["draft_rope"] == "sections" and report["affected"] is False
    # the same bytes as the fixture's sections draft of the same weights would carry, key for key
    assert _fields(files["sections"])["dflash.rope.dimension_sections"] == (types, value)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".dfbuild-tmp")]


def test_fix_json(files, tmp_path):
    result = dfbuild("draft", "fix", files["random"], "--target", files["qwen35"], "--out", tmp_path / "f.gguf",
                     "--json")
    report = json.loads(result.stdout)
    assert report["changed"] is True and report["verified"] is True and report["sections"] == [8, 0, 0, 0]
    assert report["before"]["affected"] is True and report["after"]["affected"] is False
    assert report["bytes"] == (tmp_path / "f.gguf").stat().st_size


def test_fix_streams_in_chunks_of_any_size(files, tmp_path):
    """Tensor boundaries inside chunks and across them hash the same: a chunk of 100 bytes gives the same file."""
    whole = draft_fix.fix_draft(files["plain"], files["qwen35"], tmp_path / "a.gguf")
    small = draft_fix.fix_draft(files["plain"], files["qwen35"], tmp_path / "b.gguf", chunk=100)
    assert whole["changed"] and small["changed"]
    assert sha256_file(tmp_path / "a.gguf") == sha256_file(tmp_path / "b.gguf")


def test_fix_keeps_a_custom_alignment(files, tmp_path):
    """A draft written with general.alignment 64: the fixed copy's data section is aligned to 64 again."""
    src = gguf.GGUFReader(str(files["plain"]))
    aligned = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(str(aligned), "dflash")
    writer.add_custom_alignment(64)
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for tensor in src.tensors:
        writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "fixed.gguf"
    assert dfbuild("draft", "fix", aligned, "--target", files["qwen35"], "--out", out).exit_code == 0
    header = draft_gguf.read_header(out)
    assert header.alignment == 64 and header.data_start % 64 == 0
    assert _tensor_hashes(out) == _tensor_hashes(aligned)


def test_fix_a_sections_draft_is_a_no_op_that_says_so(files, tmp_path):
    out = tmp_path / "fixed.gguf"
    result = dfbuild("draft", "fix", files["sections"], "--target", files["qwen35"], "--out", out)
    assert result.exit_code == 0 and "nothing to fix, nothing written" in result.stdout
    assert not out.exists()


def test_fix_refuses_a_linear_target(files, tmp_path):
    out = tmp_path / "fixed.gguf"
    result = dfbuild("draft", "fix", files["plain"], "--target", files["llama"], "--out", out)
    assert result.exit_code == 63 and "not M-RoPE" in result.stderr and not out.exists()


def test_fix_refuses_an_existing_out_unless_forced(files, tmp_path):
    out = tmp_path / "fixed.gguf"
    out.write_bytes(b"a file of the user's")
    result = dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", out)
    assert result.exit_code == 63 and "exists" in result.stderr and "--force" in result.stderr
    assert out.read_bytes() == b"a file of the user's"
    result = dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", out, "--force")
    assert result.exit_code == 0 and _tensor_hashes(out) == _tensor_hashes(files["plain"])


def test_fix_refuses_to_write_over_its_input_even_forced(files):
    before = sha256_file(files["plain"])
    result = dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", files["plain"], "--force")
    assert result.exit_code == 63 and "is the input" in result.stderr
    assert sha256_file(files["plain"]) == before


def test_fix_refuses_when_the_disk_is_too_small(files, tmp_path, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, info):
            self.f_frsize, self.f_bavail = info.f_frsize, 10  # ten blocks free

    monkeypatch.setattr(draft_fix.os, "statvfs", lambda p: Small(real(p)))
    out = tmp_path / "fixed.gguf"
    result = dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", out)
    assert result.exit_code == 16 and "not enough free space" in result.stderr
    assert "nothing was written" in result.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".dfbuild-tmp")]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_fix_on_a_real_full_tmpfs(files, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)]).returncode:
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        result = dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", small / "fixed.gguf")
        assert result.exit_code == 16 and "not enough free space" in result.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)])


def test_fix_that_is_killed_leaves_no_out_and_its_temp_is_swept(files, tmp_path):
    out = tmp_path / "fixed.gguf"
    env = {**os.environ, "DFBUILD_FAULT": "draft-fix-written", "DFBUILD_TEST_STOP_SIGNAL": "KILL"}
    proc = subprocess.run([sys.executable, "-m", "dfbuild", "draft", "fix", str(files["plain"]), "--target",
                           str(files["qwen35"]), "--out", str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".dfbuild-tmp")]
    assert len(left) == 1  # kill -9 leaves the temp file beside --out...
    assert dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", out).exit_code == 0
    assert not left[0].exists() and out.is_file()  # ...and the next run to that --out removes it


def test_fix_interrupted_removes_its_temp(files, tmp_path):
    out = tmp_path / "fixed.gguf"
    env = {**os.environ, "DFBUILD_FAULT": "draft-fix-written", "DFBUILD_TEST_STOP_SIGNAL": "INT"}
    proc = subprocess.run([sys.executable, "-m", "dfbuild", "draft", "fix", str(files["plain"]), "--target",
                           str(files["qwen35"]), "--out", str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".dfbuild-tmp")]


def test_fix_refuses_a_copy_that_reads_back_different(files, tmp_path, monkeypatch):
    real = draft_fix.stream_tensors
    calls = []

    def corrupting(src, start, length, tensors, sink=None, chunk=draft_fix.CHUNK):
        calls.append(sink)
        digests = real(src, start, length, tensors, sink, chunk)
        if sink is None:  # the read-back: one tensor no longer matches
            digests[tensors[0].name] = "0" * 64
        return digests

    monkeypatch.setattr(draft_fix, "stream_tensors", corrupting)
    out = tmp_path / "fixed.gguf"
    result = dfbuild("draft", "fix", files["plain"], "--target", files["qwen35"], "--out", out)
    assert result.exit_code == 63 and "did not read back equal" in result.stderr
    assert "hashes differently" in result.stderr
    assert not out.exists() and len(calls) == 2


@pytest.mark.skipif(not Path(bench_draft_fix.TIME).exists(), reason="GNU time measures the peak RSS")
def test_fix_memory_does_not_grow_with_the_draft(files, tmp_path):
    """Peak RSS of `dfbuild draft fix` on a 256 MiB draft of real bytes stays far below its size (streamed)."""
    draft = bench_draft_fix.write_large_draft(tmp_path / "large.gguf", data_bytes=256 << 20)
    argv = [sys.executable, "-m", "dfbuild", "draft", "fix", str(draft), "--target", str(files["qwen35"]),
            "--out", str(tmp_path / "o.gguf")]
    _, rss_kib, rc = bench_draft_fix._run_child(argv)
    assert rc == 0
    assert rss_kib * 1024 < draft.stat().st_size / 2, f"peak RSS {rss_kib} KiB for a {draft.stat().st_size}-byte draft"


# --- bad input: a clear error with its code, never a traceback ---------------------------------------

def _fails(code: int, *args) -> str:
    for as_json in (False, True):
        result = dfbuild("draft", *[str(a) for a in args], *(["--json"] if as_json else []))
        assert result.exit_code == code, said(result)
        assert "Traceback" not in result.stderr and "error:" in result.stderr
        if as_json:
            assert json.loads(result.stdout)["code"] == code
    return result.stderr


@pytest.mark.parametrize("command", ["check", "fix"])
def test_not_a_gguf_is_60(files, tmp_path, command):
    text = tmp_path / "notes.gguf"
    text.write_text("these are not the weights you are looking for\n" * 4)
    extra = ["--out", tmp_path / "o.gguf"] if command == "fix" else []
    assert "not a GGUF file" in _fails(60, command, text, "--target", files["qwen35"], *extra)
    assert "not a GGUF file" in _fails(60, command, files["plain"], "--target", text, *extra)
    assert "does not exist" in _fails(60, command, tmp_path / "missing.gguf", "--target", files["qwen35"], *extra)
    assert "not a regular file" in _fails(60, command, tmp_path, "--target", files["qwen35"], *extra)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "fewer than a GGUF header" in _fails(60, command, empty, "--target", files["qwen35"], *extra)
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("keep", [30, 200, 4000, -100])
def test_a_truncated_draft_is_61(files, tmp_path, keep):
    """Cut in its counts (30), in a key (200), in the tensor infos or its data (4000), or short of its end."""
    data = files["plain"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    assert "damaged or truncated" in _fails(61, "check", cut, "--target", files["qwen35"])
    assert "damaged or truncated" in _fails(61, "fix", cut, "--target", files["qwen35"], "--out", tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_a_damaged_count_is_61_not_a_hang(files, tmp_path):
    data = bytearray(files["plain"].read_bytes())
    data[16:24] = (1 << 60).to_bytes(8, "little")  # the key count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert "claims" in _fails(61, "check", bad, "--target", files["qwen35"])


def test_not_a_dflash_draft_is_62(files, tmp_path):
    assert "pass the DFlash draft as DRAFT" in _fails(62, "check", files["qwen35"], "--target", files["plain"])
    assert "not a DFlash draft" in _fails(62, "check", files["mmproj"], "--target", files["qwen35"])
    assert "projector" in _fails(62, "check", files["plain"], "--target", files["mmproj"])
    assert "a DFlash draft, not the target" in _fails(62, "fix", files["plain"], "--target", files["random"],
                                                      "--out", tmp_path / "o.gguf")
