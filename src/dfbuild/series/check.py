"""Checking the series against a tree without changing it: which known base the tree is, where the series
starts on it, and for a known base each concern's trial (already present, clean, offset, conflict)
on scratch copies of the index. carry.py does the same for a base no variant was made on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from dfbuild.core import gitrun, proc, state
from dfbuild.core.errors import PatchConflictError, UsageError
from dfbuild.model.patchfile import describe_failure, verify_patch
from dfbuild.model.series import CONCERN_TRAILER, SPECULATIVE, Concern, Series, Variant
from dfbuild.source import checkout as source

# How many concern commits `series_start` looks through to find the commit the series went on.
MAX_HISTORY = 64
# Who commits the concern commits `apply` makes: the project (and, in trees patched before patch
# commits took their patch's author and date, the import identity).
CONCERN_COMMITTERS = (source.PROJECT_EMAIL, source.FIXED_IDENTITY["GIT_COMMITTER_EMAIL"])


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
                step.status = "conflict"
                step.detail = f"{cast(Variant, step.variant).file}: {describe_failure(patch, forward.stderr)}"
            elif offsets:
                step.status = "offset"
                step.detail = "; ".join(f"hunk #{n} at {at} (offset {off})" for n, at, off in offsets)
            else:
                step.status = "clean"
    return steps


_OFFSETS = re.compile(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)")


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
