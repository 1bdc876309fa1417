"""The GGUF fixtures: deterministic, shaped like llama.cpp expects, and loadable by real servers."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from realtrees import REAL_BASE, SLOW_BASES, server_for

from dfbuild import smoke
from dfbuild.cli import main
from dfbuild.core import paths
from dfbuild.smoke import fixtures

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    return fixtures.write_fixtures(tmp_path_factory.mktemp("fixtures"), seed=0)


def reader(path) -> "gguf.GGUFReader":
    return gguf.GGUFReader(str(path))


def kv(r, key):
    field = r.fields[key]
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode() for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]][0].item()


def tensor(r, name) -> np.ndarray:
    t = next(t for t in r.tensors if t.name == name)
    return np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)])


def ggml_shape(r, name) -> list[int]:
    return [int(n) for n in next(t for t in r.tensors if t.name == name).shape]


def logits_argmax(head: np.ndarray, hidden: np.ndarray) -> int:
    normed = hidden / np.sqrt(np.mean(hidden * hidden) + fixtures.RMS_EPS)
    return int(np.argmax(head @ normed))


# --- unit: content ----------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_other_bytes(written, tmp_path):
    again = fixtures.write_fixtures(tmp_path / "again", seed=0)
    other = fixtures.write_fixtures(tmp_path / "other", seed=1)
    for name, entry in written["files"].items():
        assert again["files"][name]["sha256"] == entry["sha256"], name
    assert other["files"][fixtures.FILES["llama-random"]]["sha256"] != written["files"][fixtures.FILES["llama-random"]]["sha256"]


def test_every_set_points_at_written_files(written):
    assert set(written["sets"]) == set(fixtures.FIXTURE_SETS)
    for entry in written["sets"].values():
        for role in ("target", "mmproj", "draft"):
            assert Path(entry[role]).is_file()
    assert json.loads((Path(written["dir"]) / fixtures.INDEX_NAME).read_text()) == written


def test_qwen35_target_is_the_hybrid_mrope_shape(written):
    r = reader(written["sets"]["qwen35-mlp-plain-agree"]["target"])
    assert kv(r, "general.architecture") == "qwen35"
    assert kv(r, "qwen35.rope.dimension_sections") == [3, 3, 2, 0]
    assert kv(r, "qwen35.full_attention_interval") == 2
    assert kv(r, "qwen35.block_count") == 4
    names = {t.name for t in r.tensors}
    # layers 1 and 3 attend (gated q: twice the head width), 0 and 2 are gated delta net
    assert ggml_shape(r, "blk.1.attn_q.weight") == [64, 2 * 4 * 16]
    assert {"blk.0.attn_qkv.weight", "blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias",
            "blk.0.ssm_out.weight", "blk.2.ssm_norm.weight"} <= names
    assert "blk.0.attn_q.weight" not in names and "blk.1.ssm_a" not in names
    assert all(f"blk.{i}.post_attention_norm.weight" in names for i in range(4))


def test_agree_target_and_draft_predict_the_same_letter(written):
    target = reader(written["sets"]["qwen35-mlp-plain-agree"]["target"])
    embd = tensor(target, "token_embd.weight")
    assert np.all(embd == embd[0])  # one vector for every token
    for name in ("blk.1.attn_output.weight", "blk.0.ssm_out.weight", "blk.3.ffn_down.weight"):
        assert not tensor(target, name).any(), name
    head = tensor(target, "output.weight")
    assert logits_argmax(head, embd[0]) == fixtures.letter_token("a")

    agree = reader(written["sets"]["qwen35-mlp-plain-agree"]["draft"])
    names = {t.name for t in agree.tensors}
    assert "token_embd.weight" not in names and "output.weight" not in names  # borrows the target's
    assert not tensor(agree, "blk.0.attn_output.weight").any() and not tensor(agree, "blk.0.ffn_down.weight").any()

    # the disagreeing draft borrows the same head (every DFlash loader from b9837 takes a draft
    # without one; b10355's refuses a draft that ships one) and negates its final norm
    disagree = reader(written["sets"]["qwen35-mlp-plain-disagree"]["draft"])
    assert "output.weight" not in {t.name for t in disagree.tensors}
    hidden = embd[0] * tensor(disagree, "output_norm.weight")  # rms_norm(v) == v: v has RMS 1
    assert logits_argmax(head, hidden) != fixtures.letter_token("a")
    assert len(disagree.tensors) == len(agree.tensors)


def test_dflash_drafts_carry_their_keys_and_only_sections_drafts_carry_rope_sections(written):
    plain = reader(written["sets"]["qwen35-grid-plain-agree"]["draft"])
    sections = reader(written["sets"]["qwen35-grid-sections-agree"]["draft"])
    for r in (plain, sections):
        assert kv(r, "general.architecture") == "dflash"
        assert kv(r, "dflash.block_size") == 4
        assert kv(r, "dflash.target_layers") == [1, 3]
        assert kv(r, "tokenizer.ggml.mask_token_id") == fixtures.MASK_ID
        assert ggml_shape(r, "fc.weight") == [2 * 64, 64]
    assert "dflash.rope.dimension_sections" not in plain.fields
    assert kv(sections, "dflash.rope.dimension_sections") == [8, 0, 0, 0]


def test_projectors(written):
    mlp = reader(written["sets"]["qwen35-mlp-plain-agree"]["mmproj"])
    grid = reader(written["sets"]["qwen35-grid-plain-agree"]["mmproj"])
    assert kv(mlp, "clip.projector_type") == "mlp"
    assert kv(grid, "clip.projector_type") == "qwen2vl_merger"
    for r in (mlp, grid):
        assert kv(r, "general.architecture") == "clip"
        assert kv(r, "clip.vision.projection_dim") == fixtures.N_EMBD  # must match the text model
    assert "v.patch_embd.weight.1" in {t.name for t in grid.tensors}


def test_random_models_only_write_ascii_letters(written):
    r = reader(written["sets"]["llama-mlp-random"]["target"])
    head = tensor(r, "output.weight")
    embd = tensor(r, "token_embd.weight")
    letters = {fixtures.letter_token(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    assert all(logits_argmax(head, embd[t]) in letters for t in range(0, fixtures.N_VOCAB, 7))


def test_test_images_are_valid_pngs(written):
    for label, path in written["images"].items():
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == fixtures.IMAGES[label]
        idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
        assert len(zlib.decompress(idat)) == height * (1 + 3 * width)


def test_ensure_fixtures_rewrites_a_damaged_dir(tmp_path):
    section = fixtures.ensure_fixtures(tmp_path)
    target = Path(section["sets"]["llama-mlp-agree"]["target"])
    target.write_bytes(b"broken")
    fixtures.ensure_fixtures(tmp_path)
    assert paths.sha256_file(target) == section["files"][target.name]["sha256"]


def test_cli_fixtures(tmp_path):
    result = CliRunner().invoke(main, ["fixtures", "--out", str(tmp_path / "fx"), "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)
    assert section["seed"] == 3
    assert "qwen35-grid-sections-disagree" in section["sets"]
    human = CliRunner().invoke(main, ["fixtures", "--out", str(tmp_path / "fx2")])
    assert human.exit_code == 0
    assert "qwen35-grid-plain-agree" in human.output


# --- integration: every set loads in the real servers ---------------------------------------


def server_binary_for(base: str) -> Path:
    """The unpatched llama-server of tree `base`, built (from the shared ccache) on first use."""
    return server_for(base, patched=False)


@pytest.mark.integration
@pytest.mark.slow
# REAL_BASE (b11434, the tree CI builds anyway) and the pinned bases in DFBUILD_TEST_BASES. `dfbuild prove`
# runs the same check on every base it proves, so each epoch's recorded proofs say its first release
# loads them all (tests/test_epochs.py reads that from series.toml).
@pytest.mark.parametrize("base", [b for b in (REAL_BASE, "b10355", "pydist-0.94.0", "b11312") if b in SLOW_BASES])
def test_every_fixture_set_loads_in_llama_server(base, written, tmp_path):
    problems = smoke.fixtures_that_do_not_load(server_binary_for(base), written, tmp_path)
    assert not problems, "\n".join(f"{name}: {why}" for name, why in problems.items())


def test_ensure_fixtures_rewrites_a_dir_written_before_a_set_was_added(tmp_path):
    # seen: a release's work dir whose fixtures an older dfbuild wrote (without qwen35-grid-sections-random)
    # failed its smoke with exit 40, "unknown fixture set", instead of writing the new set
    section = fixtures.ensure_fixtures(tmp_path)
    index = tmp_path / "fixtures.json"
    older = json.loads(index.read_text())
    dropped = sorted(older["sets"])[-1]
    del older["sets"][dropped]
    index.write_text(json.dumps(older))
    again = fixtures.ensure_fixtures(tmp_path)
    assert dropped in again["sets"] and sorted(again["sets"]) == sorted(section["sets"])
