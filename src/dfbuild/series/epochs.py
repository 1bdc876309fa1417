"""Epochs read from the code: which curated variants fit a release, and the runs of releases they make.

A variant fits a release when all of its patch files apply to that release's
common/speculative.cpp in series order, exactly or at a pure offset (the same
hunks, moved), and every concern it records as upstream is still upstream's
own code there (its `marker`, a regex over the DFlash implementation, matches).
An epoch is a run of consecutive releases with the same fitting variants; its
boundaries are where upstream changed the code a concern touches or relies on.
bench/drift.py derives them over every DFlash-era release, and
tests/test_epoch_fit.py holds series.toml's recorded epochs to them.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dfbuild.core import gitrun
from dfbuild.model.patchfile import verify_patch
from dfbuild.model.series import SPECULATIVE, Series

_OFFSET = re.compile(r"Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)")
DFLASH_STRUCT = "struct common_speculative_impl_draft_dflash"


def dflash_code(text: str) -> str:
    """The DFlash implementation's struct in a speculative.cpp (the whole text if it has none)."""
    start = text.find(DFLASH_STRUCT)
    if start < 0:
        return text
    end = text.find("\nstruct ", start + len(DFLASH_STRUCT))
    return text[start:] if end < 0 else text[start:end]


@dataclass
class Fit:
    variant: str
    fits: bool
    offsets: list[int] = field(default_factory=list)  # every hunk's offset, 0 for exact
    why: str = ""                                      # why it does not fit


def fit(series: Series, base: str, speculative: bytes) -> Fit:
    """Does BASE's variant fit a release whose common/speculative.cpp is SPECULATIVE?"""
    code = dflash_code(speculative.decode("utf-8", errors="replace"))
    offsets: list[int] = []
    with tempfile.TemporaryDirectory(prefix="dfbuild-fit-") as tmp:
        target = Path(tmp) / SPECULATIVE
        target.parent.mkdir(parents=True)
        target.write_bytes(speculative)
        for concern in series.concerns:
            variant = concern.variants.get(base)
            if variant is None:
                continue
            if variant.file is None:
                if variant.marker and not re.search(variant.marker, code):
                    return Fit(base, False, offsets, f"{concern.id}: upstream's own change is not here")
                continue
            patch = verify_patch(series, concern, variant)
            # outside any repository, git apply patches the file in TMP (argument list, no shell)
            done = gitrun.run(None, "apply", "--verbose", str(patch), cwd=tmp, check=False)
            if done.returncode != 0:
                return Fit(base, False, offsets, f"{concern.id}: {variant.file} does not apply")
            moved = [int(n) for n in _OFFSET.findall(done.stderr)]
            offsets += moved + [0] * (len(_hunk_starts(patch)) - len(moved))  # the rest applied exactly
    return Fit(base, True, offsets)


def _hunk_starts(patch: Path) -> list[str]:
    return re.findall(r"^@@ .* @@", patch.read_text(encoding="utf-8", errors="replace"), re.M)


def pure_offset(found: Fit) -> bool:
    """Exact, or every hunk moved by one and the same number of lines."""
    return found.fits and len(set(found.offsets)) <= 1


def fits_by_variant(series: Series, speculative: bytes) -> dict[str, Fit]:
    return {base: fit(series, base, speculative) for base in series.variant_bases}


def derive(releases: list[tuple[int, dict[str, bool]]]) -> list[dict]:
    """Runs of consecutive releases (build, {variant: fits}) whose fitting variants are the same.

    Each run is one epoch read from the code: {"first", "last", "variants"}.
    """
    runs: list[dict] = []
    for build, fits in sorted(releases):
        fitting = sorted(name for name, ok in fits.items() if ok)
        if runs and runs[-1]["variants"] == fitting:
            runs[-1]["last"] = build
            runs[-1]["count"] += 1
        else:
            runs.append({"first": build, "last": build, "variants": fitting, "count": 1})
    return runs
