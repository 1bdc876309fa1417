"""From commits and proofs back into series.toml: refresh and adopt.

refresh turns one commit per concern on top of a base into that base's
variants; adopt does it for a carried series that `dfbuild prove` proved.
A function of the series as data (series_model, series_patch, series_check);
series.py re-exports its public names. The curator's loop built on refresh is
curate.py; the record of proofs in series.toml is proof_record.py.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import git
import tomlkit

from dfbuild.core import gitrun, manifest, state
from dfbuild.core.errors import NoProofError, PatchConflictError, SeriesFileError
from dfbuild.core.paths import sha256_file
from dfbuild.model.patchfile import describe_failure
from dfbuild.model.series import CONCERN_TRAILER, SPECULATIVE, Concern, Series, load_series
from dfbuild.series.check import _try_apply
from dfbuild.series.proof_record import record_proofs
from dfbuild.source import checkout as source


def refresh(series: Series, tree: Path, onto: str, *, name: str | None = None, base_info: dict | None = None,
            decisions: dict[str, str] | None = None, not_needed: dict[str, str] | None = None) -> dict:
    """Regenerate the variants for base ONTO from the concern commits on top of it in TREE.

    Each commit in ONTO..HEAD must carry a `Dfbuild-Concern: <id>` trailer, one
    commit per concern. The new patch files are checked on ONTO, in the order of
    series.toml (the order `apply` uses), with zero fuzz and no offset, before
    anything is written. DECISIONS (concern -> note) are recorded as upstream at ONTO,
    NOT_NEEDED (concern -> what was measured) as not needed there; either replaces a patch.
    """
    tree = Path(tree)
    repo = git.Repo(tree)
    onto_commit = source.resolve_commit(repo, onto)
    commits = gitrun.run(tree, "rev-list", "--reverse", f"{onto_commit}..HEAD").stdout.split()
    decided = {cid: ("upstream", note) for cid, note in (decisions or {}).items()}
    decided.update({cid: ("not-needed", note) for cid, note in (not_needed or {}).items()})
    if not commits and not decided:
        raise SeriesFileError(f"no commits between {onto} and HEAD in {tree}",
                              "commit one change per concern on top of the base first")
    blob = gitrun.run(tree, "rev-parse", f"{onto_commit}:{SPECULATIVE}").stdout.strip()
    # a new base is named after ONTO when that is a plain name (a tag like b11312), else its short id
    plain_name = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", onto) and not onto.endswith(".lock")
    base = name or series.base_for_blob(blob) or (onto if plain_name else onto_commit[:7])
    out_dir = series.root / base

    with state.temp_dir("refresh") as tmp:
        generated: list[tuple[Concern, Path]] = []
        made_by: dict[str, str] = {}
        for commit in commits:
            body = gitrun.run(tree, "log", "-1", "--format=%B", commit).stdout
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
            patch = gitrun.run(tree, "format-patch", "-1", commit, "--zero-commit", "--no-signature", "--no-numbered",
                               "--full-index", "--stdout", text=False)
            path.write_bytes(patch.stdout)
            generated.append((concern, path))
        generated.sort(key=lambda item: series.concerns.index(item[0]))

        # prove the new variant applies in series order on the base itself, with zero fuzz
        scratch_index = Path(tmp) / "index"
        index_env = {"GIT_INDEX_FILE": str(scratch_index)}
        gitrun.run(tree, "read-tree", onto_commit, extra_env=index_env)
        for _concern, path in generated:
            trial = _try_apply(tree, path, index_env)
            moved = re.search(r"Hunk #(\d+) succeeded at \d+ \(offset", trial.stderr)
            if trial.returncode != 0 or moved:
                reason = (f"hunk #{moved.group(1)} only applies at an offset" if trial.returncode == 0 and moved
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
            if table["id"] in decided:  # a decision, not a patch: upstream has it, or it is not needed here
                status, note = decided[table["id"]]
                entry = tomlkit.inline_table()
                entry.update({"status": status, "note": note})
                old = table.get("variants", {}).get(base)
                if old is not None and old.get("status") == status and "marker" in old:
                    entry["marker"] = old["marker"]  # how apply finds upstream's code at this base: still it
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
        state.fault_point("record: patch files written")
        state.atomic_write_text(series.path, tomlkit.dumps(doc))  # a crash leaves the old file or the new
        state.fault_point("record: series.toml written")
    return {"base": base, "blob": blob, "onto": onto_commit, "variants": written,
            "decisions": [{"id": cid, "status": status, "note": note} for cid, (status, note) in decided.items()]}


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

    tree = Path(tree)
    record = manifest.load(manifest.tree_manifest_path(tree))
    applied, proof, src = record.get("series") or {}, record.get("proof") or {}, record.get("source") or {}
    head = gitrun.run(tree, "rev-parse", "HEAD").stdout.strip()
    if not applied.get("derived"):
        raise SeriesFileError(f"{tree}: base {applied.get('base') or '?'} already has its own variants; "
                              "nothing to adopt", "adopt trees whose series `dfbuild apply` carried from other bases")
    if not proof:
        raise NoProofError(f"{tree}: no proof: `dfbuild prove` (or `dfbuild release`) has not run on this tree, "
                           "so there is nothing to adopt",
                           "prove it, then adopt the tree the proof ran on (WORK/src):\n"
                           f"dfbuild prove --base {applied.get('base') or 'BASE'} --work WORK\n"
                           "dfbuild series adopt --dir WORK/src")
    if applied.get("head") != head or proof.get("patched_commit") != head:
        raise SeriesFileError(f"{tree}: HEAD {head[:12]} is not the commit the proof ran on",
                              "run `dfbuild prove` (or `dfbuild release`) on this tree first")
    outcome = proof.get("outcome")
    if outcome not in ("fixed", "fixed-upstream"):
        raise SeriesFileError(f"{tree}: the proof says {outcome or 'nothing'}; only a proven fix is adopted",
                              "a still-broken or conflicting base needs a maintainer: see `dfbuild series refresh`")
    start, base = applied["start"], applied["base"]
    proven = f"proven {proof.get('proven_at', '?')[:10]} on {proof.get('backend')}"
    decisions, not_needed, carried_from = {}, {}, {}
    for concern in applied.get("concerns", []):
        carried_from[concern["id"]] = f"{concern.get('variant')} {concern.get('how')}"
        if outcome == "fixed-upstream":
            decisions[concern["id"]] = f"fixed upstream: the unpatched tree passes every scenario ({proven})"
        elif concern.get("how", "").startswith("upstream"):
            decisions[concern["id"]] = f"{concern.get('detail')} ({proven})"
        elif concern.get("how", "").startswith("not-needed"):
            not_needed[concern["id"]] = f"{concern.get('detail')} ({proven})"
    if outcome == "fixed-upstream":
        onto = head  # no patch files: every concern is a decision
        if head != start:
            raise SeriesFileError(f"{tree}: fixed upstream, yet commits sit on top of {start[:12]}",
                                  "adopt from the unpatched tree: check out the base itself "
                                  "(dfbuild checkout --base BASE) and adopt that")
    else:
        onto = start
    patched, unpatched = proof.get("patched") or {}, proof.get("unpatched") or {}
    info: dict[str, Any] = {
        "note": f"llama.cpp {base}, adopted from a proven carry",
        "provenance": {
            "carried_from": carried_from,
            "outcome": outcome,
            "proof": (f"unpatched: {len(unpatched.get('failed', []))} of {unpatched.get('runs')} scenario runs failed"
                      f"{' with the upstream symptom' if unpatched.get('upstream_symptom') else ''}; "
                      f"patched: "
                      f"{'all ' + str(patched.get('runs')) + ' passed' if patched.get('passed') else 'not run'}"),
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
    result = refresh(series, tree, onto, name=base, base_info=info, decisions=decisions, not_needed=not_needed)
    # the one record of what was proved: the epoch that holds the base gets its proof too
    epoch_proof = None
    curated = load_series(series.root)
    if curated.epoch_of(build) is not None:
        epoch_proof = record_proofs(curated, [{**proof, "base": base}],
                                    record_name=f"{tree}, adopted with dfbuild series adopt")["proofs"][0]
    return {**result, "outcome": outcome, "provenance": info["provenance"], "epoch_proof": epoch_proof}
