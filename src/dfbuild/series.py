"""Stage 2, series: the curated DFlash fixes, applied safely.

patches/series.toml is the single source of truth: the concerns in order, each
with its rationale, DEP-3 fields and one patch file per base. A base is
recognised by content (the git blob id of common/speculative.cpp), so a clone,
an sdist import and a tarball of the same code all pick the same variant.

Applying follows ollama's apply-git-patches loop: reverse-check means already
applied, forward-check then apply, and a failure says what to regenerate. On
top of that the whole series is atomic, and every patch becomes a commit with a
fixed identity and date, so one base always yields one patched commit id.
"""

from __future__ import annotations

import email
import email.policy
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import git
import tomlkit

from . import journal, source, state, ui
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
DFBUILD_EMAIL = source.FIXED_IDENTITY["GIT_AUTHOR_EMAIL"]


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
# change: nothing to apply) or "partial-upstream" (the base has part of it: FILE,
# when given, adds what is still missing).
VARIANT_STATUSES = ("patch", "upstream", "partial-upstream")


@dataclass
class Variant:
    base: str
    status: str                 # one of VARIANT_STATUSES
    file: str | None = None     # relative to the patches dir
    sha256: str | None = None
    note: str = ""


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

    def recorded_proof(self, build: int | None) -> dict | None:
        """The proof of release bBUILD that series.toml records, if any."""
        for epoch in self.epochs:
            for proof in epoch.proofs:
                if build is not None and proof.get("release") == f"b{build}":
                    return {**proof, "epoch": epoch.name, "variant": epoch.variant}
        return None

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


class _Malformed(Exception):
    """A schema problem in series.toml, said in words (becomes a SeriesFileError)."""


def _variant(concern_id: str, base: str, raw) -> Variant:
    where = f"variant {concern_id}/{base}"
    if not isinstance(raw, dict):
        raise _Malformed(f"{where} must be a table like {{file = ..., sha256 = ...}}")
    variant = Variant(base=base, status=raw.get("status", "patch"), file=raw.get("file"),
                      sha256=raw.get("sha256"), note=raw.get("note", ""))
    if variant.status not in VARIANT_STATUSES:
        raise _Malformed(f"{where} has status '{variant.status}' (use one of {', '.join(VARIANT_STATUSES)})")
    if variant.status == "patch" and not variant.file:
        raise _Malformed(f"{where} needs a file")
    if variant.status == "upstream" and variant.file:
        raise _Malformed(f"{where} is upstream and so has no file")
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
    except (KeyError, TypeError, AttributeError) as exc:
        raise SeriesFileError(f"{path} is malformed: missing or wrong {exc}", hint) from None


# --- recognising the base ------------------------------------------------------------


def _git(tree: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    result = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, env=full_env)
    if check and result.returncode != 0:
        raise git.GitCommandError(["git", *args], result.returncode, result.stderr, result.stdout)
    return result


def series_start(tree: Path) -> str:
    """The commit the series goes on: HEAD, below the concern commits dfbuild itself put on top."""
    log = _git(tree, "log", "--first-parent", f"-n{MAX_HISTORY}",
               f"--format=%H%x09%ae%x09%(trailers:key={CONCERN_TRAILER},valueonly,separator=%x2C)", "HEAD",
               check=False).stdout
    start = None
    for line in log.splitlines():
        commit, email, concern = (line.split("\t") + ["", ""])[:3]
        start = commit
        if email != DFBUILD_EMAIL or not concern.strip():
            return commit
    return start or _git(tree, "rev-parse", "HEAD").stdout.strip()


def identify_base(series: Series, tree: Path) -> str | None:
    """Name the known base this tree holds, as it is or under the concern commits dfbuild added.

    Only dfbuild's own commits are looked through: a tree that moved on from a
    known base in any other way (a newer upstream, a user's commits) is a base
    of its own, and the series is carried to it from the nearest known variants.
    """
    name = series.base_for_blob(source.speculative_blob(tree))
    if name:
        return name
    head = _git(tree, "rev-parse", "--verify", "--quiet", "HEAD", check=False).stdout.strip()
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

    def to_dict(self) -> dict:
        entry = {
            "id": self.concern.id,
            "status": self.status,
            "file": self.variant.file if self.variant else None,
            "sha256": self.variant.sha256 if self.variant else None,
            "detail": self.detail,
        }
        if self.how is not None:
            entry.update({"variant": self.variant.base if self.variant else None, "how": self.how,
                          "blob": self.blob})
        return entry


def _try_apply(tree: Path, patch: Path, index_env: dict, *args: str) -> subprocess.CompletedProcess:
    # --cached works on the index alone, so a trial never touches the working tree
    return _git(tree, "apply", "--cached", "--verbose", *args, str(patch), check=False, env=index_env)


def _index_blob(tree: Path, env: dict) -> str | None:
    listed = _git(tree, "ls-files", "--stage", "--", SPECULATIVE, env=env, check=False).stdout.split()
    return listed[1] if len(listed) >= 2 else None


def plan(series: Series, tree: Path, base: str | None = None, *, skip: tuple[str, ...] = ()) -> tuple[str | None, list[Step]]:
    """Check every concern in order against TREE without changing it.

    A known base (by blob) gets its own variants. Any other tree gets the
    series carried from the nearest known variants (`carry`), and the base
    returned is None.
    """
    tree = Path(tree)
    if not source.is_llama_tree(tree) or not (tree / ".git").exists():
        raise NotLlamaTreeError(f"{tree} is not a llama.cpp git checkout",
                                "run `dfbuild checkout` or `dfbuild import` first")
    if _git(tree, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False).returncode != 0:
        raise NotLlamaTreeError(f"{tree} is a git repository without any commit",
                                "commit the tree first, or make it with `dfbuild checkout` or `dfbuild import`")
    check_skip(series, skip)
    base = base or identify_base(series, tree)
    if base is None:
        return None, carry(series, tree, skip=skip)
    return base, _plan_known(series, tree, base, skip)


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
            steps.append(Step(concern, variant, "upstream", variant.note))
        else:
            patches[concern.id] = verify_patch(series, concern, variant)
            steps.append(Step(concern, variant, "pending"))
    pending = [step for step in steps if step.status == "pending"]

    with state.temp_dir("index") as tmp:
        undo_env = {"GIT_INDEX_FILE": str(Path(tmp) / "undo")}
        apply_env = {"GIT_INDEX_FILE": str(Path(tmp) / "apply")}
        for env in (undo_env, apply_env):
            _git(tree, "read-tree", "HEAD", env=env)
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


# --- carrying the series to a base it has never seen ---------------------------------------------


def has_dflash(tree: Path, rev: str) -> bool:
    shown = _git(tree, "show", f"{rev}:{SPECULATIVE}", check=False)
    return shown.returncode == 0 and "dflash" in shown.stdout.lower()


def base_build(series: Series, name: str) -> int | None:
    """A known base's llama.cpp build number: recorded in series.toml, or read off a bNNNN name; a tree that
    is no release (pydist-0.94.0) is placed at its `nearest_release`, for ordering only."""
    info = series.bases.get(name, {})
    if info.get("build") is not None:
        return int(info["build"])
    return source.release_build(name) or source.release_build(info.get("nearest_release"))


def tree_build(tree: Path, rev: str) -> int | None:
    """The build number of the tree at REV: from the name it was checked out as, else a bNNNN tag."""
    from . import manifest  # the tree's record of where it came from

    recorded = manifest.load(manifest.tree_manifest_path(tree)).get("source", {})
    if recorded.get("commit") == rev and source.release_build(recorded.get("base")) is not None:
        return source.release_build(recorded.get("base"))
    described = _git(tree, "describe", "--tags", "--match", "b[0-9]*", rev, check=False).stdout.strip()
    match = re.match(r"b(\d+)", described)
    return int(match.group(1)) if match else None


def history_distance(tree: Path, one: str, other: str) -> int | None:
    """How many commits lie between ONE and OTHER (either side of their merge base), or None if unknown.

    A shallow repo (dfbuild fetches only what it needs) may hold both commits
    but not the history that joins them; counted anyway, git would call them
    close. The count stands only when the two meet and no commit counted is
    one whose parents were left out.
    """
    shallow_file = _git(tree, "rev-parse", "--git-path", "shallow", check=False).stdout.strip()
    shallow_path = Path(shallow_file) if Path(shallow_file).is_absolute() else Path(tree) / shallow_file
    roots = set(shallow_path.read_text().split()) if shallow_file and shallow_path.is_file() else set()
    if roots:
        if _git(tree, "merge-base", one, other, check=False).returncode != 0:
            return None  # no common history here: unknown, not far
        listed = _git(tree, "rev-list", f"{one}...{other}", check=False)
        if listed.returncode != 0 or roots & set(listed.stdout.split()):
            return None
        return len(listed.stdout.split())
    count = _git(tree, "rev-list", "--count", f"{one}...{other}", check=False).stdout.strip()
    return int(count) if count.isdigit() else None


def nearest_bases(series: Series, tree: Path, rev: str) -> list[str]:
    """The known bases, nearest to REV first: by history where the repo holds a base's
    commit (and the history between), else by build number, else the newest first."""
    by_history = {}
    for name, info in series.bases.items():
        commit = info.get("commit")
        found = _git(tree, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", check=False) if commit else None
        if found is not None and found.returncode == 0:
            distance = history_distance(tree, found.stdout.strip(), rev)
            if distance is not None:
                by_history[name] = distance
    build = tree_build(tree, rev)

    def key(name: str) -> tuple:
        known = base_build(series, name)
        if name in by_history:
            return (0, by_history[name], 0)
        if known is not None and build is not None:
            return (1, abs(known - build), -known)
        return (2, 0, -(known or 0))

    return sorted(series.bases, key=key)


def _preimages(series: Series, tree: Path, base: str, tmp: Path) -> bool:
    """Put the blobs a 3-way merge of BASE's variants needs into TREE's object store.

    A variant's patch records the blob it applies to: the base's
    speculative.cpp with that variant's earlier concerns in. The base's blob
    comes from TREE itself when its history has it (a shallow checkout fetches
    the base's commit, or its tag, from its origin first), else from
    the known base's cached tree (an offline base is fetched once); the later ones are made by
    applying the variant's patches in order to a scratch index. Nothing but
    objects is written, and nothing is committed.
    """
    blob = series.bases.get(base, {}).get("blob")
    if not blob:
        return False
    if _git(tree, "cat-file", "-e", f"{blob}^{{blob}}", check=False).returncode != 0:
        # a shallow checkout: the base's commit (or tag), fetched from the tree's origin on demand
        source.fetch_base_into(tree, base, series.bases.get(base, {}).get("commit"))
    if _git(tree, "cat-file", "-e", f"{blob}^{{blob}}", check=False).returncode != 0:
        data = source.known_base_blob(base, blob)
        if data is None:
            return False
        written = subprocess.run(["git", "-C", str(tree), "hash-object", "-w", "--stdin"], input=data,
                                 capture_output=True)
        if written.stdout.decode().strip() != blob:
            return False
    env = {"GIT_INDEX_FILE": str(tmp / f"preimage-{base}")}
    _git(tree, "read-tree", "--empty", env=env)
    _git(tree, "update-index", "--add", "--cacheinfo", f"100644,{blob},{SPECULATIVE}", env=env)
    for concern in series.concerns:
        variant = concern.variants.get(base)
        if variant is not None and variant.file:
            _try_apply(tree, verify_patch(series, concern, variant), env)
    return True


def _patched_between(series: Series, concern: Concern, since: int | None, until: int | None) -> str | None:
    """A known base built after SINCE and up to UNTIL whose variant of CONCERN is a patch, if any.

    An upstream decision carries forward in time only while upstream keeps the
    change; a later base that needed the patch again ends that epoch.
    """
    if since is None or until is None:
        return None
    for name, variant in concern.variants.items():
        build = base_build(series, name)
        if variant.file and build is not None and since < build <= until:
            return name
    return None


def _carry_concern(series: Series, tree: Path, concern: Concern, order: list[str], index: Path,
                   preimages: dict, tmp: Path, start: str) -> Step:
    """Carry one concern on the scratch INDEX: exact, by offset, by 3-way merge, or a conflict.

    On success INDEX holds the tree with the concern in, as `apply` will make it.
    """
    candidates = [concern.variants[name] for name in order if name in concern.variants]
    patches = {v.base: verify_patch(series, concern, v) for v in candidates if v.file}
    trial = tmp / "trial"
    trial_env = {"GIT_INDEX_FILE": str(trial)}
    env = {"GIT_INDEX_FILE": str(index)}
    tried = []
    for variant in candidates:
        if variant.file is None:  # the nearest base records the change as upstream: carry that decision
            recorded, build = base_build(series, variant.base), tree_build(tree, start)
            if recorded is not None and build is not None and build < recorded:
                tried.append(f"{variant.base} records it upstream, but b{build} is older than {variant.base}")
                continue  # upstream changes carry forward in time, not back
            undone = _patched_between(series, concern, recorded, build)
            if undone:
                # upstream had it in that epoch and later took it out again (b9837 skipped image
                # rows, b10355 injected them): a base between needed a patch, so the epoch is over
                tried.append(f"{variant.base} records it upstream, but {undone}, between it and b{build}, "
                             "needed a patch")
                continue
            note = f": {variant.note}" if variant.note else ""
            return Step(concern, variant, "upstream", f"upstream as recorded for {variant.base}{note}",
                        how=f"upstream (as in {variant.base})")
        patch = patches[variant.base]
        shutil.copyfile(index, trial)
        forward = _try_apply(tree, patch, trial_env)  # git apply never fuzzes: context must match
        if forward.returncode == 0:
            os.replace(trial, index)
            offsets = sorted({int(off) for _, _, off in _OFFSETS.findall(forward.stderr)})
            if not offsets:
                return Step(concern, variant, "clean", f"carried from {variant.base}, exact", how="exact")
            how = "offset " + ", ".join(f"{off:+d}" for off in offsets)
            return Step(concern, variant, "offset", f"carried from {variant.base}, {how}", how=how)
        failure = f"{variant.file}: {describe_failure(patch, forward.stderr)}"
        if variant.base not in preimages:
            preimages[variant.base] = _preimages(series, tree, variant.base, tmp)
        if not preimages[variant.base]:
            tried.append(f"{failure} (no 3-way: {variant.base}'s tree is not available)")
            continue
        shutil.copyfile(index, trial)
        if _try_apply(tree, patch, trial_env, "--3way").returncode == 0:
            if _index_blob(tree, trial_env) == _index_blob(tree, env):  # both sides made the same change
                return Step(concern, variant, "applied", f"already in the tree: a 3-way merge of the {variant.base} "
                            "variant changes nothing", how="upstream")
            os.replace(trial, index)
            return Step(concern, variant, "3-way", f"carried from {variant.base}, conflict-free 3-way merge",
                        how="3-way")
        tried.append(f"{failure} (and the 3-way merge conflicts)")
    closest = next((v for v in candidates if v.file), None)
    detail = ("tried " + "; ".join(tried)) if tried else "no known base has a variant of it"
    return Step(concern, closest, "conflict", detail)


def carry(series: Series, tree: Path, *, skip: tuple[str, ...] = ()) -> list[Step]:
    """The series decided for a base no variant was made for, concern by concern, in order.

    Planned on the commit the series goes on (`series_start`), so a tree that
    already carries it plans the same; when HEAD already holds the planned
    result, the carried concerns say `applied` (already present).
    """
    start = series_start(tree)
    if not has_dflash(tree, start):
        return [Step(c, None, "not-applicable", "common/speculative.cpp has no DFlash: nothing to fix")
                for c in series.concerns]
    order = nearest_bases(series, tree, start)
    steps = []
    with state.temp_dir("index") as tmp:
        index = tmp / "carry"
        env = {"GIT_INDEX_FILE": str(index)}
        _git(tree, "read-tree", start, env=env)
        # Already in the tree (upstream made the change, or it was committed by hand): a known
        # variant reverse-applies. Undone last to first, as for a known base: neighbouring
        # concerns share context lines.
        present: dict[str, Variant] = {}
        undo_env = {"GIT_INDEX_FILE": str(tmp / "undo")}
        _git(tree, "read-tree", start, env=undo_env)
        for concern in reversed(series.concerns):
            for variant in (concern.variants[name] for name in order if name in concern.variants):
                if variant.file and concern.id not in skip and _try_apply(
                        tree, verify_patch(series, concern, variant), undo_env, "--reverse").returncode == 0:
                    present[concern.id] = variant
                    break
        preimages: dict[str, bool] = {}
        for concern in series.concerns:
            if concern.id in skip:
                steps.append(Step(concern, None, "skipped", "left out on request"))
                continue
            if concern.id in present:
                variant = present[concern.id]
                steps.append(Step(concern, variant, "applied",
                                  f"already in the tree: the {variant.base} variant reverse-applies",
                                  how="upstream", blob=_index_blob(tree, env)))
                continue
            step = _carry_concern(series, tree, concern, order, index, preimages, tmp, start)
            if step.status != "conflict":
                step.blob = _index_blob(tree, env)
            steps.append(step)
    head = _git(tree, "rev-parse", "HEAD").stdout.strip()
    final = next((s.blob for s in reversed(steps) if s.blob), None)
    if head != start and final and source.committed_blob(tree, head) == final:
        for step in steps:
            if step.status in CARRIED:
                step.status, step.detail = "applied", f"already present ({step.detail})"
    return steps


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
    """Apply every needed concern as one fixed-identity commit each; all or nothing.

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
    base, steps = plan(series, tree, base, skip=skip)
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
        raise conflict

    original_head = repo.head.commit.hexsha
    start = series_start(tree) if derived else None
    to_apply = [step for step in steps if step.status in CARRIED]
    touched = sorted({p for step in to_apply for p in patch_paths(patch_path(series, step.variant))})
    branch = None
    if to_apply:
        branch = None if repo.head.is_detached else repo.active_branch.name
        # what the patches write, so that a rollback can tell those bytes from a user's edit since
        wrote: dict[str, list[str]] = {}
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
                applied = _git(tree, *args, check=False)
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
                    entry["commit"] = source.commit_fixed(repo, commit_message(patch))
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
    return section


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


# --- refresh (maintainers) --------------------------------------------------------------------


def refresh(series: Series, tree: Path, onto: str, *, name: str | None = None, base_info: dict | None = None,
            decisions: dict[str, str] | None = None) -> dict:
    """Regenerate the variants for base ONTO from the concern commits on top of it in TREE.

    Each commit in ONTO..HEAD must carry a `Dfbuild-Concern: <id>` trailer, one
    commit per concern. The new patch files are checked on ONTO, in the order of
    series.toml (the order `apply` uses), with zero fuzz and no offset, before
    anything is written.
    """
    tree = Path(tree)
    repo = git.Repo(tree)
    onto_commit = source.resolve_commit(repo, onto)
    commits = _git(tree, "rev-list", "--reverse", f"{onto_commit}..HEAD").stdout.split()
    decisions = decisions or {}
    if not commits and not decisions:
        raise SeriesFileError(f"no commits between {onto} and HEAD in {tree}",
                              "commit one change per concern on top of the base first")
    blob = _git(tree, "rev-parse", f"{onto_commit}:{SPECULATIVE}").stdout.strip()
    # a new base is named after ONTO when that is a plain name (a tag like b11312), else its short id
    plain_name = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", onto) and not onto.endswith(".lock")
    base = name or series.base_for_blob(blob) or (onto if plain_name else onto_commit[:7])
    out_dir = series.root / base

    with state.temp_dir("refresh") as tmp:
        generated, made_by = [], {}
        for commit in commits:
            body = _git(tree, "log", "-1", "--format=%B", commit).stdout
            match = re.search(rf"^{CONCERN_TRAILER}:[ \t]*(\S+)", body, re.M)
            if not match:
                raise SeriesFileError(f"commit {commit[:12]} has no '{CONCERN_TRAILER}: <id>' trailer",
                                      "add the trailer naming the concern it implements")
            concern = series.concern(match.group(1))
            if concern.id in made_by:
                raise SeriesFileError(
                    f"commits {made_by[concern.id][:12]} and {commit[:12]} are both for concern {concern.id}",
                    "squash them: each concern is one patch")
            made_by[concern.id] = commit
            number = series.concerns.index(concern) + 1
            path = Path(tmp) / f"{number:04d}-{concern.id}.patch"
            # bytes, exactly as git wrote them: no newline or encoding translation
            patch = subprocess.run(["git", "-C", str(tree), "format-patch", "-1", commit, "--zero-commit",
                                    "--no-signature", "--no-numbered", "--full-index", "--stdout"],
                                   capture_output=True, check=True)
            path.write_bytes(patch.stdout)
            generated.append((concern, path))
        generated.sort(key=lambda item: series.concerns.index(item[0]))

        # prove the new variant applies in series order on the base itself, with zero fuzz
        scratch_index = Path(tmp) / "index"
        index_env = {"GIT_INDEX_FILE": str(scratch_index)}
        _git(tree, "read-tree", onto_commit, env=index_env)
        for concern, path in generated:
            trial = _try_apply(tree, path, index_env)
            moved = re.search(r"Hunk #(\d+) succeeded at \d+ \(offset", trial.stderr)
            if trial.returncode != 0 or moved:
                reason = (f"hunk #{moved.group(1)} only applies at an offset" if trial.returncode == 0
                          else describe_failure(path, trial.stderr))
                raise PatchConflictError(
                    f"regenerated {path.name} does not apply cleanly on {onto} in series order: "
                    f"{reason}; nothing was written",
                    "rebase the concern commits onto the base, in the order of series.toml, and try again",
                )

        if generated:
            out_dir.mkdir(parents=True, exist_ok=True)
        doc = tomlkit.parse(series.path.read_bytes().decode("utf-8"))
        doc["bases"].setdefault(base, tomlkit.table())
        doc["bases"][base]["blob"] = blob
        for key, value in (base_info or {}).items():
            doc["bases"][base][key] = value
        for table in doc["concern"]:
            if table["id"] in decisions:  # a decision, not a patch: e.g. the change is upstream in this base
                entry = tomlkit.inline_table()
                entry.update({"status": "upstream", "note": decisions[table["id"]]})
                table.setdefault("variants", tomlkit.table())[base] = entry
        written = []
        for concern, path in generated:
            dest = out_dir / path.name
            shutil.copyfile(path, dest)
            for table in doc["concern"]:
                if table["id"] == concern.id:
                    variants = table.setdefault("variants", tomlkit.table())
                    entry = tomlkit.inline_table()
                    entry.update({"file": f"{base}/{path.name}", "sha256": sha256_file(dest)})
                    variants[base] = entry
            written.append({"id": concern.id, "file": f"{base}/{path.name}", "sha256": sha256_file(dest)})
        series.path.write_bytes(tomlkit.dumps(doc).encode("utf-8"))
    return {"base": base, "blob": blob, "onto": onto_commit, "variants": written,
            "decisions": [{"id": cid, "status": "upstream", "note": note} for cid, note in decisions.items()]}


def adopt(series: Series, tree: Path) -> dict:
    """Turn a proven carried result into a recorded variant of its own base.

    The tree's record must say that its series was carried (`derived`) and
    that the proof ran on exactly this HEAD with the outcome fixed (or fixed
    upstream). The concern commits become patch files through `refresh`
    (format-patch, sha256, checked to apply with zero offset); concerns found
    in the tree or carried as an upstream decision are recorded as upstream;
    the base gets its blob, build number, where its tree comes from and how
    each concern was carried and proven.
    """
    from . import manifest

    tree = Path(tree)
    record = manifest.load(manifest.tree_manifest_path(tree))
    applied, proof, src = record.get("series") or {}, record.get("proof") or {}, record.get("source") or {}
    head = _git(tree, "rev-parse", "HEAD").stdout.strip()
    if not applied.get("derived"):
        raise SeriesFileError(f"{tree}: base {applied.get('base') or '?'} already has its own variants; nothing to adopt",
                              "adopt trees whose series `dfbuild apply` carried from other bases")
    if applied.get("head") != head or proof.get("patched_commit") != head:
        raise SeriesFileError(f"{tree}: HEAD {head[:12]} is not the commit the proof ran on",
                              "run `dfbuild prove` (or `dfbuild release`) on this tree first")
    outcome = proof.get("outcome")
    if outcome not in ("fixed", "fixed-upstream"):
        raise SeriesFileError(f"{tree}: the proof says {outcome or 'nothing'}; only a proven fix is adopted",
                              "a still-broken or conflicting base needs a maintainer: see `dfbuild series refresh`")
    start, base = applied["start"], applied["base"]
    proven = f"proven {proof.get('proven_at', '?')[:10]} on {proof.get('backend')}"
    decisions, carried_from = {}, {}
    for concern in applied.get("concerns", []):
        carried_from[concern["id"]] = f"{concern.get('variant')} {concern.get('how')}"
        if outcome == "fixed-upstream":
            decisions[concern["id"]] = f"fixed upstream: the unpatched tree passes every scenario ({proven})"
        elif concern.get("how", "").startswith("upstream"):
            decisions[concern["id"]] = f"{concern.get('detail')} ({proven})"
    if outcome == "fixed-upstream":
        onto = head  # no patch files: every concern is a decision
        if head != start:
            raise SeriesFileError(f"{tree}: fixed upstream, yet commits sit on top of {start[:12]}",
                                  "adopt from the unpatched tree: dfbuild prove leaves it in WORK/unpatched/src")
    else:
        onto = start
    patched, unpatched = proof.get("patched") or {}, proof.get("unpatched") or {}
    info = {
        "note": f"llama.cpp {base}, adopted from a proven carry",
        "provenance": {
            "carried_from": carried_from,
            "outcome": outcome,
            "proof": (f"unpatched: {len(unpatched.get('failed', []))} of {unpatched.get('runs')} scenario runs failed"
                      f"{' with the upstream symptom' if unpatched.get('upstream_symptom') else ''}; "
                      f"patched: {'all ' + str(patched.get('runs')) + ' passed' if patched.get('passed') else 'not run'}"),
            "proven": proven,
        },
    }
    build = source.release_build(base)
    if build is not None:
        info["build"] = build
    if src.get("kind") == "sdist" and str(src.get("repo", "")).startswith("pypi:"):
        info["sdist"] = src["repo"][len("pypi:"):]
    elif src.get("kind") == "git" and src.get("commit") == start:
        info["commit"] = start
    result = refresh(series, tree, onto, name=base, base_info=info, decisions=decisions)
    return {**result, "outcome": outcome, "provenance": info["provenance"]}
