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
    UsageError,
    NotLlamaTreeError,
    PatchConflictError,
    PatchIntegrityError,
    SeriesFileError,
)

SPECULATIVE = "common/speculative.cpp"
SERIES_ENV = "DFBUILD_PATCHES_DIR"

# How far back `identify_base` walks the history of common/speculative.cpp to
# find the base under commits dfbuild (or a user) added on top.
MAX_HISTORY = 64


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
class Series:
    path: Path
    bug: str
    bases: dict[str, dict]      # name -> {"blob": ..., "commit": ..., "note": ...}
    concerns: list[Concern]

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
        return Series(path=path, bug=doc["bug"], bases=dict(doc["bases"]), concerns=concerns)
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


def identify_base(series: Series, tree: Path) -> str | None:
    """Name the base whose speculative.cpp this tree holds, or held before commits on top.

    Walking history on purpose: a tree that moved on from a known base (user
    commits, a newer upstream) is checked against that base's variant, which
    is how `series check` can say which patch and hunk no longer apply.
    """
    blob = source.speculative_blob(tree)
    if series.base_for_blob(blob):
        return series.base_for_blob(blob)
    history = _git(tree, "rev-list", f"--max-count={MAX_HISTORY}", "HEAD", "--", SPECULATIVE, check=False)
    for commit in history.stdout.split():
        for rev in (commit, f"{commit}^"):
            found = _git(tree, "rev-parse", "--verify", "--quiet", f"{rev}:{SPECULATIVE}", check=False)
            name = series.base_for_blob(found.stdout.strip())
            if name:
                return name
    return None


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
    status: str             # clean | offset | applied | upstream | conflict | no-variant
    detail: str = ""

    def to_dict(self) -> dict:
        return {
            "id": self.concern.id,
            "status": self.status,
            "file": self.variant.file if self.variant else None,
            "sha256": self.variant.sha256 if self.variant else None,
            "detail": self.detail,
        }


def _try_apply(tree: Path, patch: Path, index_env: dict, *args: str) -> subprocess.CompletedProcess:
    # --cached works on the index alone, so a trial never touches the working tree
    return _git(tree, "apply", "--cached", "--verbose", *args, str(patch), check=False, env=index_env)


def plan(series: Series, tree: Path, base: str | None = None, *, skip: tuple[str, ...] = ()) -> tuple[str | None, list[Step]]:
    """Check every concern in order against TREE without changing it.

    Trials run on scratch copies of the index, never on the tree itself. A patch
    is already present when it reverse-applies; the patches are undone from the
    last to the first, because neighbouring concerns share context lines (patch 1
    alone does not reverse-apply on a tree that also has patch 2). The missing
    ones are then applied in order, exactly as `apply` will apply them.
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
    steps: list[Step] = []
    patches: dict[str, Path] = {}
    for concern in series.concerns:
        variant = concern.variants.get(base) if base else None
        if concern.id in skip:
            steps.append(Step(concern, variant, "skipped", "left out on request"))
        elif variant is None:
            steps.append(Step(concern, None, "no-variant",
                              f"no variant for base {base}" if base else "base not recognised"))
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
            offsets = re.findall(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)", forward.stderr)
            if forward.returncode != 0:
                step.status, step.detail = "conflict", f"{step.variant.file}: {describe_failure(patch, forward.stderr)}"
            elif offsets:
                step.status = "offset"
                step.detail = "; ".join(f"hunk #{n} at {at} (offset {off})" for n, at, off in offsets)
            else:
                step.status = "clean"
    return base, steps


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


def apply_series(series: Series, tree: Path, *, base: str | None = None, skip: tuple[str, ...] = ()) -> dict:
    """Apply every needed concern as one fixed-identity commit each; all or nothing.

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
    if base is None:
        raise NoVariantError(
            f"{tree} is not a known base: common/speculative.cpp has blob {source.speculative_blob(tree)}",
            f"known bases: {', '.join(series.bases)}; a maintainer can add one with `dfbuild series refresh`",
        )
    for step in steps:
        if step.status == "no-variant":
            raise NoVariantError(f"concern {step.concern.id} has no variant for base {base}",
                                 "add one with `dfbuild series refresh --onto` or pass a supported base")
        if step.status == "conflict":
            raise PatchConflictError(
                f"patch {step.detail} does not apply to {base}; nothing was applied",
                f"regenerate the variant: dfbuild series refresh --dir DIR --onto {base}",
            )

    original_head = repo.head.commit.hexsha
    to_apply = [step for step in steps if step.status in ("clean", "offset")]
    touched = sorted({p for step in to_apply for p in patch_paths(patch_path(series, step.variant))})
    if to_apply:
        branch = None if repo.head.is_detached else repo.active_branch.name
        journal.begin(tree, "apply", original_head=original_head, branch=branch, paths=touched)
    state.fault_point("apply: journal written")
    results = []
    try:
        for step in steps:
            entry = step.to_dict()
            if step.status in ("clean", "offset"):
                patch = patch_path(series, step.variant)
                applied = _git(tree, "apply", "--index", str(patch), check=False)
                if applied.returncode != 0:
                    raise PatchConflictError(
                        f"patch {step.variant.file} failed: {describe_failure(patch, applied.stderr)}",
                        f"regenerate the variant: dfbuild series refresh --dir DIR --onto {base}",
                    )
                state.fault_point(f"apply: {step.concern.id} staged")
                entry["status"] = "applied"
                entry["commit"] = source.commit_fixed(repo, commit_message(patch))
                state.fault_point(f"apply: {step.concern.id} committed")
            elif step.status == "applied":
                entry["status"] = "already-present"
            results.append(entry)
    except BaseException:
        # restore exactly what the patches touched; the user's other files stay as they are
        if to_apply and not journal.roll_back(tree):
            ui.warn(f"the rollback in {tree} did not finish; the next dfbuild run on it finishes it")
        raise
    journal.end(tree)

    return {
        "base": base,
        "patches_dir": str(series.root),
        "concerns": results,
        "head": repo.head.commit.hexsha,
        "changed": any(r["status"] == "applied" for r in results),
    }


# --- refresh (maintainers) --------------------------------------------------------------------

CONCERN_TRAILER = "Dfbuild-Concern"


def refresh(series: Series, tree: Path, onto: str) -> dict:
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
    if not commits:
        raise SeriesFileError(f"no commits between {onto} and HEAD in {tree}",
                              "commit one change per concern on top of the base first")
    blob = _git(tree, "rev-parse", f"{onto_commit}:{SPECULATIVE}").stdout.strip()
    # a new base is named after ONTO when that is a plain name (a tag like b11312), else its short id
    plain_name = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", onto) and not onto.endswith(".lock")
    base = series.base_for_blob(blob) or (onto if plain_name else onto_commit[:7])
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

        out_dir.mkdir(parents=True, exist_ok=True)
        doc = tomlkit.parse(series.path.read_bytes().decode("utf-8"))
        doc["bases"].setdefault(base, tomlkit.table())
        doc["bases"][base]["blob"] = blob
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
    return {"base": base, "blob": blob, "onto": onto_commit, "variants": written}
