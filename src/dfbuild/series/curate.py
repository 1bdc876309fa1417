"""The curator's loop: a variant for a new epoch, by command (series start, continue, record,
--abort, --restore), one state file in the tree's git dir, as git's sequencer keeps its own.

What a reset of the tree would throw away is saved first (refs/dfbuild/saved), and a damaged or
interrupted curation is resumed or refused, never guessed at.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, cast

import git

from dfbuild.core import gitrun, journal, manifest, state, ui
from dfbuild.core.errors import DirtyTreeError, NotLlamaTreeError, UsageError
from dfbuild.model.patchfile import commit_message, patch_author, patch_path, verify_patch
from dfbuild.model.series import CONCERN_TRAILER, Series
from dfbuild.series import carry as carrying
from dfbuild.series.adopt import refresh
from dfbuild.series.check import CARRIED, _try_apply
from dfbuild.source import checkout as source

# --- the curator's loop: a variant for a new epoch, by command ----------------------------------------
#
#   dfbuild series start --base bN --dir D     carry every concern that carries, one commit each
#   (edit, git commit with the trailer)         for the concern that does not
#   dfbuild series continue --dir D            carry the rest the same way
#   dfbuild series record --dir D --onto bN    the commits become bN's variant (refresh + base info)
#   dfbuild prove --base bN; series record-proof --work WORK   on the epoch's first and last release

CURATE_STATE = "curate.json"
NOT_NEEDED_MARK = "not needed: "  # a carried not-needed decision, in the curation's decisions
SAVED_REFS = "refs/dfbuild/saved"  # refs/dfbuild/saved/STAMP: what a reset of the tree would have thrown away
SAVED_DIR = "saved"  # .git/dfbuild/saved/STAMP.json: where it was (branch, HEAD, the curation state)
_KEYS = {"base": str, "onto": str, "orig_head": str, "head": str, "todo": list, "done": list, "decisions": dict,
         "finished": bool}


def require_git_tree(tree: Path, why: str) -> Path:
    """TREE as a git work tree, or the documented error (13) naming it: never a git traceback."""
    tree = Path(tree)
    if not tree.is_dir():
        raise NotLlamaTreeError(f"{tree} is not a directory, so it holds no curation; nothing was done",
                                f"pass the --dir that `dfbuild series start` made ({why})")
    inside = gitrun.run(tree, "rev-parse", "--is-inside-work-tree", check=False)
    top = gitrun.run(tree, "rev-parse", "--show-toplevel", check=False).stdout.strip()
    if inside.returncode != 0 or inside.stdout.strip() != "true" or Path(top).resolve() != tree.resolve():
        raise NotLlamaTreeError(f"{tree} is not a git checkout, so it holds no curation; nothing was done",
                                f"pass the --dir that `dfbuild series start` made ({why})")
    return tree


def curate_state_path(tree: Path) -> Path:
    """The curation's state, in the tree's git dir (as git keeps a rebase's): it goes where the tree goes."""
    found = gitrun.run(tree, "rev-parse", "--absolute-git-dir", check=False)
    git_dir = found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else str(Path(tree) / ".git")
    return Path(git_dir) / "dfbuild" / CURATE_STATE


def refuse_while_curating(tree: Path, command: str) -> None:
    """A command that moves TREE (checkout, apply) must not move it off a curation in progress."""
    tree = Path(tree)
    if not (tree / ".git").exists():
        return
    data = read_curation(tree)
    if data and data.get("finished") is not True:
        raise UsageError(f"{in_progress(tree, data)}; `dfbuild {command}` would move the tree off it, so nothing "
                         "was done", f"finish it (dfbuild series continue --dir {tree}) or abort it (--abort) first")


def _is_commit(tree: Path, rev: object) -> bool:
    return isinstance(rev, str) and bool(re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", rev)) and gitrun.run(
        tree, "cat-file", "-e", f"{rev}^{{commit}}", check=False).returncode == 0


def curation_problem(tree: Path, data: dict) -> str | None:
    """Why DATA is not a whole curation state (a missing or wrong field), or None."""
    for key, kind in _KEYS.items():
        if not isinstance(data.get(key), kind):
            return f"{key} is missing or not a {kind.__name__}"
    for key in ("onto", "orig_head", "head"):
        if not _is_commit(tree, data[key]):
            return f"{key} is not a commit of this tree"
    if data.get("waiting") is not None and (not data["todo"] or data["waiting"] != data["todo"][0]):
        return "waiting is not the next concern to do"
    if not all(isinstance(c, str) for c in data["todo"]):
        return "todo is not a list of concerns"
    return None


def read_curation(tree: Path) -> dict | None:
    data = state.read_json(curate_state_path(tree), "curation state")
    return data if isinstance(data, dict) and data else None


def _write_curation(tree: Path, data: dict) -> None:
    """The whole state, every key, atomically: a kill leaves the previous state or this one."""
    path = curate_state_path(tree)
    state.record_dir_ready(path.parent)
    state.atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _forget_curation(tree: Path) -> None:
    try:
        curate_state_path(tree).unlink()
    except FileNotFoundError:
        pass


def _stamp() -> str:
    """UTC time to the nanosecond, then the pid: saves sort by when they were made, and never share a name."""
    now = time.time_ns()
    seconds = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now // 1_000_000_000))
    return f"{seconds}.{now % 1_000_000_000:09d}-{os.getpid()}"


def save_tree(tree: Path, why: str, curation: dict | None = None) -> dict | None:
    """Keep what a reset of TREE would throw away, where git users look, before anything is reset.

    Uncommitted changes (staged and not) become a stash commit (`git stash create`,
    then `git stash store`: it shows in `git stash list`); HEAD's commits are kept by
    it too (HEAD is its parent). A ref refs/dfbuild/saved/STAMP holds it (or HEAD,
    when nothing is uncommitted), so no gc or `git stash drop` loses it, and
    .git/dfbuild/saved/STAMP.json says where the tree was (branch, HEAD, the
    curation's state) for `series continue --restore`. Untracked files are not
    touched by a reset and stay where they are. None when there is nothing to keep.
    """
    tree = Path(tree)
    head = gitrun.run(tree, "rev-parse", "--verify", "--quiet", "HEAD", check=False).stdout.strip()
    stash = gitrun.run(tree, "stash", "create", f"dfbuild: {why}", check=False)
    if stash.returncode != 0:
        raise DirtyTreeError(f"{tree} has changes git cannot stash ({stash.stderr.strip()[:200]}); nothing was done",
                             f"resolve them (git -C {tree} status), commit or stash them, then run again")
    saved = stash.stdout.strip() or None
    keep = saved or head
    if not keep or (saved is None and (curation is None or head == curation.get("orig_head"))):
        return None  # nothing uncommitted, and no commit that the reset would leave behind
    stamp = _stamp()
    branch = gitrun.run(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip() or None
    record = {"stamp": stamp, "why": why, "ref": f"{SAVED_REFS}/{stamp}", "stash": saved, "head": head,
              "branch": branch, "curation": curation, "made_ns": time.time_ns()}
    folder = curate_state_path(tree).parent / SAVED_DIR
    state.record_dir_ready(folder.parent)
    state.record_dir_ready(folder)
    state.atomic_write_text(folder / f"{stamp}.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    gitrun.run(tree, "update-ref", "-m", f"dfbuild: {why}", record["ref"], keep)
    if saved:
        gitrun.run(tree, "stash", "store", "-m", f"dfbuild: {why} (restore: dfbuild series continue --restore)", saved)
    state.fault_point("save: kept")
    return record


def saved_words(tree: Path, record: dict) -> str:
    """One line: where the bytes went and how to get them back."""
    if record["stash"]:
        return (f"saved your uncommitted changes as stash {record['stash'][:12]} ({record['ref']}); "
                f"restore them with `dfbuild series continue --dir {tree} --restore` "
                f"(or `git -C {tree} checkout {record['stash']} -- .`)")
    return (f"kept the curation's commits as {record['ref']} ({record['head'][:12]}); restore them with "
            f"`dfbuild series continue --dir {tree} --restore` (or `git -C {tree} reset --hard {record['ref']}`)")


def _with_trailer(message: str, concern_id: str) -> str:
    """The variant's own message; a patch made before the trailer existed gets it, so refresh can read it."""
    if re.search(rf"^{CONCERN_TRAILER}:[ \t]*{re.escape(concern_id)}\s*$", message, re.M):
        return message
    return message.rstrip("\n") + f"\n\n{CONCERN_TRAILER}: {concern_id}\n"


def _concern_of(tree: Path, commit: str) -> str | None:
    body = gitrun.run(tree, "log", "-1", "--format=%B", commit).stdout
    match = re.search(rf"^{CONCERN_TRAILER}:[ \t]*(\S+)", body, re.M)
    return match.group(1) if match else None


def _carry_one(series: Series, tree: Path, concern, order: list[str], onto: str, preimages: dict, tmp: Path):
    """Decide CONCERN on the tree's HEAD as `carry` does: already there, carried, upstream, or a conflict."""
    index = tmp / f"curate-{concern.id}"
    env = {"GIT_INDEX_FILE": str(index)}
    gitrun.run(tree, "read-tree", "HEAD", extra_env=env)
    for name in order:
        variant = concern.variants.get(name)
        if variant is not None and variant.file and _try_apply(
                tree, verify_patch(series, concern, variant), env, "--reverse").returncode == 0:
            return "present", variant, f"already in the tree: the {variant.base} variant reverse-applies"
    gitrun.run(tree, "read-tree", "HEAD", extra_env=env)
    step = carrying._carry_concern(series, tree, concern, order, index, preimages, tmp, onto)
    return step.status, step.variant, step.detail


def _advance(series: Series, tree: Path, data: dict) -> dict:
    """Carry the concerns still to do, in series order, one commit each; stop at the first conflict."""
    repo = git.Repo(tree)
    order = carrying.nearest_bases(series, tree, data["onto"])
    preimages: dict = {}
    with state.temp_dir("curate") as tmp:
        while data["todo"]:
            concern = series.concern(data["todo"][0])
            status, variant, detail = _carry_one(series, tree, concern, order, data["onto"], preimages, Path(tmp))
            if status in CARRIED:
                patch = patch_path(series, variant)
                gitrun.run(tree, "apply", "--index", *(["--3way"] if status == "3-way" else []), str(patch))
                state.fault_point(f"curate: {concern.id} staged")
                commit = source.commit_patch(repo, _with_trailer(commit_message(patch), concern.id),
                                             *patch_author(patch))
                state.fault_point(f"curate: {concern.id} committed")
                data["done"].append({"id": concern.id, "how": detail, "commit": commit})
            elif status in ("upstream", "present", "applied", "not-needed"):
                # nothing to commit: the decision goes to `series record`, which writes it as the variant
                data["decisions"][concern.id] = (NOT_NEEDED_MARK if status == "not-needed" else "") + detail
                data["done"].append({"id": concern.id, "how": f"upstream, no commit: {detail}", "commit": None})
            else:
                data.update({"waiting": concern.id, "waiting_detail": detail, "head": repo.head.commit.hexsha})
                _write_curation(tree, data)
                state.fault_point(f"curate: stopped at {concern.id}")
                return data
            data["todo"].pop(0)
            data["head"] = repo.head.commit.hexsha
            _write_curation(tree, data)  # each step recorded as it is made: an interrupted run resumes
            state.fault_point(f"curate: {concern.id} recorded")
    data.update({"waiting": None, "waiting_detail": None, "finished": True, "head": repo.head.commit.hexsha})
    _write_curation(tree, data)
    return data


def curate_start(series: Series, tree: Path, base: str) -> dict:
    """Begin a variant for BASE on TREE (checked out at BASE): carry what carries, stop at a conflict."""
    tree = Path(tree)
    known = read_curation(tree)
    if known and not known.get("finished"):
        raise UsageError(in_progress(tree, known), f"finish it with `dfbuild series continue --dir {tree}`, "
                                                   "or `--abort` it")
    if git.Repo(tree).is_dirty(untracked_files=True):
        raise DirtyTreeError(f"{tree} has local changes; nothing was done", "commit or stash them first")
    repo = git.Repo(tree)
    head = repo.head.commit.hexsha
    data: dict[str, Any] = {"base": base, "onto": head, "orig_head": head, "head": head,
            "branch": None if repo.head.is_detached else repo.active_branch.name,
            "todo": [c.id for c in series.concerns], "done": [], "decisions": {},
            "waiting": None, "waiting_detail": None, "finished": False}
    _write_curation(tree, data)
    state.fault_point("curate: started")
    return _advance(series, tree, data)


def in_progress(tree: Path, data: dict) -> str:
    """What the curation in TREE is doing, for a refusal: stopped at a concern, or interrupted."""
    if data.get("waiting"):
        return f"{tree}: a curation of {data.get('base')} is in progress (stopped at {data['waiting']})"
    return (f"{tree}: a curation of {data.get('base') or '?'} was interrupted before it stopped or finished "
            "(`series continue` finishes it, `--abort` undoes it)")


def _resume_interrupted(tree: Path, data: dict) -> None:
    """A run killed between two recorded steps: take in what it committed, keep aside what it only staged.

    A commit on top of the recorded head with the trailer of the next concern is
    that run's: it is counted as done. Changes in the tree (a patch staged, not
    committed) are saved (save_tree, where the user can get them) before the tree
    goes back to the recorded head, from where the concern is carried again.
    """
    new = gitrun.run(tree, "rev-list", "--reverse", f"{data['head']}..HEAD").stdout.split()
    for commit in new:
        concern = _concern_of(tree, commit)
        if not data["todo"] or concern != data["todo"][0]:
            raise UsageError(f"{tree}: commit {commit[:12]} ({concern or 'no trailer'}) is not the next concern "
                             f"the interrupted curation was carrying ({data['todo'][0] if data['todo'] else 'none'})",
                             f"undo it (git -C {tree} reset --hard {data['head'][:12]}), or abort the curation")
        data["done"].append({"id": concern, "how": "carried (finished after an interrupted run)", "commit": commit})
        data["todo"].pop(0)
        data["head"] = commit
    if git.Repo(tree).is_dirty(untracked_files=False):
        kept = save_tree(tree, "series continue (a half-carried step of an interrupted run)")
        gitrun.run(tree, "reset", "--hard", "-q", data["head"])
        if kept:
            ui.warn(f"{tree}: an interrupted curation had left changes in the tree; {saved_words(tree, kept)}")
    _write_curation(tree, data)


def curate_continue(series: Series, tree: Path, upstream_note: str | None = None) -> dict:
    """Resume after the concern the curation stopped at was committed by hand (or, with
    UPSTREAM_NOTE, decided to be upstream already); or finish a run that was interrupted."""
    tree = Path(tree)
    data = read_curation(tree)
    if not data or data.get("finished") is True:
        raise UsageError(f"{tree}: no curation is in progress", "start one with `dfbuild series start`")
    why = curation_problem(tree, data)
    if why:
        raise UsageError(f"{tree}: the curation state {curate_state_path(tree)} is damaged ({why}); nothing was done",
                         f"`dfbuild series continue --dir {tree} --abort` puts the tree back where the curation began")
    waiting = data.get("waiting")
    if not waiting:  # interrupted between two steps: finish what it was doing
        if upstream_note is not None:
            raise UsageError(f"{tree}: the curation is not stopped at a concern (it was interrupted)",
                             "continue without --upstream: the interrupted run is finished first")
        _resume_interrupted(tree, data)
        return _advance(series, tree, data)
    repo = git.Repo(tree)
    if repo.is_dirty(untracked_files=False):
        raise DirtyTreeError(f"{tree} has uncommitted changes",
                             f"commit the {waiting} change with the trailer '{CONCERN_TRAILER}: {waiting}', "
                             "then continue")
    new = gitrun.run(tree, "rev-list", "--reverse", f"{data['head']}..HEAD").stdout.split()
    if upstream_note is not None:
        if new:
            raise UsageError(f"{tree}: {waiting} was committed, so it is not upstream",
                             "continue without --upstream")
        data["decisions"][waiting] = upstream_note
        data["done"].append({"id": waiting, "how": f"upstream, no commit: {upstream_note}", "commit": None})
    else:
        made = [(commit, _concern_of(tree, commit)) for commit in new]
        if [concern for _, concern in made] != [waiting]:
            found = ", ".join(f"{c[:12]} ({concern or 'no trailer'})" for c, concern in made) or "no new commit"
            raise UsageError(f"{tree}: continuing needs one new commit for {waiting} with the trailer "
                             f"'{CONCERN_TRAILER}: {waiting}'; found {found}",
                             f"git commit -a -m 'SUBJECT' -m '{CONCERN_TRAILER}: {waiting}' "
                             "(or squash into one), then continue")
        data["done"].append({"id": waiting, "how": "written by hand", "commit": made[0][0]})
        data["head"] = made[0][0]
    data["todo"].pop(0)
    data["waiting"] = None
    data["waiting_detail"] = None
    _write_curation(tree, data)
    state.fault_point(f"curate: {waiting} continued")
    return _advance(series, tree, data)


def curate_abort(tree: Path) -> dict:
    """Put the tree back where `series start` found it, and forget the curation.

    First, what the reset would throw away (uncommitted changes, the curation's
    commits) is saved (save_tree): `saved` in the result says where.
    """
    tree = Path(tree)
    data = read_curation(tree)
    if not data:
        raise UsageError(f"{tree}: no curation to abort", "nothing was changed")
    orig_head = data.get("orig_head") if _is_commit(tree, data.get("orig_head")) else None
    if orig_head:  # an untracked file of the user's that the reset would overwrite: not ours to lose
        untracked = set(gitrun.run(tree, "ls-files", "-z", "--others", "--exclude-standard").stdout.split("\0")) - {""}
        target = set(gitrun.run(tree, "ls-tree", "-r", "-z", "--name-only", orig_head).stdout.split("\0"))
        in_the_way = sorted(untracked & target)
        if in_the_way:
            raise DirtyTreeError(f"{tree}: your untracked file {in_the_way[0]}"
                                 + (f" (and {len(in_the_way) - 1} more)" if len(in_the_way) > 1 else "")
                                 + f" would be overwritten by going back to {orig_head[:12]}; nothing was done",
                                 "move it out of the tree (or commit it), then abort again")
    kept = save_tree(tree, f"series continue --abort of the curation of {data.get('base') or '?'}", curation=data)
    state.fault_point("abort: saved")
    if orig_head is None:  # a damaged state names no commit to go back to: forget it, move nothing
        _forget_curation(tree)
        return {"dir": str(tree), "head": None, "base": data.get("base"), "saved": kept,
                "note": "the curation state named no commit to go back to; the tree was left where it is"}
    repo = git.Repo(tree)
    branch = data.get("branch")
    if isinstance(branch, str) and branch and (repo.head.is_detached or repo.active_branch.name != branch):
        gitrun.run(tree, "checkout", "-q", "--force", branch)
    gitrun.run(tree, "reset", "--hard", "-q", orig_head)
    state.fault_point("abort: reset")
    _forget_curation(tree)
    return {"dir": str(tree), "head": orig_head, "base": data.get("base"), "saved": kept}


def saved_records(tree: Path) -> list[dict]:
    """The saves of TREE (save_tree) whose ref is still there, oldest first (by when each was made)."""
    folder = curate_state_path(tree).parent / SAVED_DIR
    records = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = state.read_json(path, "saved-changes record")
        ref = record.get("ref")
        if not isinstance(ref, str) or not ref.startswith(SAVED_REFS + "/"):
            continue
        branch, stash = record.get("branch"), record.get("stash")
        if (branch is not None and not journal.branch_ok(branch)) or (
                stash is not None and not (isinstance(stash, str) and re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?",
                                                                                    stash))):
            # every name a record gives reaches git only once checked: a crafted branch or stash is not ours
            ui.warn(f"ignoring the saved-changes record {path}: its branch or stash is not one dfbuild writes")
            continue
        if gitrun.run(tree, "rev-parse", "--verify", "--quiet", ref, check=False).returncode == 0:
            records.append({**record, "path": str(path)})
    made = [r.get("made_ns") if isinstance(r.get("made_ns"), int) else 0 for r in records]
    return [r for _, _, r in sorted(zip(made, range(len(records)), records, strict=False), key=lambda x: x[:2])]


def curate_restore(tree: Path) -> dict:
    """Undo the newest save (an --abort): the tree back at its HEAD, the uncommitted changes back byte for
    byte (index too), and the curation's state back, so `series continue` goes on where it was."""
    tree = Path(tree)
    records = saved_records(tree)
    if not records:
        raise UsageError(f"{tree}: nothing saved to restore", f"`git -C {tree} stash list` lists git's own stashes")
    record = records[-1]
    current = read_curation(tree)
    if current and not current.get("finished"):
        raise UsageError(in_progress(tree, current), "abort it first (its changes are saved too), then restore")
    repo = git.Repo(tree)
    if repo.is_dirty(untracked_files=False):
        raise DirtyTreeError(f"{tree} has uncommitted changes; nothing was restored",
                             "commit or stash them first: restoring would overwrite them")
    if not _is_commit(tree, record.get("head")):
        raise UsageError(f"{tree}: the save {record['path']} names no commit of this tree", "nothing was restored")
    branch = record.get("branch")
    moved = (gitrun.run(tree, "checkout", "-q", "-B", branch, record["head"], check=False)
             if isinstance(branch, str) and branch else
             gitrun.run(tree, "checkout", "-q", "--detach", record["head"], check=False))
    if moved.returncode != 0:
        raise DirtyTreeError(f"{tree}: cannot go back to {record['head'][:12]}: {moved.stderr.strip()[:300]}; "
                             "nothing was restored", "move the files git names out of the way, then run again")
    if record.get("stash"):
        applied = gitrun.run(tree, "stash", "apply", "--index", record["stash"], check=False)  # on its parent: exact
        if applied.returncode != 0:
            raise DirtyTreeError(f"{tree}: the saved changes {record['stash'][:12]} did not apply: "
                                 f"{applied.stderr.strip()[:300]}",
                                 f"they are still in {record['ref']}: git -C {tree} checkout {record['stash']} -- .")
    if isinstance(record.get("curation"), dict) and record["curation"]:
        _write_curation(tree, record["curation"])
    gitrun.run(tree, "update-ref", "-d", record["ref"])
    Path(record["path"]).unlink(missing_ok=True)
    return {"dir": str(tree), "head": record["head"], "branch": branch, "stash": record.get("stash"),
            "ref": record["ref"], "curation": bool(record.get("curation"))}


def record(series: Series, tree: Path, onto: str, *, decisions: dict[str, str] | None = None,
           note: str | None = None, not_needed: dict[str, str] | None = None) -> dict:
    """The concern commits on top of ONTO become ONTO's variant; with the base's build and sdist.

    Decisions made by `series start` (concerns upstream already) are recorded too; DECISIONS adds
    to (or overrides) them.
    """

    tree = Path(tree)
    curation = read_curation(tree) or {}
    if curation and curation.get("finished") is not True:
        raise UsageError(in_progress(tree, curation), f"finish it first: dfbuild series continue --dir {tree}")
    if curation and curation_problem(tree, curation):
        curation = {}  # a damaged state: its decisions are not trusted; --upstream gives them
    rev = curation.get("onto") if curation.get("base") == onto else onto
    started = dict(curation.get("decisions", {}))
    # A variant revised on its own base: what `series start` carried from that base's own decision is
    # series.toml's entry, in series.toml's words (refresh keeps its marker), not "... as recorded for".
    for cid in started:
        own = series.concern(cid).variants.get(onto)
        if own is not None and own.status in ("upstream", "not-needed") and own.note:
            started[cid] = (NOT_NEEDED_MARK if own.status == "not-needed" else "") + own.note
    all_decisions = {**started, **(decisions or {})}
    not_needed = {**{cid: note[len(NOT_NEEDED_MARK):] for cid, note in all_decisions.items()
                     if note.startswith(NOT_NEEDED_MARK)}, **(not_needed or {})}
    all_decisions = {cid: note for cid, note in all_decisions.items() if cid not in not_needed}
    known_note = series.bases.get(onto, {}).get("note") if onto in series.variant_bases else None
    info: dict = {"note": note or known_note
                  or f"llama.cpp {onto}, the first release of its epoch (dfbuild series start)"}
    build = source.release_build(onto)
    if build is not None:
        info["build"] = build
    src = manifest.load(manifest.tree_manifest_path(tree)).get("source") or {}
    if src.get("kind") == "sdist" and src.get("base") == onto and str(src.get("repo", "")).startswith("pypi:"):
        info["sdist"] = src["repo"][len("pypi:"):]  # where the base's tree comes from, offline
    return refresh(series, tree, cast(str, rev), name=onto, base_info=info, decisions=all_decisions,
                   not_needed=not_needed)
