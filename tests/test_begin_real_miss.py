"""A real draft-cache miss, on real b11434 builds (issue 29): does begin()'s warning still fire?

warning-downgrade is a recorded decision ("not-needed") at every base: begin()'s
`pos_max < N-1` warning stays as upstream wrote it. This shows what that warning can see,
on the unpatched build and on today's series:

- tests/data/begin_real_miss.cpp, compiled against the build's libllama-common, feeds a
  prompt to the target in ubatches and leaves one of them out of process(). A missed *last*
  ubatch leaves the draft cache short at begin(): the warning is printed, patched or not. A
  missed *middle* one is zero-filled by the series before begin() runs (begin() does not warn;
  the fill's own warning names the span), and fails the next ubatch unpatched.
- The same program linked with a copy of the tree's speculative.cpp whose begin() says it
  with LOG_DBG (what the old warning-downgrade patch did) prints nothing at the default
  verbosity: the check below fails there, so it can fail.
- The slot-restore smoke scenario: llama-server's slot restore is the one server path that
  gives the target a prefix the draft never processed. Unpatched it fails with the upstream
  symptom; patched it passes, the hole zero-filled, and begin() has nothing to warn about.

Opt-in (it needs b11434 built unpatched and patched, CPU): DFBUILD_TEST_REAL_MISS=1. The
builds are realtrees' (built when missing), or DFBUILD_TEST_REAL_MISS_BUILDS=PATCHED,UNPATCHED
names two build dirs made elsewhere (each with bin/; the patched one's CMakeCache.txt names the
tree whose headers both are compiled with: the series changes no header). Read, never changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild import smoke
from dfbuild.smoke import fixtures

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built and run on Linux"),
              pytest.mark.skipif(os.environ.get("DFBUILD_TEST_REAL_MISS") != "1",
                                 reason="needs b11434 built unpatched and patched: set DFBUILD_TEST_REAL_MISS=1")]

PROGRAM = Path(__file__).with_name("data") / "begin_real_miss.cpp"
PROMPT = ("The quick brown fox jumps over the lazy dog. Once more: the quick brown fox jumps over the lazy dog "
          "again and again")  # 115 tokens: 8 ubatches of 16, the last one 3
RESULT = re.compile(r"pieces=(\d+) missed=(\d+) n_prompt=(\d+) draft_pos_max=(-?\d+)")
# begin()'s line in b11434's DFlash implementation; the demoted copy says it with LOG_DBG
WARN_CALL = 'LOG_WRN("%s: ctx_dft pos_max=%d < N-1=%d - process() did not run on every prefill ubatch. "'


def build_dirs() -> dict[str, Path]:
    named = os.environ.get("DFBUILD_TEST_REAL_MISS_BUILDS", "").strip()
    if named:
        patched, unpatched = (Path(p) for p in named.split(","))
        return {"patched": patched, "unpatched": unpatched}
    from realtrees import REAL_BASE, server_for

    return {"patched": server_for(REAL_BASE, patched=True).parent.parent,
            "unpatched": server_for(REAL_BASE, patched=False).parent.parent}


def cache_value(build_dir: Path, key: str) -> str:
    text = (build_dir / "CMakeCache.txt").read_text(errors="replace")
    found = re.search(rf"^{re.escape(key)}:[A-Z]+=(.*)$", text, re.MULTILINE)
    assert found, f"{key} not in {build_dir}/CMakeCache.txt"
    return found.group(1)


def compile_program(build_dir: Path, configured: Path, where: Path, extra_sources: tuple[Path, ...] = ()) -> Path:
    """The program, built into a copy of BUILD_DIR's bin/ (the CPU backends load from beside it), with
    the headers and compiler of CONFIGURED (a build dir with its CMakeCache.txt: the unpatched build
    the proof keeps is its bin/ only)."""
    bin_dir = where / "bin"
    shutil.copytree(build_dir / "bin", bin_dir, symlinks=True)
    src = Path(cache_value(configured, "CMAKE_HOME_DIRECTORY"))
    program = bin_dir / "begin-real-miss"
    subprocess.run([cache_value(configured, "CMAKE_CXX_COMPILER"), "-std=c++17", "-O1",
                    "-DGGML_BACKEND_DL", "-DGGML_SHARED", "-DLLAMA_SHARED",
                    *[f"-I{src / d}" for d in ("include", "common", "ggml/include", "vendor")],
                    str(PROGRAM), *map(str, extra_sources), "-o", str(program), f"-L{bin_dir}",
                    "-lllama-common", "-lllama", "-lggml", "-lggml-base", "-Wl,-rpath,$ORIGIN"],
                   check=True, capture_output=True, text=True, timeout=600)
    return program


def run_program(program: Path, fx: dict, miss: str, *extra: str) -> dict:
    chosen = fx["sets"]["llama-mlp-agree"]
    done = subprocess.run([str(program), "--miss", miss, "-m", chosen["target"], "-md", chosen["draft"],
                           "--spec-type", "draft-dflash", "-p", PROMPT, "-c", "512", "-ub", "16", "-b", "16",
                           "-t", "1", *extra], capture_output=True, text=True, timeout=300)
    found = RESULT.search(done.stdout)
    assert found, f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    pieces, missed, n_prompt, pos_max = map(int, found.groups())
    return {"rc": done.returncode, "pieces": pieces, "missed": missed, "n_prompt": n_prompt, "pos_max": pos_max,
            "warnings": smoke.begin_warnings(done.stderr), "zero_filled": smoke.zero_filled_spans(done.stderr),
            "log": done.stderr}


@pytest.fixture(scope="module")
def builds():
    return build_dirs()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return fixtures.ensure_fixtures(tmp_path_factory.mktemp("fixtures"))


def test_a_missed_last_ubatch_warns_patched_and_unpatched(builds, fx, tmp_path):
    for name, build_dir in builds.items():
        program = compile_program(build_dir, builds["patched"], tmp_path / name)
        full = run_program(program, fx, "none")
        assert full["rc"] == 0 and full["warnings"] == [] and full["pos_max"] == full["n_prompt"] - 1, (name, full)
        last = run_program(program, fx, "last")
        short = full["n_prompt"] - 1 - last["pos_max"]  # the last ubatch's tokens, which the draft never saw
        assert last["rc"] == 0 and 0 < short <= 16, (name, last)
        assert last["warnings"] == [(last["pos_max"], last["n_prompt"] - 1)], (name, last["log"][-2000:])

        middle = run_program(program, fx, "middle", "-v")
        if name == "patched":  # zero-fill mirrors the missed ubatch's span before the next one: nothing to warn of
            assert middle["rc"] == 0 and middle["warnings"] == [], middle["log"][-2000:]
            assert middle["pos_max"] == middle["n_prompt"] - 1
            assert len(middle["zero_filled"]) == 1 and middle["zero_filled"][0][1] - middle["zero_filled"][0][0] == 16
        else:  # the next ubatch does not continue the draft cache: process() refuses it, begin() warns
            assert middle["rc"] == 2 and "inconsistent sequence positions" in middle["log"], middle["log"][-2000:]
            assert middle["warnings"] == [(middle["pos_max"], middle["n_prompt"] - 1)]


def test_the_check_fails_where_the_warning_is_demoted_to_debug(builds, fx, tmp_path):
    build_dir = builds["patched"]
    source = Path(cache_value(build_dir, "CMAKE_HOME_DIRECTORY")) / "common" / "speculative.cpp"
    text = source.read_text()
    assert text.count(WARN_CALL) == 1, "begin()'s warning is not upstream's b11434 line here"
    demoted = tmp_path / "speculative.cpp"
    demoted.write_text(text.replace(WARN_CALL, WARN_CALL.replace("LOG_WRN", "LOG_DBG")))
    # the program's own copy of speculative.cpp wins over the library's (ELF interposition)
    program = compile_program(build_dir, build_dir, tmp_path / "demoted", (demoted,))
    quiet = run_program(program, fx, "last")
    assert quiet["pos_max"] < quiet["n_prompt"] - 1  # the same real miss
    assert quiet["warnings"] == [] and "begin: ctx_dft" not in quiet["log"]
    loud = run_program(program, fx, "last", "-v")  # at -v the line is there, as a debug line: still no warning
    assert loud["warnings"] == [] and re.search(r" D begin: ctx_dft pos_max=\d+ < N-1=\d+", loud["log"])


def test_a_restored_slot_fails_unpatched_and_is_zero_filled_patched(builds, tmp_path):
    outcome = {}
    for name, build_dir in builds.items():
        section = smoke.run_smoke(build_dir, tmp_path / "fx", sets=["llama-mlp-agree", "llama-mlp-random"],
                                  scenarios=["slot-restore"], log_dir=tmp_path / name)
        outcome[name] = section["results"]["slot-restore"]
    for set_name, result in outcome["unpatched"].items():
        assert not result["passed"] and result["upstream_symptom"], (set_name, result["failures"])
        assert result["statuses"][-1] == 500
    for set_name, result in outcome["patched"].items():
        assert result["passed"], (set_name, result["failures"])
        assert result["identical_to_no_spec"] is True and result["begin_warnings"] == []
        log = Path(result["log"]).read_text(errors="replace")
        assert re.search(r"zero-filling draft positions \[\d+, \d+\)", log), set_name
