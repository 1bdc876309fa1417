"""The shipped variants are tied to the exact upstream files they were made for."""

from __future__ import annotations

import re

from dfbuild import series


def test_each_base_variant_starts_from_that_base_blob():
    """The first patch of every base names the base's speculative.cpp blob in its index line.

    That is how the 5ecbe1a variant (whose tree cannot be fetched here) is pinned to
    blob b69ab195..., the file it was verified against with zero fuzz.
    """
    curated = series.load_series()
    for base, info in curated.bases.items():
        patches = [c.variants[base] for c in curated.concerns
                   if base in c.variants and c.variants[base].status == "patch"]
        assert patches, base
        first = series.patch_path(curated, patches[0]).read_text(encoding="utf-8")
        index = re.search(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})", first, re.M)
        # made_on: the tree a variant was made on when the base's own tree cannot be read here
        # (5ecbe1a: one commit later, with the same context around every hunk; see its made_on_note)
        assert index and index.group(1) == info.get("made_on", info["blob"]), (base, patches[0].file)
        if "made_on" in info:
            assert info.get("made_on_note"), f"{base}: made_on needs the note that says why"


def test_later_patches_continue_from_the_previous_one():
    curated = series.load_series()
    for base in curated.bases:
        patches = [c.variants[base] for c in curated.concerns
                   if base in c.variants and c.variants[base].status == "patch"]
        blobs = [re.search(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})",
                           series.patch_path(curated, v).read_text(encoding="utf-8"), re.M).groups()
                 for v in patches]
        for (_, after), (before, _) in zip(blobs, blobs[1:]):
            assert after == before, base


def _added(path) -> list[str]:
    return [line[1:] for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("+") and not line.startswith("+++")]


def test_one_concern_reads_the_same_in_every_variant():
    """zero-fill uses one set of names and one debug wording at every base (smoke.ZERO_FILL reads it),
    and no added line is wider than the widest line the series' own variants accept (upstream's
    file is wider still: 191 columns at b11312)."""
    from dfbuild import smoke

    curated = series.load_series()
    # 5ecbe1a's variant is made on a tree that cannot be read here (its made_on_note), so it cannot be
    # regenerated: it keeps its own row-list form (fill_beg and row, no n_fill) and one wide line
    unregenerable = {"5ecbe1a"}
    for variant in curated.concern("zero-fill").variants.values():
        code = "\n".join(_added(series.patch_path(curated, variant)))
        for name in ("fill_beg", "row") + (() if variant.base in unregenerable else ("n_fill",)):
            assert re.search(rf"\b{name}\b", code), f"{variant.file}: no {name}"
        for other in ("gap_beg", "n_gap"):
            assert other not in code, f"{variant.file}: {other} (the concern's names are fill_beg, n_fill)"
        assert 'zero-filling draft positions [%d, %d)\\n"' in code, variant.file
    # the one pattern the smoke reads, after SPC_DBG's prefix or a function name
    assert smoke.zero_filled_spans("spec      process: seq_id=0: zero-filling draft positions [3, 9)") == [(3, 9)]
    assert smoke.zero_filled_spans("process: seq_id=0: zero-filling draft positions [3, 9)") == [(3, 9)]
    for concern in curated.concerns:
        for variant in concern.variants.values():
            if variant.file and variant.base not in unregenerable:
                wide = [line for line in _added(series.patch_path(curated, variant)) if len(line) > 110]
                assert not wide, f"{variant.file}: added lines over 110 columns: {wide}"
