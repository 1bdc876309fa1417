"""One record of what was proved, and the curator's loop, on the synthetic repos of test_series / test_track.

series.toml's `[[epoch]]` tables record each epoch's proofs (where and when they were made); `track`
and `series check` read them there, so a fresh machine sees them too. The curator's commands
(`series start` / `continue`, `record`, `record-proof`, `epochs`) do by command what was done by hand.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import dfbuild, run_git, said
from test_prove import MOVED, fakes, run_prove  # noqa: F401  (fixtures)
from test_prove import upstream as prove_upstream
from test_series import (  # noqa: F401  (fixtures)
    BASE_LINES,
    SPEC,
    commit_edit,
    own_cache,
    syn,
    template,
    with_concerns,
)
from test_track import PR, by_name, stub_proofs, track, upstream  # noqa: F401  (fixtures)

from dfbuild import series

WHERE = "lent machine: 16 x86-64 cores; cpu, x64 variant"


def record_epoch(patches, first: str, last: str, variant: str, proofs: list[str], when: str = "2026-12-01") -> None:
    """Append an epoch with a fixed proof of each release in PROOFS to series.toml, as the curator wrote them
    (each naming the code of VARIANT it ran, as `series record-proof` does)."""
    code = series.load_series(patches).variant_code(variant)
    text = (f'\n[[epoch]]\nfirst = "{first}"\nlast = "{last}"\nvariant = "{variant}"\n'
            f'upstream_change = "the synthetic upstream moved on"\n')
    for release in proofs:
        text += (f'\n[[epoch.proof]]\nrelease = "{release}"\noutcome = "fixed"\n'
                 f'unpatched = "21 of 40 scenario runs failed with the upstream symptom"\n'
                 f'patched = "all 40 passed"\nfixtures = "all 11 sets load"\nwhere = "{WHERE}"\nwhen = "{when}"\n'
                 f'record = "dfbuild prove --base {release} --json"\ncode = "{code}"\n')
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


# --- the curator's loop: start, continue, record ------------------------------------------------------

HAND_LINE = '        LOG_DBG("pos_max < N-1 (upstream): tokens and positions differ");'


@pytest.fixture
def new_epoch(syn):
    """Release b120 opens an epoch: embedding-skip is upstream's own code now, and upstream reworded
    the warning that warning-downgrade changes, so that concern needs a hand."""
    lines = ["// synthetic common/speculative.cpp, reworded upstream"] + with_concerns(BASE_LINES, ["embedding-skip"])[1:]
    lines = [line.replace('LOG_WRN("pos_max < N-1");', 'LOG_WRN("pos_max < N-1 (upstream)");') for line in lines]
    commit_edit(syn.upstream, lines, "upstream : release b120")
    run_git(syn.upstream, "tag", "b120")
    return "b120"


def hand_edit(tree):
    """What the curator does by hand at the stop: downgrade upstream's reworded warning."""
    spec = tree / SPEC
    spec.write_text(spec.read_text().replace('        LOG_WRN("pos_max < N-1 (upstream)");', HAND_LINE))


def start(syn, tree, *args):
    return dfbuild("series", "start", "--base", "b120", "--repo", syn.upstream, "--dir", tree,
                   "--patches", syn.patches, *args)


def test_start_carries_what_carries_stops_at_a_conflict_and_continue_and_record_finish(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    result = start(syn, tree)

    assert result.exit_code == 21, said(result)  # stopped for a hand, as `git rebase` stops
    shown = said(result)
    assert "stopped at warning-downgrade" in shown and "hunk #1" in shown
    assert f"git -C {tree} commit -a -m 'SUBJECT' -m 'Dfbuild-Concern: warning-downgrade'" in shown
    assert f"dfbuild series continue --dir {tree}" in shown
    assert "embedding-skip: upstream, no commit: already in the tree" in shown
    # one commit per carried concern, in series order, each the variant's own message and trailer
    log = run_git(tree, "log", "--format=%s|%(trailers:key=Dfbuild-Concern,valueonly,separator=)",
                  "b120..HEAD").splitlines()
    assert log == ["spec : noise block at the draft cache's pos_max + 1|noise-block-base",
                   "spec : zero-fill the draft cache's hole|zero-fill"]
    saved = json.loads((tree / ".git" / "dfbuild" / "curate.json").read_text())
    assert saved["waiting"] == "warning-downgrade" and saved["todo"] == ["warning-downgrade"]

    refused = dfbuild("series", "continue", "--dir", tree, "--patches", syn.patches)  # nothing committed yet
    assert refused.exit_code != 0 and "Dfbuild-Concern: warning-downgrade" in said(refused)

    hand_edit(tree)
    run_git(tree, "commit", "-q", "-a", "-m", "spec : downgrade the warning", "-m", "Dfbuild-Concern: warning-downgrade")
    done = dfbuild("series", "continue", "--dir", tree, "--patches", syn.patches, "--json")
    assert done.exit_code == 0, said(done)
    assert json.loads(done.stdout)["finished"] is True

    recorded = dfbuild("series", "record", "--dir", tree, "--onto", "b120", "--patches", syn.patches, "--json")
    assert recorded.exit_code == 0, said(recorded)
    data = json.loads(recorded.stdout)
    assert [v["file"] for v in data["variants"]] == ["b120/0002-zero-fill.patch", "b120/0003-noise-block-base.patch",
                                                     "b120/0004-warning-downgrade.patch"]
    assert [d["id"] for d in data["decisions"]] == ["embedding-skip"]
    curated = series.load_series(syn.patches)
    assert curated.bases["b120"]["build"] == 120
    assert curated.concern("embedding-skip").variants["b120"].status == "upstream"
    fresh = tmp_path / "fresh"
    run_git(tmp_path, "clone", "-q", "--branch", "b120", str(syn.upstream), str(fresh))
    report = check_json(fresh, syn.patches)
    assert report["base"] == "b120" and [c["status"] for c in report["concerns"]] == ["upstream"] + ["clean"] * 3


def test_recording_a_base_again_keeps_what_series_toml_says_of_it(syn, new_epoch, tmp_path):
    """A variant revised on its own base (issue 44 rewrote every zero-fill variant so): `series start` carries
    the base's own files and decisions, the curator amends a commit, `series record` writes the files again.
    The base's note and its decisions' notes and markers are series.toml's words, not `series start`'s
    "upstream as recorded for b120: ..." nor record's default note (before: both replaced, markers lost)."""
    first = tmp_path / "first"
    assert start(syn, first).exit_code == 21
    hand_edit(first)
    run_git(first, "commit", "-q", "-a", "-m", "spec : downgrade the warning", "-m", "Dfbuild-Concern: warning-downgrade")
    assert dfbuild("series", "continue", "--dir", first, "--patches", syn.patches).exit_code == 0
    assert dfbuild("series", "record", "--dir", first, "--onto", "b120", "--patches", syn.patches).exit_code == 0
    toml = syn.patches / "series.toml"
    text = toml.read_text()
    assert text.count('note = "llama.cpp b120, the first release of its epoch (dfbuild series start)"') == 1
    # what a curator writes by hand: the base's note, and a marker for the upstream decision
    text = text.replace("llama.cpp b120, the first release of its epoch (dfbuild series start)",
                        "b120: upstream reworded the warning")
    text, n = re.subn(r'(b120 = \{status = "upstream", note = "[^"]*")\}', r'\1, marker = "reworded"}', text, count=1)
    assert n == 1  # (embedding-skip's, the first concern)
    toml.write_text(text)

    again = tmp_path / "again"
    result = start(syn, again)
    assert result.exit_code == 0, said(result)  # b120's own variant carries whole
    run_git(again, "commit", "-q", "--amend", "-m", "spec : downgrade the reworded warning",
            "-m", "Dfbuild-Concern: warning-downgrade")
    recorded = dfbuild("series", "record", "--dir", again, "--onto", "b120", "--patches", syn.patches)
    assert recorded.exit_code == 0, said(recorded)
    curated = series.load_series(syn.patches)
    assert curated.bases["b120"]["note"] == "b120: upstream reworded the warning"
    kept = curated.concern("embedding-skip").variants["b120"]
    assert (kept.status, kept.marker) == ("upstream", "reworded") and not kept.note.startswith("upstream as recorded")
    assert "downgrade the reworded warning" in (syn.patches / "b120" / "0004-warning-downgrade.patch").read_text()


def test_abort_puts_the_tree_back(syn, new_epoch, tmp_path):
    tree = tmp_path / "curate"
    assert start(syn, tree).exit_code == 21
    base, stopped = run_git(tree, "rev-parse", "b120^{commit}"), run_git(tree, "rev-parse", "HEAD")
    assert stopped != base
    again = start(syn, tree)  # a second start would lose the curation's commits: refused, tree untouched
    assert again.exit_code != 0 and "in progress" in said(again) and run_git(tree, "rev-parse", "HEAD") == stopped

    result = dfbuild("series", "continue", "--dir", tree, "--abort")
    assert result.exit_code == 0, said(result)
    assert run_git(tree, "rev-parse", "HEAD") == base
    assert not (tree / ".git" / "dfbuild" / "curate.json").exists()
    assert start(syn, tree, "--json").exit_code == 21  # and it starts over


# --- record-proof, epochs, adopt: proofs land in series.toml --------------------------------------------

MACHINE = {"cores": 16, "arch": "x86_64", "cpu": "AMD EPYC 9654", "system": "Linux 6.8"}


def prove_record(work, *releases: str):
    """WORK/proof-cpu.json as `dfbuild prove` leaves it: proofs under their keys."""
    proofs = {f"key-{name}": {
        "base": name, "backend": "cpu", "outcome": "fixed", "proven_at": "2026-12-02T10:00:00Z", "machine": MACHINE,
        "unpatched": {"passed": False, "runs": 40, "failed": [f"s{i}" for i in range(21)], "upstream_symptom": True},
        "patched": {"passed": True, "runs": 40, "failed": []},
        "fixtures_loaded": [f"set{i}" for i in range(11)], "smoke_table": {"table": "full"}} for name in releases}
    work.mkdir(parents=True, exist_ok=True)
    (work / "proof-cpu.json").write_text(json.dumps(proofs))
    return work


def test_record_proof_writes_each_proof_into_its_epoch_and_makes_none_silently(syn, tmp_path):
    work = prove_record(tmp_path / "work", "b100", "b110")
    toml = syn.patches / "series.toml"
    before = toml.read_text()

    refused = dfbuild("series", "record-proof", "--work", work, "--patches", syn.patches)
    assert refused.exit_code != 0 and "no epoch in series.toml holds b100" in said(refused)
    assert "--epoch-first" in said(refused) and toml.read_text() == before

    made = dfbuild("series", "record-proof", "--work", work, "--patches", syn.patches, "--epoch-first", "b100",
                   "--epoch-last", "b110", "--variant", "base1", "--change", "the synthetic upstream moved on")
    assert made.exit_code == 0, said(made)
    assert "new epoch b100..b110" in said(made)
    (epoch,) = series.load_series(syn.patches).epochs
    assert (epoch.first, epoch.last, epoch.variant) == (100, 110, "base1")
    assert [p["release"] for p in epoch.proofs] == ["b100", "b110"]
    proof = epoch.proofs[0]
    assert proof["unpatched"] == "21 of 40 scenario runs failed with the upstream symptom"
    assert proof["patched"] == "all 40 passed" and proof["fixtures"] == "all 11 sets load"
    assert proof["where"] == "16 x86_64 cores, AMD EPYC 9654, Linux 6.8; cpu, full table"
    assert proof["when"] == "2026-12-02T10:00:00Z"
    assert toml.read_text().startswith(before)  # appended: nothing the curator wrote is rewritten

    # proved again: the proof of the same release is replaced, not doubled
    again = dfbuild("series", "record-proof", "--work", work, "--patches", syn.patches)
    assert again.exit_code == 0 and "replaced" in said(again)
    assert len(series.load_series(syn.patches).epochs[0].proofs) == 2

    table = dfbuild("series", "epochs", "--patches", syn.patches)
    assert table.exit_code == 0
    assert "b100..b110 variant base1: the synthetic upstream moved on" in said(table)
    assert "b110 fixed: unpatched: 21 of 40" in said(table) and "2026-12-02T10:00:00Z" in said(table)
    data = json.loads(dfbuild("series", "epochs", "--patches", syn.patches, "--json").stdout)
    assert data["epochs"][0]["proofs"][1]["where"].startswith("16 x86_64 cores")


def test_adopt_records_the_proof_in_the_epoch_that_holds_the_base(syn, tmp_path, fakes):
    record_epoch(syn.patches, "b100", "b130", "base1", ["b100"])
    tag = prove_upstream(syn, tmp_path, MOVED)
    assert run_prove(syn, tmp_path, tag)["outcome"] == "fixed"

    result = dfbuild("series", "adopt", "--dir", tmp_path / "work" / "src", "--patches", syn.patches, "--json")
    assert result.exit_code == 0, said(result)
    (epoch,) = series.load_series(syn.patches).epochs
    assert [p["release"] for p in epoch.proofs] == ["b100", tag]
    assert epoch.proofs[1]["outcome"] == "fixed" and epoch.proofs[1]["when"]
    assert json.loads(result.stdout)["epoch_proof"]["release"] == tag
