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
