"""One record of what was proved, and the curator's loop, on the synthetic repos of test_series / test_track.

series.toml's `[[epoch]]` tables record each epoch's proofs (where and when they were made); `track`
and `series check` read them there, so a fresh machine sees them too. The curator's commands
(`series start` / `continue`, `record`, `record-proof`, `epochs`) do by command what was done by hand.
"""

from __future__ import annotations

import json

from dfbuild import prove as prove_stage

from helpers import dfbuild, run_git, said
from test_series import (  # noqa: F401  (fixtures)
    own_cache,
    syn,
    template,
)
from test_track import PR, by_name, stub_proofs, track, upstream  # noqa: F401  (fixtures)

WHERE = "lent machine: 16 x86-64 cores; cpu, x64 variant"


def record_epoch(patches, first: str, last: str, variant: str, proofs: list[str], when: str = "2026-12-01") -> None:
    """Append an epoch with a fixed proof of each release in PROOFS to series.toml, as the curator wrote them."""
    text = (f'\n[[epoch]]\nfirst = "{first}"\nlast = "{last}"\nvariant = "{variant}"\n'
            f'upstream_change = "the synthetic upstream moved on"\n')
    for release in proofs:
        text += (f'\n[[epoch.proof]]\nrelease = "{release}"\noutcome = "fixed"\n'
                 f'unpatched = "21 of 40 scenario runs failed with the upstream symptom"\n'
                 f'patched = "all 40 passed"\nfixtures = "all 11 sets load"\nwhere = "{WHERE}"\nwhen = "{when}"\n'
                 f'record = "dfbuild prove --base {release} --json"\n')
    with open(patches / "series.toml", "a") as out:
        out.write(text)


# --- one record: track and series check read the proofs series.toml records ------------------------


def test_track_shows_a_proof_series_toml_records_on_a_fresh_machine(syn, upstream, tmp_path, monkeypatch):
    record_epoch(syn.patches, "b100", "b102", "base1", ["b100", "b102"])

    result, report = track(syn, tmp_path, "--pr", "0")  # a fresh state file: nothing proven on this machine

    assert result.exit_code == 0, said(result)
    entries = by_name(report)
    assert entries["b102"]["outcome"] == "fixed"
    assert entries["b102"]["recorded_in"] == "patches/series.toml"
    assert entries["b102"]["where"] == WHERE and entries["b102"]["when"] == "2026-12-01"
    assert "21 of 40" in entries["b102"]["detail"]
    assert entries["b101"]["outcome"] is None and "b102" not in report["pending"]
    shown = said(dfbuild("track", "--repo", upstream, "--pr", "0", "--patches", syn.patches,
                         "--state", tmp_path / "state.json"))
    assert "recorded in patches/series.toml" in shown and "2026-12-01" in shown and "16 x86-64 cores" in shown

    # --prove proves what nobody recorded; a proof made here shows as this machine's own
    asked = stub_proofs(monkeypatch, {f"b{n}": "fixed" for n in range(101, 106)})
    _, report = track(syn, tmp_path, "--prove", "--pr", "0")
    assert "b102" not in asked and "b101" in asked
    entries = by_name(report)
    assert entries["b101"]["recorded_in"] == str(tmp_path / "state.json")
    assert entries["b101"]["where"].startswith("this machine")
    assert entries["b102"]["recorded_in"] == "patches/series.toml"


def check_json(tree, patches) -> dict:
    result = dfbuild("series", "check", "--dir", tree, "--patches", patches, "--json")
    assert result.exit_code == 0, said(result)
    return json.loads(result.stdout)


def test_series_check_shows_the_epoch_and_its_recorded_proof(syn, upstream, tmp_path):
    record_epoch(syn.patches, "b100", "b102", "base1", ["b100", "b102"])
    proven, between = tmp_path / "b102", tmp_path / "b101"
    for tag, where in (("b102", proven), ("b101", between)):
        run_git(tmp_path, "clone", "-q", "--branch", tag, str(upstream), str(where))

    report = check_json(proven, syn.patches)
    assert report["release"] == "b102" and report["epoch"]["name"] == "b100..b102"
    assert report["proof"]["release"] == "b102" and report["proof"]["where"] == WHERE
    shown = said(dfbuild("series", "check", "--dir", proven, "--patches", syn.patches))
    assert "epoch b100..b102" in shown and "proven: b102 fixed" in shown
    assert f"{WHERE}, 2026-12-01 (recorded in patches/series.toml)" in shown

    # a release between the ends: not proven itself; what its epoch was proven on is shown
    report = check_json(between, syn.patches)
    assert report["release"] == "b101" and report["proof"] is None
    assert [p["release"] for p in report["epoch_proofs"]] == ["b100", "b102"]
    shown = said(dfbuild("series", "check", "--dir", between, "--patches", syn.patches))
    assert "b101 itself is not proven" in shown and "b100 fixed" in shown and "b102 fixed" in shown
