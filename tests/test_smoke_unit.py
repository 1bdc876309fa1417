"""Unit tests of the smoke stage against a fake llama-server (fast, no llama.cpp)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfbuild import smoke
from dfbuild.cli import main
from dfbuild.core import errors, paths
from dfbuild.host import backends
from dfbuild.release import prove

FAKE = Path(__file__).with_name("fake_llama_server.py")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the fake server is a script with a shebang")


def make_build_dir(root: Path) -> Path:
    """A build dir whose bin/llama-server is the fake server script."""
    binary = smoke.server_binary(root)
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(FAKE)!r}\n"
                      f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return root


@pytest.fixture
def build_dir(tmp_path) -> Path:
    return make_build_dir(tmp_path / "build")


def fake_env(mode: str) -> dict:
    return {"FAKE_SERVER_MODE": mode}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- the server handle ---------------------------------------------------------------


def test_server_starts_healthy_and_always_stops(build_dir, tmp_path):
    log = tmp_path / "server.log"
    with smoke.LlamaServer(smoke.server_binary(build_dir), ["-m", "x.gguf"], log, env=fake_env("ok")) as server:
        assert server.alive()
        assert server.request("GET", "/health").status == 200
        assert server.command[-4:] == ["--host", "127.0.0.1", "--port", str(server.port)]
        pid = server.process.pid
    assert not server.alive()
    assert not pid_alive(pid)
    text = log.read_text()
    assert text.startswith("$ ")  # the command line heads the log
    assert "listening on" in text


def test_server_is_stopped_when_the_body_raises(build_dir, tmp_path):
    server = smoke.LlamaServer(smoke.server_binary(build_dir), [], tmp_path / "s.log", env=fake_env("ok"))
    with pytest.raises(RuntimeError):
        with server:
            raise RuntimeError("test body failed")
    assert server.process.poll() is not None


def test_server_that_exits_early_raises_with_its_log(build_dir, tmp_path):
    server = smoke.LlamaServer(smoke.server_binary(build_dir), [], tmp_path / "s.log", env=fake_env("exit-early"))
    with pytest.raises(errors.ServerStartError) as info:
        server.start()
    assert "exited with code 3" in info.value.message
    assert "failed to load model" in info.value.message
    assert info.value.exit_code == 42


def test_server_ignoring_sigterm_is_killed(build_dir, tmp_path):
    server = smoke.LlamaServer(smoke.server_binary(build_dir), [], tmp_path / "s.log", env=fake_env("ignore-sigterm"),
                               stop_timeout=0.5)
    server.start()
    pid = server.process.pid
    server.stop()
    assert not pid_alive(pid)


def test_missing_binary_is_a_server_start_error(tmp_path):
    with pytest.raises(errors.ServerStartError, match="no llama-server"):
        smoke.LlamaServer(tmp_path / "bin" / "llama-server", [], tmp_path / "s.log").start()


def test_inherited_llama_arg_variables_are_dropped(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_ARG_N_PARALLEL", "8")
    server = smoke.LlamaServer(tmp_path / "llama-server", [], tmp_path / "s.log", env={"X": "1"})
    assert "LLAMA_ARG_N_PARALLEL" not in server.env
    assert server.env["X"] == "1"


# --- responses, logs, metrics ------------------------------------------------------------


def test_a_stream_that_fails_behind_200_is_a_failure():
    text = 'data: {"content": "a"}\n\ndata: {"error": {"code": 500, "message": "boom"}}\n\n'
    resp = smoke.Response(200, None, text, smoke.parse_sse(text))
    assert resp.error and "boom" in resp.error


def test_a_good_stream_has_content_and_timings():
    text = 'data: {"content": "a"}\n\ndata: {"content": "b", "timings": {"draft_n": 3}}\n\ndata: [DONE]\n\n'
    resp = smoke.Response(200, None, text, smoke.parse_sse(text))
    assert resp.error is None
    assert resp.content == "ab"
    assert resp.timings == {"draft_n": 3}


def test_non_200_is_a_failure():
    assert "HTTP 500" in smoke.Response(500, {"error": {}}, '{"error": {}}').error


UPSTREAM_LOG = """\
0.00.111.542 W find_slot: non-consecutive token position 16 after 15 for sequence 0 with 16 new tokens
0.00.122.847 E init: the tokens of sequence 0 in the input batch have inconsistent sequence positions:
 - the last position stored in the memory module of the context (i.e. the KV cache) for sequence 0 is X = 16
0.00.122.900 E process: llama_decode(ctx_dft) failed rc=-1 (n_tokens=40, offset=0)
0.00.123.000 E srv  send_error: task id = 0, error: failed to process mtmd chunk
"""


def test_scan_log_finds_each_upstream_symptom_and_nothing_else():
    findings = smoke.scan_log(UPSTREAM_LOG)
    assert [f["pattern"] for f in findings] == ["inconsistent positions", "draft decode failed", "mtmd chunk failed"]
    assert [f["line"] for f in findings] == [2, 4, 5]
    assert smoke.scan_log("0.00.1 W find_slot: non-consecutive token position 16 after 15\nall good\n") == []


def test_scan_log_knows_the_newer_name_of_the_failing_draft_call():
    # b11434 renamed the draft's decode: the same failure reads llama_process(ctx_dft)
    line = "0.01.002.117 E process: llama_process(ctx_dft) failed rc=-1 (n_tokens=9, offset=0)"
    assert [f["pattern"] for f in smoke.scan_log(line)] == ["draft decode failed"]


def test_prometheus_counters():
    text = "# HELP x\nllamacpp:spec_decode_num_draft_tokens_total 12\nllamacpp:n_busy_slots_per_decode 1.5\n"
    assert smoke.prometheus_counters(text) == {"spec_decode_num_draft_tokens_total": 12.0, "n_busy_slots_per_decode": 1.5}


def test_merge_args_lets_scenario_flags_win():
    assert smoke.scenarios._merge_args(["-m", "t", "-np", "1", "--metrics"], ["-np", "2"]) == ["-m", "t", "--metrics", "-np", "2"]
    assert smoke.scenarios._merge_args(["-m", "t", "--metrics"], ["--metrics"]) == ["-m", "t", "--metrics"]


def test_every_image_prompt_has_text_after_the_image():
    # a prompt that ends with an image aborts upstream servers (GGML_ASSERT(batch.size() > 0))
    for scenario in smoke.SCENARIOS.values():
        for step in scenario.steps:
            if step.has_image:
                assert not step.text.rstrip().endswith("{media}"), step.label
                assert step.text.count("{media}") == len(step.images), step.label


# --- the verdict -------------------------------------------------------------------------


def step(label="image", image=True, error=None, content="aaaa", drafted=6, accepted=6, **extra):
    return {"label": label, "image": image, "error": error, "content": content, "status": 500 if error else 200,
            "draft_n": drafted, "draft_n_accepted": accepted, "metrics_drafted_before": 0.0,
            "metrics_accepted_before": 0.0, "metrics_drafted_after": float(drafted),
            "metrics_accepted_after": float(accepted), **extra}


AGREE = {"agree": True}
DISAGREE = {"agree": False}
RANDOM = {"agree": None}


def verdict(fixture_set, spec, base=None, alive=True, findings=()):
    return smoke.judge(fixture_set, spec, base if base is not None else [dict(s) for s in spec],
                       alive=alive, log_findings=list(findings))


def test_judge_passes_a_clean_agreeing_run():
    result = verdict(AGREE, [step("text", image=False), step()])
    assert result["passed"], result["failures"]
    assert result["acceptance"] == 1.0
    assert result["image_drafted"] == 6 and result["image_accepted"] == 6
    assert result["identical_to_no_spec"] is True
    assert result["drafted_before"] == 0.0 and result["drafted_after"] == 6.0


def test_judge_fails_on_http_error():
    result = verdict(AGREE, [step(error="HTTP 500: boom", drafted=0, accepted=0)])
    assert not result["passed"]
    assert result["statuses"] == [500]
    assert any("HTTP 500" in f for f in result["failures"])


def test_judge_fails_on_a_dead_server_and_on_log_findings():
    assert not verdict(AGREE, [step()], alive=False)["passed"]
    finding = {"pattern": "draft decode failed", "line": 3, "text": "llama_decode(ctx_dft) failed"}
    result = verdict(AGREE, [step()], findings=[finding])
    assert not result["passed"]
    assert any("llama_decode(ctx_dft)" in f for f in result["failures"])


def test_judge_requires_drafts_on_image_requests_when_agreeing():
    result = verdict(AGREE, [step("text", image=False), step(drafted=0, accepted=0)])
    assert not result["passed"]
    assert any("no drafts on an image request" in f for f in result["failures"])


def test_judge_requires_acceptance_when_agreeing():
    result = verdict(AGREE, [step(drafted=10, accepted=5)])
    assert not result["passed"]
    assert result["acceptance"] == 0.5


def test_judge_requires_rejection_when_disagreeing():
    assert verdict(DISAGREE, [step(drafted=10, accepted=0)])["passed"]
    assert not verdict(DISAGREE, [step(drafted=10, accepted=10)])["passed"]


def test_judge_checks_no_acceptance_with_random_weights():
    assert verdict(RANDOM, [step(drafted=10, accepted=3)])["passed"]


def test_judge_fails_when_output_differs_from_no_spec():
    spec = [step(content="abc")]
    result = verdict(RANDOM, spec, base=[step(content="abd")])
    assert not result["passed"]
    assert result["identical_to_no_spec"] is False


def test_judge_fails_when_the_baseline_fails():
    result = verdict(RANDOM, [step()], base=[step(error="HTTP 500: x")])
    assert not result["passed"]
    assert result["identical_to_no_spec"] is False


# --- end to end on the fake server ------------------------------------------------------------


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory) -> Path:
    from dfbuild.smoke import fixtures

    out = tmp_path_factory.mktemp("fixtures")
    fixtures.write_fixtures(out)
    return out


def test_run_smoke_passes_on_a_good_server(build_dir, fixtures_dir, tmp_path):
    section = smoke.run_smoke(build_dir, fixtures_dir, sets=["qwen35-grid-plain-agree"], scenarios=["image", "parallel"],
                              log_dir=tmp_path / "logs", env=fake_env("ok"))
    assert section["passed"], section["failed"]
    result = section["results"]["image"]["qwen35-grid-plain-agree"]
    assert result["statuses"] == [200, 200]
    assert result["image_accepted"] == 2 * 12
    assert result["drafted_before"] == 0 and result["drafted_after"] == 24
    assert result["identical_to_no_spec"] is True
    parallel = section["results"]["parallel"]["qwen35-grid-plain-agree"]
    assert "-np" in parallel["server_args"] and parallel["server_args"][parallel["server_args"].index("-np") + 1] == "2"


def test_run_smoke_reports_the_upstream_failure(build_dir, fixtures_dir, tmp_path):
    section = smoke.run_smoke(build_dir, fixtures_dir, sets=["qwen35-mlp-plain-agree"], scenarios=["text", "image"],
                              log_dir=tmp_path / "logs", env=fake_env("bug"))
    assert not section["passed"]
    assert section["failed"] == ["image/qwen35-mlp-plain-agree"]
    image = section["results"]["image"]["qwen35-mlp-plain-agree"]
    assert image["statuses"] == [500, 200]  # the streamed request fails behind a 200
    assert any("stream error event" in f for f in image["failures"])
    assert "inconsistent sequence positions" in image["failure_excerpt"]


def test_run_smoke_catches_rejected_drafts(build_dir, fixtures_dir, tmp_path):
    section = smoke.run_smoke(build_dir, fixtures_dir, sets=["llama-mlp-agree"], scenarios=["image"],
                              log_dir=tmp_path / "logs", env=fake_env("reject-drafts"))
    assert not section["passed"]
    assert any("none accepted" in f for f in section["results"]["image"]["llama-mlp-agree"]["failures"])


def test_run_smoke_rejects_unknown_names(build_dir, fixtures_dir):
    with pytest.raises(errors.FixtureError):
        smoke.run_smoke(build_dir, fixtures_dir, sets=["nope"])
    with pytest.raises(errors.SmokeFailedError):
        smoke.run_smoke(build_dir, fixtures_dir, scenarios=["nope"])


def test_cli_smoke_exit_codes_and_json(build_dir, fixtures_dir, tmp_path, monkeypatch):
    runner = CliRunner()
    args = ["smoke", "--build-dir", str(build_dir), "--fixtures", str(fixtures_dir), "--set", "qwen35-mlp-plain-agree",
            "--scenario", "image", "--log-dir", str(tmp_path / "logs")]

    monkeypatch.setenv("FAKE_SERVER_MODE", "ok")
    ok = runner.invoke(main, args + ["--json"])
    assert ok.exit_code == 0, ok.output
    section = json.loads(ok.stdout)
    assert section["results"]["image"]["qwen35-mlp-plain-agree"]["passed"] is True

    monkeypatch.setenv("FAKE_SERVER_MODE", "bug")
    bad = runner.invoke(main, args)
    assert bad.exit_code == errors.SmokeFailedError.exit_code
    assert "smoke failed: image/qwen35-mlp-plain-agree" in bad.output


def test_the_plain_baseline_runs_once_per_target_and_mmproj(build_dir, fixtures_dir, tmp_path):
    sets = ["qwen35-mlp-plain-agree", "qwen35-mlp-sections-agree", "llama-mlp-agree"]
    section = smoke.run_smoke(build_dir, fixtures_dir, sets=sets, scenarios=["text"], log_dir=tmp_path / "logs",
                              env=fake_env("ok"))
    assert section["passed"], section["failed"]
    baselines = sorted(p.name for p in (tmp_path / "logs").glob("*--nospec.log"))
    assert baselines == ["text--llama-mlp-agree--nospec.log", "text--qwen35-mlp-plain-agree--nospec.log"]
    assert all(r["identical_to_no_spec"] for r in section["results"]["text"].values())


def test_a_port_taken_before_bind_is_retried_on_a_new_port(build_dir, tmp_path):
    env = {"FAKE_SERVER_MODE": "busy-port-once", "FAKE_SERVER_FLAG": str(tmp_path / "tried")}
    with smoke.LlamaServer(smoke.server_binary(build_dir), [], tmp_path / "s.log", env=env) as server:
        assert server.request("GET", "/health").status == 200
    assert (tmp_path / "tried").exists()


def test_only_a_passed_run_is_remembered_and_an_unreadable_record_counts_as_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    fx = {"seed": 0, "files": {"a.gguf": {"sha256": "1" * 64}}}
    key = smoke.memo_key("payload", fx, "cpu")
    assert smoke.recall(key) is None
    smoke.remember(key, {"passed": False, "failed": ["image/x"]})
    assert smoke.recall(key) is None  # a failure always runs again
    smoke.remember(key, {"passed": True, "failed": []})
    assert smoke.recall(key) == {"passed": True, "failed": []}
    # anything that decides the outcome is in the key
    assert len({key, smoke.memo_key("other payload", fx, "cpu"), smoke.memo_key("payload", fx, "vulkan"),
                smoke.memo_key("payload", {**fx, "seed": 1}, "cpu"),
                smoke.memo_key("payload", fx, "cpu", scenarios=["image"])}) == 5
    # and so is what the record holds: a pass recorded in an older layout is no pass for today's manifest
    monkeypatch.setattr(smoke.memo, "RECORD_LAYOUT", smoke.memo.RECORD_LAYOUT - 1)
    assert smoke.recall(smoke.memo_key("payload", fx, "cpu")) is None
    monkeypatch.undo()
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    smoke.memo._memo_path(key).write_text("{ half written")
    assert smoke.recall(key) is None


# --- linear-image: a linear image's rows reach the draft with the target's features -----------


def test_linear_image_fails_when_an_image_span_is_zero_filled(build_dir, tmp_path):
    """The scenario reads the draft's debug log (-v): a zero-filled span on a linear target fails it."""
    fixtures_dir = tmp_path / "fx"
    for mode, passed in (("ok", True), ("zero-fill-images", False)):
        section = smoke.run_smoke(build_dir, fixtures_dir, sets=["llama-mlp-agree"], scenarios=["linear-image"],
                                  env=fake_env(mode), log_dir=tmp_path / mode)
        result = section["results"]["linear-image"]["llama-mlp-agree"]
        assert result["passed"] is passed, result["failures"]
        assert "-v" in result["server_args"]
        if not passed:
            assert result["zero_filled"] == [[16, 32]] * 2  # the two image requests (the text one fills nothing)
            assert "draft positions [16, 32)" in result["failures"][-1]


def test_linear_image_runs_only_on_linear_sets_and_from_b10355(build_dir, tmp_path):
    section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-agree", "qwen35-grid-plain-agree"],
                              scenarios=["linear-image"], env=fake_env("ok"), log_dir=tmp_path / "logs")
    assert list(section["results"]["linear-image"]) == ["llama-mlp-agree"]  # an M-RoPE set zero-fills by design
    scenario = smoke.SCENARIOS["linear-image"]
    assert not scenario.applies_to(10338) and scenario.applies_to(10355) and scenario.applies_to(None)
    how = backends.get("cpu")
    assert "linear-image" not in smoke.plan(how, build_dir, release=9837).scenarios
    assert "linear-image" in smoke.plan(how, build_dir, release=10901).scenarios
    assert "linear-image" in smoke.plan(how, build_dir).scenarios  # unknown release: better a check too many


# --- the edge cases of embedding-skip's first/last test (issue 29) -----------------------------


def test_single_row_chunk_runs_on_grid_sets_and_fails_when_no_piece_holds_one_row(build_dir, tmp_path):
    sets = ["qwen35-grid-plain-agree", "qwen35-mlp-plain-agree"]
    section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=sets, scenarios=["single-row-chunk"],
                              env=fake_env("ok"), log_dir=tmp_path / "ok")
    results = section["results"]["single-row-chunk"]
    assert list(results) == ["qwen35-grid-plain-agree"]  # 2-D grid: rows pinned to one position
    assert results["qwen35-grid-plain-agree"]["passed"], results["qwen35-grid-plain-agree"]["failures"]
    # a split with no one-row piece (9 rows in -b 16) never reaches the case: the scenario says so
    missed = smoke.run_smoke(build_dir, tmp_path / "fx", sets=sets[:1], scenarios=["single-row-chunk"],
                             env=fake_env("ok"), log_dir=tmp_path / "missed", extra_server_args=("-b", "16"))
    result = missed["results"]["single-row-chunk"]["qwen35-grid-plain-agree"]
    assert not result["passed"] and "did not reach its case" in result["failures"][-1]
    assert "single-row-chunk" not in smoke.DEFAULT_SCENARIOS and "mixed-batch" not in smoke.DEFAULT_SCENARIOS


def test_mixed_batch_sends_an_image_to_the_embeddings_endpoint_and_asks_no_drafts(build_dir, tmp_path):
    section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["qwen35-grid-plain-agree"], scenarios=["mixed-batch"],
                              env=fake_env("ok"), log_dir=tmp_path / "ok")
    result = section["results"]["mixed-batch"]["qwen35-grid-plain-agree"]
    assert result["passed"], result["failures"]
    assert result["requests"][0]["generates"] is False and result["requests"][0]["status"] == 200
    assert "--embeddings" in result["server_args"] and "qwen35.attention.causal=bool:false" in result["server_args"]
    # a completion on an agreeing set still must draft: the exemption is for embeddings steps only
    verdict = smoke.judge({"agree": True}, [step(drafted=0, accepted=0, generates=True)], None,
                          alive=True, log_findings=[])
    assert not verdict["passed"]


# --- slot-restore: a prefix the draft never processed, and begin()'s warning (issue 29) ----------


def test_slot_restore_runs_on_llama_sets_and_reuses_the_restored_prompt(build_dir, tmp_path):
    sets = ["llama-mlp-agree", "qwen35-grid-plain-agree"]
    section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=sets, scenarios=["slot-restore"],
                              env=fake_env("ok"), log_dir=tmp_path / "ok")
    results = section["results"]["slot-restore"]
    assert list(results) == ["llama-mlp-agree"]  # the hybrid qwen35 target re-processes a restored prompt
    result = results["llama-mlp-agree"]
    assert result["passed"], result["failures"]
    labels = [r["label"] for r in result["requests"]]
    assert labels == ["restore-long", "slot-save", "slot-erase", "restore-other", "slot-restore", "restored-prefix"]
    assert result["statuses"] == [200] * 6
    args = result["server_args"]
    assert "-v" in args and Path(args[args.index("--slot-save-path") + 1]).is_dir()
    assert (Path(args[args.index("--slot-save-path") + 1]) / smoke.SLOT_FILE).is_file()  # the save wrote it there
    assert result["begin_warnings"] == []
    assert "slot-restore" in smoke.EDGE_SCENARIOS and "slot-restore" not in smoke.DEFAULT_SCENARIOS


def test_slot_restore_fails_like_the_upstream_bug_and_when_the_prefix_is_not_reused(build_dir, tmp_path):
    bug = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-agree"], scenarios=["slot-restore"],
                          env=fake_env("bug"), log_dir=tmp_path / "bug")["results"]["slot-restore"]["llama-mlp-agree"]
    assert not bug["passed"] and bug["upstream_symptom"]
    assert bug["statuses"][-1] == 500 and bug["failures"][0].startswith("restored-prefix: HTTP 500")
    unused = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-agree"], scenarios=["slot-restore"],
                             env=fake_env("restore-unused"), log_dir=tmp_path / "unused")
    result = unused["results"]["slot-restore"]["llama-mlp-agree"]
    assert not result["passed"] and "did not reach its case" in result["failures"][-1]


def test_begin_warnings_are_recorded_and_not_judged(build_dir, tmp_path):
    section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-agree"], scenarios=["text"],
                              env=fake_env("begin-warning"), log_dir=tmp_path / "warn")
    result = section["results"]["text"]["llama-mlp-agree"]
    assert result["passed"], result["failures"]
    assert result["begin_warnings"] == [[111, 114], [111, 114]]  # the two requests


def test_begin_warning_matches_upstreams_warning_line_only():
    line = "begin: ctx_dft pos_max=111 < N-1=114 - process() did not run on every prefill ubatch. Drafts may degrade."
    assert smoke.begin_warnings(f"0.00.135.687 W {line}\n") == [(111, 114)]
    assert smoke.begin_warnings(f"W {line}") == [(111, 114)]
    assert smoke.begin_warnings(line) == [(111, 114)]  # a log without levels
    assert smoke.begin_warnings(f"x\n0.00.1 W begin: ctx_dft pos_max=-1 < N-1=5 - process() did not run on every "
                                "prefill ubatch.\n") == [(-1, 5)]
    # the same words demoted to debug (what the old warning-downgrade patch did), printed at -v: not a warning
    assert smoke.begin_warnings(f"0.00.113.964 D {line}") == []
    assert smoke.begin_warnings(f"D {line}") == []
    # another implementation's line (N-2), and a log without the line
    assert smoke.begin_warnings("0.1 W spec        begin: ctx_dft pos_max=3 < N-2=9 — process() did not run") == []
    assert smoke.begin_warnings("0.1 D spec      process: seq_id=0: zero-filling draft positions [33, 709)") == []


def test_an_unpacked_release_archive_is_smoked_where_llama_cpp_puts_its_server(tmp_path):
    """llama.cpp's layout (issue 36): llama-<tag>/llama-server, no bin/; a build dir keeps bin/ first."""
    unpacked = tmp_path / "llama-b1-dflash-0"
    unpacked.mkdir()
    (unpacked / "llama-server").write_text("#!/bin/sh\n")
    assert smoke.server_binary(unpacked) == unpacked / "llama-server"
    (unpacked / "bin").mkdir()
    (unpacked / "bin" / "llama-server").write_text("#!/bin/sh\n")
    assert smoke.server_binary(unpacked) == unpacked / "bin" / "llama-server"
    assert smoke.server_binary(tmp_path / "empty") == tmp_path / "empty" / "bin" / "llama-server"


# --- issue 37: the cases that work unpatched, the bug's case, and how a fill is logged -----------


def test_the_cases_that_work_unpatched_and_the_bugs_case_run_where_they_mean_something(build_dir, tmp_path):
    sets = ["llama-mlp-agree", "qwen35-grid-plain-agree", "qwen35-grid-sections-agree", "qwen35-grid-sections-random"]
    names = ["mrope-draft", "empty-draft-cache", "pinned-image-hole"]
    section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=sets, scenarios=names, env=fake_env("gated"),
                              log_dir=tmp_path / "logs")
    results = section["results"]
    assert section["passed"], section["failed"]
    assert list(results["mrope-draft"]) == ["qwen35-grid-sections-agree", "qwen35-grid-sections-random"]
    assert list(results["empty-draft-cache"]) == ["llama-mlp-agree"]  # a target that reuses a restored prefix
    empty = results["empty-draft-cache"]["llama-mlp-agree"]
    assert empty["fills"] == [] and "restore-other" not in [q["label"] for q in empty["requests"]]
    assert list(results["pinned-image-hole"]) == ["qwen35-grid-plain-agree"]  # a plain-rope draft, an M-RoPE target
    for name in ("mrope-draft", "empty-draft-cache", "linear-image"):
        scenario = smoke.SCENARIOS[name]
        assert scenario.unpatched == "same" and "-v" in scenario.server_args and name in smoke.DEFAULT_SCENARIOS
    assert smoke.SCENARIOS["pinned-image-hole"].unpatched == "fails" and "pinned-image-hole" in smoke.DEFAULT_SCENARIOS
    # drafts honour rope sections from b10662: before it, a sections draft is one more plain-rope draft
    assert not smoke.SCENARIOS["mrope-draft"].applies_to(10644) and smoke.SCENARIOS["mrope-draft"].applies_to(10662)
    assert {"qwen35-grid-sections-random", "llama-mlp-random"} <= set(smoke.DEFAULT_SETS)  # drafts that depend on
    # their cache
    same = results["mrope-draft"]["qwen35-grid-sections-random"]
    assert same["draft_trace"]["lines"] == 3 * 3 and len(same["draft_trace"]["sha256"]) == 64  # three completions
    assert results["pinned-image-hole"]["qwen35-grid-plain-agree"]["fills"] == [[16, 32, "warn"]]
    assert "draft_trace" not in results["pinned-image-hole"]["qwen35-grid-plain-agree"]


def test_every_zero_fill_warns(build_dir, tmp_path):
    """Issue 44: every fill warns, an image's as a restored prefix's (the draft goes on without that context;
    no state tells the two apart). A fill without the warning fails the run: issue 37's series, which
    logged a left-out image's span at debug level, and the series before it, which logged every fill so."""
    def run(mode, sets, scenarios):
        section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=sets, scenarios=scenarios, env=fake_env(mode),
                                  log_dir=tmp_path / mode)
        return section["results"][scenarios[0]][sets[0]]

    warned = run("gated", ["qwen35-grid-plain-agree"], ["image"])
    assert warned["passed"] and warned["fills"] == [[16, 32, "warn"], [16, 32, "warn"]]
    quiet = run("debug-fill", ["qwen35-grid-plain-agree"], ["pinned-image-hole"])  # (debug: at -v only)
    assert not quiet["passed"] and "zero-filled without a warning: [16, 32)" in quiet["failures"][-1]
    assert quiet["fills"] == [[16, 32, "debug"]]
    restored = run("gated", ["llama-mlp-agree"], ["slot-restore"])
    assert restored["passed"], restored["failures"]
    assert restored["fills"] == [[33, 709, "warn"]]
    # the series before issue 37 filled a restored prefix in its one debug wording: silent, so it fails
    silent = run("zero-fill-images", ["llama-mlp-agree"], ["slot-restore"])
    assert not silent["passed"] and "without a warning" in silent["failures"][-1]
    # and it filled an empty draft cache too, where nothing fails unpatched: the proof's comparison says so
    unpatched = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-random"], scenarios=["empty-draft-cache"],
                                env=fake_env("ok"), log_dir=tmp_path / "empty-ok")
    ungated = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-random"], scenarios=["empty-draft-cache"],
                              env=fake_env("zero-fill-images"), log_dir=tmp_path / "empty-ungated")
    assert unpatched["passed"] and not ungated["passed"]  # (a fill without the warning)
    held = prove.hold_to_unpatched(unpatched, ungated)
    assert not ungated["passed"] and "[0, 709)" in held["differ"][0]["problems"][-1]


def test_a_patched_build_is_held_to_the_unpatched_one_where_the_case_works(tmp_path):
    unpatched_dir, patched_dir = make_build_dir(tmp_path / "u"), make_build_dir(tmp_path / "p")
    sets, scenarios = ["qwen35-grid-sections-random"], ["mrope-draft"]

    def smoke_run(build, mode):
        return smoke.run_smoke(build, tmp_path / "fx", sets=sets, scenarios=scenarios, env=fake_env(mode),
                               log_dir=tmp_path / f"{build.name}-{mode}")

    unpatched = smoke_run(unpatched_dir, "ok")
    same = smoke_run(patched_dir, "ok")
    held = prove.hold_to_unpatched(unpatched, same)
    assert same["passed"] and held == {"same": ["mrope-draft/qwen35-grid-sections-random"], "differ": [],
                                       "not_failing_unpatched": []}
    # what a changed draft cache shows: other candidates; the old ungated series: a fill where none was
    # (the smoke alone cannot tell other candidates; a fill it tells by its missing warning, issue 44)
    for mode, words, smoke_alone in (("other-drafts", "the draft proposed other candidates", True),
                                     ("zero-fill-images", "which the unpatched build left as they were", False)):
        patched = smoke_run(patched_dir, mode)
        assert patched["passed"] == smoke_alone
        held = prove.hold_to_unpatched(unpatched, patched)
        assert not patched["passed"] and patched["failed"] == ["mrope-draft/qwen35-grid-sections-random"]
        failures = patched["results"]["mrope-draft"]["qwen35-grid-sections-random"]["failures"]
        assert any(words in failure for failure in failures), failures
        assert held["differ"][0]["run"] == "mrope-draft/qwen35-grid-sections-random"
    # where the unpatched run fails, the case does not work at that base: nothing to hold the patched run to
    broken = smoke_run(unpatched_dir, "bug")
    other = smoke_run(patched_dir, "other-drafts")
    assert prove.hold_to_unpatched(broken, other)["same"] == [] and other["passed"]


def test_the_bugs_case_must_fail_unpatched_and_be_filled_patched(tmp_path):
    unpatched_dir, patched_dir = make_build_dir(tmp_path / "u"), make_build_dir(tmp_path / "p")
    sets, scenarios = ["qwen35-grid-plain-agree"], ["pinned-image-hole"]

    def smoke_run(build, mode):
        return smoke.run_smoke(build, tmp_path / "fx", sets=sets, scenarios=scenarios, env=fake_env(mode),
                               log_dir=tmp_path / f"{build.name}-{mode}")

    bug = smoke_run(unpatched_dir, "bug")
    assert not bug["passed"]
    gated = smoke_run(patched_dir, "gated")
    held = prove.hold_to_unpatched(bug, gated)
    assert gated["passed"] and held["not_failing_unpatched"] == [] and held["differ"] == []
    unfilled = smoke_run(patched_dir, "ok")  # a fix that does not fill (or fills without saying so)
    prove.hold_to_unpatched(bug, unfilled)
    assert not unfilled["passed"]
    failures = unfilled["results"]["pinned-image-hole"][sets[0]]["failures"]
    assert "no zero-fill of the left-out image's span" in failures[-1]
    # an unpatched build that passes here is recorded: the case no longer fails at that base
    assert prove.hold_to_unpatched(smoke_run(unpatched_dir, "ok"), smoke_run(patched_dir, "gated"))[
        "not_failing_unpatched"] == ["pinned-image-hole/qwen35-grid-plain-agree"]


def test_slot_scenarios_run_only_where_a_server_with_a_projector_saves_a_slot():
    # b9837's llama-server answers a slot save with HTTP 501 whenever a projector is loaded (its proof on
    # the lent GPU machine failed empty-draft-cache both ways for that reason); b10054 saves a text slot
    for name in ("empty-draft-cache", "slot-restore"):
        scenario = smoke.SCENARIOS[name]
        assert not scenario.applies_to(9837) and not scenario.applies_to(10042), name
        assert scenario.applies_to(10054) and scenario.applies_to(11434) and scenario.applies_to(None), name
