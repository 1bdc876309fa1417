"""The proof and adoption, on synthetic repos: builds and smoke runs stand in.

`prove` decides from behaviour: the unpatched and the patched tree are built
and smoked. Here the builds are skipped and a smoke stand-in fails a tree
whose speculative.cpp lacks the synthetic zero-fill line (the "bug"), so every
outcome comes out of the real decision code. Then `series adopt` turns a
proven carry into a recorded variant that `series check` recognises by blob.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import dfbuild, run_git, said
from test_series import (  # noqa: F401  (fixtures)
    BASE_LINES,
    IDS,
    SPEC,
    check,
    commit_edit,
    head,
    new_repo,
    own_cache,
    statuses,
    syn,
    template,
    text_of,
    with_concerns,
)

from dfbuild import series, smoke
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest, SmokeOptions
from dfbuild.core.errors import BuildError, FixtureError, SeriesFileError
from dfbuild.core.manifest import tree_manifest_path
from dfbuild.release import prove
from dfbuild.series import adopt

FIX_LINE = "fill_hole(st, b);"  # zero-fill's line: without it the (fake) server fails image requests


@pytest.fixture
def fakes(monkeypatch):
    """No compiler, no server: a build records its tree; smoke passes a tree that has the fix."""
    calls = {"build": [], "smoke": []}

    def build_tree(tree, backend, build_dir, **kwargs):
        calls["build"].append(str(tree))
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "tree").write_text(str(tree))
        (build_dir / "bin").mkdir(exist_ok=True)
        (build_dir / "bin" / "llama-server").write_text((Path(tree) / SPEC).read_text())  # the code it "runs"
        return {"build_dir": str(build_dir), "binaries": ["bin/llama-server"], "libraries": [],
                "source_commit": run_git(tree, "rev-parse", "HEAD"), "source_dirty": False}

    def run_smoke(build_dir, fixtures_dir, **kwargs):
        calls["smoke"].append(str(build_dir))
        fixed = FIX_LINE in (build_dir / "bin" / "llama-server").read_text() or calls.get("always_pass")
        broken = calls.get("always_fail")
        passed = bool(fixed) and not broken
        result = {"passed": passed, "requests": [{"status": 200 if passed else 500, "error": None}],
                  "log_findings": [] if passed else [{"pattern": "draft decode failed", "line": 7,
                                                      "text": "process: llama_process(ctx_dft) failed rc=-1"}],
                  "failures": [] if passed else ["HTTP 500"]}
        return {"passed": passed, "failed": [] if passed else ["image/qwen35-grid-plain-agree"],
                "results": {"image": {"qwen35-grid-plain-agree": result}}, "wall_s": 0.1,
                "log_dir": str(build_dir.parent / "logs")}

    monkeypatch.setattr(prove.build, "build_tree", build_tree)
    monkeypatch.setattr(prove.build, "source_commit", lambda tree: (run_git(tree, "rev-parse", "HEAD"), False))
    monkeypatch.setattr(prove.smoke, "run_smoke", run_smoke)
    monkeypatch.setattr(prove.fixtures, "ensure_fixtures", lambda d: {"files": {}, "sets": {}})
    return calls


def upstream(syn, tmp_path, lines, tag="b120"):
    """A new upstream release: the synthetic base moved on (a reworded first line), tagged TAG."""
    run_git(syn.upstream, "checkout", "-q", "-B", "master")
    commit_edit(syn.upstream, lines, f"upstream : release {tag}")
    run_git(syn.upstream, "tag", tag)
    return tag


MOVED = ["// synthetic common/speculative.cpp, reworded upstream"] + BASE_LINES[1:]


def run_prove(syn, tmp_path, tag):
    return prove.prove(tag, repo=str(syn.upstream), work=tmp_path / "work", patches_dir=syn.patches)


def test_carried_series_that_passes_where_upstream_fails_is_fixed(syn, tmp_path, fakes):
    tag = upstream(syn, tmp_path, MOVED)
    proof = run_prove(syn, tmp_path, tag)

    assert proof["outcome"] == "fixed" and proof["derived"] is True
    assert proof["unpatched"]["passed"] is False and proof["unpatched"]["upstream_symptom"] is True
    assert proof["patched"]["passed"] is True
    assert [(c["variant"], c["how"]) for c in proof["concerns"]] == [("base1", "exact")] * 4
    recorded = json.loads(tree_manifest_path(tmp_path / "work" / "src").read_text())
    assert recorded["series"]["proven"] is True and recorded["proof"]["outcome"] == "fixed"

    # the patched binaries' pass is remembered for a release of them; the unpatched failure is not
    work = tmp_path / "work"
    def remembered(build_dir):
        payload = build.payload_digest({"build_dir": str(build_dir), "binaries": ["bin/llama-server"]})
        # the synthetic tree is tagged b120: the table leaves out scenarios that start later (linear-image)
        applicable = [name for name in smoke.DEFAULT_SCENARIOS if smoke.SCENARIOS[name].applies_to(120)]
        assert "linear-image" not in applicable
        return smoke.recall(smoke.memo_key(payload, {"files": {}}, "cpu", scenarios=applicable))
    assert remembered(work / "build-cpu")["passed"] is True
    assert remembered(work / "unpatched" / "build-cpu") is None

    # a rerun recomputes nothing: same commits, fixtures and scenarios
    builds = len(fakes["build"])
    again = run_prove(syn, tmp_path, tag)
    assert again["outcome"] == "fixed" and len(fakes["build"]) == builds


def test_unpatched_tree_that_passes_is_fixed_upstream(syn, tmp_path, fakes):
    tag = upstream(syn, tmp_path, ["// reworded"] + with_concerns(BASE_LINES, ["zero-fill"])[1:])
    proof = run_prove(syn, tmp_path, tag)
    assert proof["outcome"] == "fixed-upstream"
    assert proof["patched"] is None  # nothing left to show once the tree as it is passes
    assert "zero-fill" not in proof["no_longer_needed"]  # it was in the tree already, not applied
    assert set(proof["no_longer_needed"]) == {"embedding-skip", "noise-block-base", "warning-downgrade"}


def test_patched_tree_that_still_fails_is_still_broken_and_names_the_failure(syn, tmp_path, fakes):
    fakes["always_fail"] = True
    proof = run_prove(syn, tmp_path, upstream(syn, tmp_path, MOVED))
    assert proof["outcome"] == "still-broken"
    assert proof["patched"]["first_failure"] == {"scenario": "image/qwen35-grid-plain-agree",
                                                  "log_line": "process: llama_process(ctx_dft) failed rc=-1"}


def test_conflict_and_not_applicable_build_nothing(syn, tmp_path, fakes):
    lines = list(MOVED)
    lines[lines.index('        LOG_WRN("pos_max < N-1");')] = '        LOG_WRN("pos_max < N-1, upstream");'
    proof = run_prove(syn, tmp_path, upstream(syn, tmp_path, lines, "b121"))
    assert proof["outcome"] == "conflict" and "warning-downgrade" in proof["reason"]

    no_dflash = [line.replace("dflash", "drafter") for line in MOVED]
    proof = prove.prove(upstream(syn, tmp_path, no_dflash, "b122"), repo=str(syn.upstream),
                        work=tmp_path / "work2", patches_dir=syn.patches)
    assert proof["outcome"] == "not-applicable"
    assert fakes["build"] == []


def test_cli_prove_exit_codes_say_the_outcome(syn, tmp_path, fakes):
    tag = upstream(syn, tmp_path, MOVED)
    result = dfbuild("prove", "--base", tag, "--repo", syn.upstream, "--work", tmp_path / "w", "--patches", syn.patches)
    assert result.exit_code == 0, said(result)
    assert f"{tag}: fixed" in said(result)
    fakes["always_fail"] = True
    result = dfbuild("prove", "--base", tag, "--repo", syn.upstream, "--work", tmp_path / "w2", "--patches",
                     syn.patches, "--json")
    assert result.exit_code == 43 and json.loads(result.stdout)["outcome"] == "still-broken"


def test_adopt_records_a_proven_carry_that_check_then_knows_by_blob(syn, tmp_path, fakes):
    tag = upstream(syn, tmp_path, MOVED)
    tree = tmp_path / "work" / "src"
    proof = run_prove(syn, tmp_path, tag)
    assert proof["outcome"] == "fixed"

    result = dfbuild("series", "adopt", "--dir", tree, "--patches", syn.patches, "--json")
    assert result.exit_code == 0, said(result)
    adopted = json.loads(result.stdout)
    assert adopted["base"] == tag and adopted["outcome"] == "fixed"
    assert [v["file"] for v in adopted["variants"]] == [f"{tag}/{n:04d}-{cid}.patch" for n, cid in enumerate(IDS, 1)]

    curated = series.load_series(syn.patches)  # sha256 of every new patch file checked on use
    assert curated.bases[tag]["blob"] == run_git(syn.upstream, "rev-parse", f"{tag}:{SPEC}")
    assert curated.bases[tag]["provenance"]["carried_from"]["zero-fill"] == "base1 exact"
    fresh = tmp_path / "fresh"
    run_git(tmp_path, "clone", "-q", "--branch", tag, str(syn.upstream), str(fresh))
    report = check(fresh, syn.patches)
    assert report["base"] == tag and statuses(report) == ["clean"] * 4  # a known base now: no carry


def test_adopt_refuses_what_was_not_proven(syn, tmp_path, fakes):
    tag = upstream(syn, tmp_path, MOVED)
    tree = tmp_path / "tree"
    run_git(tmp_path, "clone", "-q", "--branch", tag, str(syn.upstream), str(tree))
    series.apply_series(syn.load(), tree)
    with pytest.raises(SeriesFileError):
        adopt.adopt(syn.load(), tree)  # carried, but no proof ran on it


# --- one compile: the patched build is an incremental rebuild of the unpatched one ------------------
# A real cmake + ninja build of the synthetic tree: its speculative.cpp compiles against a stand-in
# speculative.h, and llama-server says which commit it was built from and whether the fix ran.

SPEC_H = """\
#pragma once
#include <vector>
typedef std::vector<int> tokens;
struct batch { int n_tokens = 1; bool embd = false; };
struct dflash { int n_past = 0; int pos_max = 0; tokens prompt; bool filled = false; };
static tokens noise;
inline void mirror(dflash &, const batch &, int) {}
inline void fill_hole(dflash & st, const batch &) { st.filled = true; }
inline void decode(dflash &, int, const tokens &) {}
inline int sample(dflash &) { return 0; }
#define LOG_WRN(...) ((void) 0)
#define LOG_DBG(...) ((void) 0)
""" + "".join(f"inline void draft_step_{i:02d}() {{}}\n" for i in range(1, 13))

BUILT_SERVER = """\
#include <cstdio>
#include "../../common/speculative.h"
extern char const * LLAMA_COMMIT;
int process(dflash & st, const batch & b);
int main() {
    dflash st;
    process(st, batch());
    std::printf("commit %s fixed=%d\\n", LLAMA_COMMIT, st.filled ? 1 : 0);
    return 0;
}
"""

BUILT_CMAKE = """\
cmake_minimum_required(VERSION 3.16)
project(fakellama C CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/.git/index")
configure_file(common/build-info.cpp.in ${CMAKE_BINARY_DIR}/common/build-info.cpp)
add_library(ggml SHARED ggml/ggml.c)
target_compile_definitions(ggml PRIVATE GGML_COMMIT="${LLAMA_BUILD_COMMIT}")
add_library(llama-common SHARED common/speculative.cpp ${CMAKE_BINARY_DIR}/common/build-info.cpp src/llama.c)
target_link_libraries(llama-common PRIVATE ggml)
add_executable(llama-server tools/server/server.cpp)
target_link_libraries(llama-server PRIVATE llama-common)
"""


@pytest.fixture
def buildable(syn, tmp_path, monkeypatch):
    """An unseen release of the synthetic tree that really builds; smoke runs its llama-server."""
    files = {"CMakeLists.txt": BUILT_CMAKE, "common/speculative.h": SPEC_H,
             "common/build-info.cpp.in": 'char const * LLAMA_COMMIT = "@LLAMA_BUILD_COMMIT@";\n',
             "ggml/ggml.c": "const char * ggml_commit(void) { return GGML_COMMIT; }\n",
             "src/llama.c": "int llama_answer(void) { return 42; }\n",
             "tools/server/server.cpp": BUILT_SERVER}
    run_git(syn.upstream, "checkout", "-q", "-B", "master")
    for rel, text in files.items():
        (syn.upstream / rel).parent.mkdir(parents=True, exist_ok=True)
        (syn.upstream / rel).write_text(text)
    tag = upstream(syn, tmp_path, MOVED)  # commits the build files with the release
    runs = []

    def run_smoke(build_dir, fixtures_dir, **kwargs):
        out = subprocess.run([str(Path(build_dir) / "bin" / "llama-server")], capture_output=True, text=True,
                             check=True).stdout
        runs.append((Path(build_dir), out.strip()))
        passed = "fixed=1" in out
        result = {"passed": passed, "log_findings": [], "failures": [] if passed else ["HTTP 500"]}
        return {"passed": passed, "failed": [] if passed else ["image/qwen35-grid-plain-agree"],
                "results": {"image": {"qwen35-grid-plain-agree": result}}, "wall_s": 0.1}

    monkeypatch.setattr(prove.smoke, "run_smoke", run_smoke)
    monkeypatch.setattr(prove.smoke, "upstream_symptom", lambda result: not result["passed"])
    monkeypatch.setattr(prove.fixtures, "ensure_fixtures", lambda d: {"files": {}, "sets": {}})
    return tag, runs


def compiled_in_last_build(build_dir: Path) -> list[str]:
    """The objects ninja compiled in the build dir's last build, from the log dfbuild keeps."""
    log = (build_dir / build.LOG_NAME).read_text()
    return sorted(Path(line.split()[-1]).name for line in log.splitlines()
                  if line.startswith("[") and "] Building " in line)


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the stand-in is built with the host's C/C++ compiler")
def test_an_unseen_base_compiles_once_and_its_patched_build_compiles_only_the_patch_and_the_stamp(
        syn, tmp_path, buildable):
    tag, runs = buildable
    work = tmp_path / "work"
    proof = prove.prove(tag, repo=str(syn.upstream), work=work, patches_dir=syn.patches,
                        request=BuildRequest(use_ccache=False))
    assert proof["outcome"] == "fixed", proof

    # one build dir, built twice: the patched build recompiled the patched file and the version stamp only
    builds = proof["builds"]
    assert builds["unpatched"]["build_dir"] == builds["patched"]["build_dir"] == str(work / "build-cpu")
    assert builds["unpatched"]["compiled_steps"] >= 4  # the cold build: everything
    assert sorted(Path(o).name for o in builds["patched"]["compiled_objects"]) == [
        "build-info.cpp.o", "speculative.cpp.o"]
    assert compiled_in_last_build(work / "build-cpu") == ["build-info.cpp.o", "speculative.cpp.o"]
    assert not (work / "unpatched" / "src").exists()  # no second tree to build

    # smoke ran the unpatched binaries (the base commit, without the fix), then the patched ones
    unpatched_dir = work / "unpatched" / "build-cpu"
    assert runs == [(unpatched_dir, f"commit {proof['unpatched_commit']} fixed=0"),
                    (work / "build-cpu", f"commit {proof['patched_commit']} fixed=1")]
    assert proof["unpatched_commit"] == run_git(syn.upstream, "rev-parse", tag)
    assert run_git(work / "src", "rev-parse", "HEAD") == proof["patched_commit"]  # the tree is back on it
    assert run_git(work / "src", "symbolic-ref", "--short", "HEAD") == f"dfbuild/{tag}"
    # the kept copy is bin/ only, and runs on its own (RUNPATH $ORIGIN: its own libraries, not the patched ones)
    assert {p.name for p in unpatched_dir.iterdir()} == {"bin", prove.UNPATCHED_RECORD}
    shutil.rmtree(work / "build-cpu" / "bin")
    out = subprocess.run([str(unpatched_dir / "bin" / "llama-server")], capture_output=True, text=True).stdout
    assert out.strip() == f"commit {proof['unpatched_commit']} fixed=0"


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the stand-in is built with the host's C/C++ compiler")
def test_the_unpatched_copy_is_reused_checked_and_never_a_patched_build(syn, tmp_path, buildable, monkeypatch):
    tag, runs = buildable
    work = tmp_path / "work"
    request = BuildRequest(use_ccache=False)
    prove.prove(tag, repo=str(syn.upstream), work=work, patches_dir=syn.patches, request=request)
    tree, folder = work / "src", work / "unpatched" / "build-cpu"
    base = run_git(syn.upstream, "rev-parse", tag)

    # the same request again: the copy is reused, no build runs
    monkeypatch.setattr(prove.build, "build_tree", lambda *a, **k: pytest.fail("built again"))
    kept = prove.build_unpatched(tree, request, work, base)
    assert kept["reused"] and kept["source_commit"] == base and kept["build_dir"] == str(folder)
    monkeypatch.undo()

    # a build that turns out not to be of the base (here: faked as the patched commit) is never kept
    real = build.build_tree

    def wrong_commit(*args, **kwargs):
        section = real(*args, **kwargs)
        return {**section, "source_commit": run_git(tree, "rev-parse", "dfbuild/" + tag)}

    (folder / "bin" / "llama-server").write_bytes(b"tampered")  # the record no longer matches: rebuild
    monkeypatch.setattr(prove.build, "build_tree", wrong_commit)
    with pytest.raises(BuildError):
        prove.build_unpatched(tree, request, work, base)
    assert (folder / "bin" / "llama-server").read_bytes() == b"tampered"  # not replaced by that build
    assert not list(folder.parent.glob(".build-cpu.*"))
    assert run_git(tree, "symbolic-ref", "--short", "HEAD") == f"dfbuild/{tag}"  # back on the patched commit
    monkeypatch.undo()

    # a real rebuild replaces the damaged copy whole, with the base's binaries
    again = prove.build_unpatched(tree, request, work, base)
    assert not again["reused"]
    out = subprocess.run([str(folder / "bin" / "llama-server")], capture_output=True, text=True).stdout
    assert out.strip() == f"commit {base} fixed=0"


def test_a_fixture_set_the_base_cannot_load_is_no_proof(syn, tmp_path, fakes, monkeypatch):
    """b10355's loader refused a draft that shipped its own head: every scenario of that set would
    fail on both trees, so a proof must stop, say which set, and record nothing."""
    def refuse(binary, fixtures_section, log_dir, **kwargs):
        return {"qwen35-mlp-plain-disagree": "llama-server exited: wrong number of tensors; expected 15, got 14"}

    monkeypatch.setattr(prove.smoke, "fixtures_that_do_not_load", refuse)
    tag = upstream(syn, tmp_path, MOVED)
    with pytest.raises(FixtureError) as raised:
        run_prove(syn, tmp_path, tag)
    assert "qwen35-mlp-plain-disagree" in raised.value.message and "expected 15, got 14" in raised.value.message
    assert not fakes["smoke"]  # no scenario ran
    assert not (tmp_path / "work" / "proof-cpu.json").exists()


def test_prove_takes_the_toolchain_options_a_release_takes(tmp_path, monkeypatch):
    """A Vulkan proof on Debian 12 needs newer headers, a CUDA one its architectures: as for release."""
    seen = {}

    def fake_prove(base, **kwargs):
        seen["request"] = kwargs["request"]
        return {"base": base, "outcome": "fixed", "json": True}

    monkeypatch.setattr(prove, "prove", fake_prove)
    from dfbuild.host import doctor

    checked = []  # the toolchain is checked before any work, with the same headers (stood in for here)
    monkeypatch.setattr(doctor, "require", lambda backend, host=None, **kw: checked.append((backend, kw)) or {})
    headers = tmp_path / "include"
    headers.mkdir()
    result = dfbuild("prove", "--base", "b11434", "--backend", "vulkan", "--vulkan-include-dir", headers,
                     "--cuda-arch", "90", "--work", tmp_path / "work", "--json")
    assert result.exit_code == 0, said(result)
    assert seen["request"].vulkan_include_dir == headers and seen["request"].cuda_arch == "90"
    assert checked == [("vulkan", {"extra_include_dirs": [headers]})]


def test_a_gpu_proof_is_reused_only_where_it_ran(syn, tmp_path, fakes, monkeypatch):
    """Issue 31: a GPU backend's proof runs on its device or says it did not, and a proof made on the CPU
    (--allow-cpu-fallback) is not reused once the device is there."""
    from dfbuild.core.errors import NoDeviceError

    listed: list[str] = []
    monkeypatch.setattr(prove.smoke.devices, "list_devices", lambda binary, env=None, timeout=0: list(listed))
    tag = upstream(syn, tmp_path, MOVED)

    def run(**options):
        return prove.prove(tag, request=BuildRequest("vulkan", smoke=SmokeOptions(**options)),
                           repo=str(syn.upstream), work=tmp_path / "work", patches_dir=syn.patches)

    with pytest.raises(NoDeviceError):
        run()
    assert not fakes["smoke"]
    on_cpu = run(allow_cpu_fallback=True)
    assert on_cpu["outcome"] == "fixed"
    assert (on_cpu["smoke_table"]["ran_on"], on_cpu["smoke_table"]["cpu_fallback"]) == (
        "no Vulkan device here, ran on the CPU backend", True)
    smokes = len(fakes["smoke"])
    assert run(allow_cpu_fallback=True)["outcome"] == "fixed" and len(fakes["smoke"]) == smokes  # same place: reused
    listed[:] = ["Vulkan0: NVIDIA H200 (NVIDIA) (143771 MiB, 142000 MiB free)"]
    on_gpu = run()
    assert len(fakes["smoke"]) > smokes, "a proof on the CPU is no proof on the GPU"
    assert (on_gpu["smoke_table"]["ran_on"], on_gpu["smoke_table"]["cpu_fallback"]) == (
        "Vulkan0: NVIDIA H200 (NVIDIA)", False)
    smokes = len(fakes["smoke"])
    assert run()["outcome"] == "fixed" and len(fakes["smoke"]) == smokes  # the same device: reused
