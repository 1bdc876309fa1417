"""The upstream export of b11434 proves itself: `dfbuild series export --upstream --base b11434`, as a user runs it.

The export applies its own patch files with `git am` to a fresh checkout of b11434 in its proof work dir, builds
llama-server unpatched and patched there (dfbuild's build dir, the shared ccache), and runs the exported test
under b11434's own tools/server/tests harness with pytest, in a venv from the tree's requirements (or
$DFBUILD_UPSTREAM_PYTHON), offline (export_proof: the presets' preload is a no-op). These tests read what it
recorded, and show that the proof's check can fail: the same pytest run against the unpatched binary in place of
the patched one is refused with exit 28.

Cost (2 cores, -O1, warm ccache): about a minute for the export and its two builds, plus the venv once (PyPI).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import dfbuild, said
from realtrees import REAL_BASE, TEST_CPU_VARIANTS

from dfbuild.core.errors import ExportProofError
from dfbuild.export import proof as export_proof
from dfbuild.export.text import TEST_NAME

from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.export import upstream as export

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built and run on Linux"),
              pytest.mark.skipif(os.environ.get("DFBUILD_TEST_EXPORT_REAL") != "1",
                                 reason="opt-in (two builds of b11434 and a venv): set DFBUILD_TEST_EXPORT_REAL=1")]

SYMPTOM = "inconsistent sequence positions"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("export-real") / "export"
    result = dfbuild("series", "export", "--upstream", "--base", REAL_BASE, "--out", out, "--json",
                     "--author", "Ada Submitter <ada@example.org>",
                     *(["--cpu-variants", TEST_CPU_VARIANTS] if TEST_CPU_VARIANTS else []))
    assert result.exit_code == 0, said(result)
    return {"out": out, "record": json.loads(result.stdout), "stderr": result.stderr}


def test_the_b11434_export_fails_unpatched_and_passes_patched_under_upstreams_pytest(exported):
    proof = exported["record"]["proof"]
    assert (proof["unpatched"], proof["patched"]) == ("failed", "passed")
    assert SYMPTOM in proof["symptom"] and "HTTP 500" in proof["symptom"]
    assert re.fullmatch(r"1 failed in [\d.]+s", proof["summary"]["unpatched"][-1]), proof["summary"]
    assert re.fullmatch(r"1 passed in [\d.]+s", proof["summary"]["patched"][-1]), proof["summary"]
    assert proof["backend"] == "cpu"
    assert exported["record"]["target_arch"] == "hunyuan_vl"  # b11434's hunyuan-vl.cpp sets t_layer_inp
    on_disk = json.loads((exported["out"] / ".dfbuild-export.json").read_text())
    assert on_disk["proof"] == proof
    text = (exported["out"] / "PR.md").read_text()
    assert f"The new test on {REAL_BASE} (CPU build of llama-server)" in text
    assert f"| {REAL_BASE} | " in text and f"| {REAL_BASE} + this PR | `{proof['summary']['patched'][-1]}` |" in text
    assert "not recorded" not in text
    # nothing of dfbuild's bookkeeping: no comment of ours, no issue number of ours
    assert "dfbuild:" not in text and not re.search(r"\bissue \d+\b", text, re.IGNORECASE)
    print(json.dumps(proof, indent=1), file=sys.stderr)


def test_the_proof_refuses_a_patched_build_that_is_the_unpatched_one(exported):
    """The check can fail: the exported test against the unpatched binary twice is exit 28, naming both runs."""
    work = Path(exported["record"]["proof"]["work"])
    python = export_proof.harness_python(work / "src" / "tools" / "server" / "tests" / "requirements.txt")
    unpatched_server = next((work / "unpatched").glob("build-*/bin/llama-server"))
    runs = [export_proof.run_pytest(python, work / "src", unpatched_server, work / f"pytest-twice-{n}.log")
            for n in (1, 2)]
    with pytest.raises(ExportProofError) as refused:
        export_proof.verdict(REAL_BASE, runs[0], runs[1])
    assert refused.value.exit_code == 28
    message = str(refused.value)
    assert "unpatched failed (1 failed in" in message and "patched failed (1 failed in" in message
    assert "pytest-twice-1.log" in refused.value.hint and TEST_NAME in runs[0]["summary"][0]
