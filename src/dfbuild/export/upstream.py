"""`dfbuild series export --upstream`: the series as a llama.cpp pull request would carry it.

For a base the series serves, the export is made in a scratch checkout of that
base (never the user's tree): `series.apply_series` commits every concern the
series applies there, exactly as `dfbuild apply` would; those commits are squashed
into one commit in llama.cpp's style (``spec : ...``), and a second commit adds
a server test for upstream's own harness (tools/server/tests, `ServerProcess`)
that writes its tiny models with the tree's gguf-py. `git format-patch` turns
the two into patch files, and PR.md follows the tree's pull request template.

Nothing here names a patch file: what the fix commit holds is whatever the series
applies at that base, and its message is built from those patches' own messages.

The output dir is written whole or not at all: everything is made in a sibling
staging dir and renamed into place. An existing non-empty dir is replaced only
when it is an earlier export, unchanged (its marker lists every file and its
sha256); anything else in it is the user's and is refused (exit 26).
"""

from __future__ import annotations

import email.utils
import json
import os
import re
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from dfbuild import series as series_mod
from dfbuild.core import gitrun, proc, state, ui
from dfbuild.core.errors import DfbuildError, ExportError, ExportIdentityError, UsageError
from dfbuild.core.paths import sha256_file
from dfbuild.export.text import (
    FIX_SUBJECT,
    REQUIREMENTS,
    SUBMITTER_NOTE,
    TEST_NAME,
    TEST_PATH,
    WHEN,
    digest,
    fix_message,
    measured_for,
    origin_urls,
    pr_text,
    requirements_with_yaml,
    test_message,
    test_source,
    upstream_message,
)
from dfbuild.series import squash
from dfbuild.source import checkout as source

MARKER_NAME = ".dfbuild-export.json"
EXPORT_SCHEMA = 2
TEMPLATE = ".github/pull_request_template.md"
SPECULATIVE = "common/speculative.cpp"


# --- who and when ----------------------------------------------------------------------------


def parse_author(text: str) -> tuple[str, str]:
    """--author "Name <email>" as git takes it; a usage error (exit 2) when it is not that."""
    name, address = email.utils.parseaddr(text)
    if not name.strip() or "@" not in address or "<" not in text:
        raise UsageError(f"--author {text!r} is not \"Name <email>\"", 'pass --author "Your Name <you@example.org>"')
    return name.strip(), address


def submitter(author: str | None = None, cwd: Path | None = None) -> tuple[str, str]:
    """(name, email) the patches are authored by: --author, else the git identity git format-patch would use.

    `git var GIT_AUTHOR_IDENT` reads GIT_AUTHOR_NAME/GIT_AUTHOR_EMAIL, then the config of the repository
    CWD is in, then the user's (and `git -c user.name=...` around the command). An identity git would only
    guess from the host name is refused (user.useConfigOnly), as is none at all: exit 27."""
    if author is not None:
        return parse_author(author)
    result = gitrun.run(None, "-c", "user.useConfigOnly=true", "var", "GIT_AUTHOR_IDENT", check=False, cwd=cwd)
    match = re.match(r"^(.+?) <([^<>]+)> \d+ [+-]\d{4}$", result.stdout.strip())
    if result.returncode != 0 or not match:
        raise ExportIdentityError(
            "no author for the patches: no --author, and git has no identity here (user.name and user.email)",
            'pass --author "Your Name <you@example.org>", or set git config user.name and user.email')
    return match.group(1), match.group(2)


def export_date(environ: dict | None = None) -> str:
    """The commits' date (RFC 2822, UTC): SOURCE_DATE_EPOCH when set, for reproducible bytes; else now."""
    value = (os.environ if environ is None else environ).get("SOURCE_DATE_EPOCH")
    if value:
        if not value.isdigit():
            raise UsageError(f"SOURCE_DATE_EPOCH={value!r} is not a number of seconds",
                             "set it to a Unix time, e.g. $(git log -1 --format=%ct), or unset it")
        when = datetime.fromtimestamp(int(value), timezone.utc)
    else:
        when = datetime.now(timezone.utc).replace(microsecond=0)
    return email.utils.format_datetime(when)


# --- the output dir --------------------------------------------------------------------------


def _read_marker(out: Path) -> dict | None:
    marker = out / MARKER_NAME
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == "dfbuild" else None


def check_out_dir(out: Path) -> bool:
    """Whether OUT may be (re)written: absent, empty, or an unchanged earlier export. Refuses anything else."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out} exists and is not a directory; nothing was written",
                          "pass --out a new or empty directory")
    if not out.exists():
        return False
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return False
    marker = _read_marker(out)
    if marker is None:
        raise ExportError(f"{out} is not empty and is not an earlier dfbuild export; nothing was written",
                          "pass --out a new or empty directory, or move its files away")
    files = marker.get("files")
    if not isinstance(files, dict):
        files = {}
    extra = [name for name in entries if name != MARKER_NAME and name not in files]
    changed = [name for name, digest in files.items()
               if not (out / name).is_file() or (out / name).is_symlink() or sha256_file(out / name) != digest]
    if extra or changed:
        which = (extra + changed)[0]
        raise ExportError(f"{out} is an earlier dfbuild export, but {which} "
                          + ("is not one of its files" if which in extra else "changed since dfbuild wrote it")
                          + "; nothing was written", "move your files away, or pass --out another directory")
    return True


def _sweep_staging(out: Path) -> None:
    """Staging dirs an interrupted export of OUT left behind (dfbuild's by name and marker)."""
    for leftover in out.parent.glob(f".{out.name}.export-*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


def _publish(staging: Path, out: Path, replace: bool) -> None:
    """Rename STAGING to OUT: OUT is the old export or the new one, never half of either."""
    if replace:
        old = out.parent / f".{out.name}.export-old-{os.getpid()}"
        os.rename(out, old)
        try:
            os.rename(staging, out)
        except OSError:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    elif out.exists():
        os.rmdir(out)  # empty (checked): the rename needs the name free on every OS
        os.rename(staging, out)
    else:
        os.rename(staging, out)


# --- the export ------------------------------------------------------------------------------


def _failed(what: str, result: proc.CompletedProcess) -> str:
    """WHAT, then git's last line of stderr: the export's words for a git command that failed."""
    return f"{what}: " + (result.stderr.strip().splitlines() or ["(no message)"])[-1]


def _git(tree: Path, *args: str, extra_env: dict[str, str] | None = None, input: str | None = None) -> str:
    """The stdout of `git -C TREE ARGS` in the scratch checkout; ExportError (26) with git's words when it fails."""
    result = gitrun.run(tree, *args, check=False, extra_env=extra_env, input=input)
    if result.returncode != 0:
        raise ExportError(_failed(f"git {args[0]} failed in the scratch checkout", result), None)
    return result.stdout


def _commit_env(author: tuple[str, str], date: str) -> dict[str, str]:
    name, address = author
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": address, "GIT_AUTHOR_DATE": date,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": address, "GIT_COMMITTER_DATE": date,
            "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.hooksPath", "GIT_CONFIG_VALUE_0": os.devnull}


def _commit(tree: Path, message: str, author: tuple[str, str], date: str) -> str:
    _git(tree, "commit", "--no-verify", "--no-gpg-sign", "-q", "-F", "-", input=message,
         extra_env=_commit_env(author, date))
    return _git(tree, "rev-parse", "HEAD").strip()


def build_commits(curated, tree: Path, *, base: str, author: tuple[str, str], date: str) -> dict:
    """In TREE (a scratch checkout of BASE), make the fix commit and the test commit; return what was done."""
    tree = Path(tree)
    start = _git(tree, "rev-parse", "HEAD").strip()
    section = series_mod.apply_series(curated, tree)
    applied = []
    for entry in section["concerns"]:
        if entry.get("status") != "applied":
            continue
        patch = curated.root / entry["file"]
        subject, body = upstream_message(patch)
        applied.append({"id": entry["id"], "file": entry["file"], "how": entry.get("how") or entry.get("detail"),
                        "subject": subject, "body": body, "origin_urls": origin_urls(patch), "patch": patch})
    if not applied:
        raise ExportError(f"the series applies no patch at {section['base']}: every concern is upstream or "
                          "decided there, so there is nothing to send", "pick a base the series patches")
    _git(tree, "reset", "--soft", "-q", start)
    fix = _commit(tree, fix_message(applied, curated.bug, base), author, date)

    test_file = tree / TEST_PATH
    test_file.parent.mkdir(parents=True, exist_ok=True)
    test_file.write_text(test_source(), encoding="utf-8")
    paths = [TEST_PATH]
    requirements = tree / REQUIREMENTS
    if requirements.is_file():
        updated = requirements_with_yaml(requirements.read_text(encoding="utf-8"))
        if updated is not None:
            requirements.write_text(updated, encoding="utf-8")
            paths.append(REQUIREMENTS)
    _git(tree, "add", "--", *paths)
    test = _commit(tree, test_message(REQUIREMENTS in paths), author, date)
    return {"start": start, "base": section["base"], "section": section, "applied": applied,
            "fix_commit": fix, "test_commit": test, "requirements": REQUIREMENTS in paths,
            # what the fix changes, whatever its message and date: the key of a recorded test result
            "fix_sha256": digest(_git(tree, "diff", "--full-index", start, fix))}


# --- without a tree --------------------------------------------------------------------------


def without_tree(curated, base: str, repo: str | None) -> bool:
    """Whether BASE's export is made from its variants alone: a base whose tree only a git host has (a PR
    head such as 5ecbe1a: no sdist, not a release), which series.toml serves with a variant of its own in
    every concern, and no --repo to fetch it from. Same inputs, same answer: the network is never asked."""
    if repo is not None or base not in curated.bases:
        return False
    known = source.known_base(base)
    if known is None or known.sdist or source.release_build(base) is not None:
        return False
    return all(base in concern.variants for concern in curated.concerns)


def build_commits_without_tree(curated, base: str, tree: Path, *, author: tuple[str, str], date: str) -> dict:
    """In TREE (a new scratch repo), the fix and test commits made from BASE's variants alone.

    The files the variants change are rebuilt sparsely from the patches' own lines (dfbuild.series.squash), the
    patches are applied to them as `apply` would (zero fuzz, in order), and the result is squashed into
    one commit; `sparse` holds the real blob ids that format-patch's index lines must name."""
    applied, decided = [], []
    for concern in curated.concerns:
        variant = concern.variants[base]
        if not variant.file:
            decided.append({"id": concern.id, "status": variant.status, "detail": variant.note})
            continue
        patch = series_mod.verify_patch(curated, concern, variant)
        subject, body = upstream_message(patch)
        applied.append({"id": concern.id, "file": variant.file,
                        "how": f"variant {base}, not applied to a tree here", "subject": subject, "body": body,
                        "origin_urls": origin_urls(patch), "patch": patch})
    if not applied:
        raise ExportError(f"the series applies no patch at {base}: every concern is upstream or decided "
                          "there, so there is nothing to send", "pick a base the series patches")
    chains: dict[str, list] = {}
    for entry in applied:
        for diff in squash.parse(entry["patch"].read_text(encoding="utf-8"), entry["patch"].name):
            chains.setdefault(diff.path, []).append((entry["patch"].name, diff))
    tree.mkdir(parents=True)
    _git(tree, "init", "-q")
    sparse = {}
    for path, chain in chains.items():
        text, old, new, _mode = squash.sparse_base(chain)
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text, encoding="utf-8")
        sparse[path] = (old, new)
    _git(tree, "add", "-A")
    start = _commit(tree, f"the lines of {base} that its variants show\n", author, date)
    for entry in applied:
        result = gitrun.run(tree, "apply", "--index", "--whitespace=nowarn", str(entry["patch"]), check=False)
        if result.returncode != 0:
            raise ExportError(_failed(f"{entry['file']} does not apply after the variant's earlier patches", result),
                              "pass --repo with the base's tree")
    _commit(tree, fix_message(applied, curated.bug, base), author, date)
    test_file = tree / TEST_PATH
    test_file.parent.mkdir(parents=True, exist_ok=True)
    test_file.write_text(test_source(), encoding="utf-8")
    _git(tree, "add", "--", TEST_PATH)
    _commit(tree, test_message(requirements=False), author, date)
    info = curated.bases.get(base, {})
    known = source.known_base(base)
    # the blob the fix's index line names as its preimage: what the variant was made on
    made_on_blob = sparse.get(SPECULATIVE, next(iter(sparse.values())))[0]
    return {"start": start, "base": base, "section": {"base": base, "concerns": decided}, "applied": applied,
            "requirements": False, "sparse": sparse,
            "base_commit": info.get("commit") or (known.commit if known else None),
            "made_on": {"blob": made_on_blob, "note": info.get("made_on_note")}}


def _load_json(path: Path | None) -> dict | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        ui.warn(f"{path} is not readable JSON; PR.md leaves it out")
        return None
    return data if isinstance(data, dict) else None


def export_upstream(curated, base: str, out: Path, *, repo: str | None = None, author: str | None = None,
                    measured_file: Path | None = None) -> dict:
    """Write BASE's upstream export into OUT (atomically); return what was written.

    Made in a scratch checkout of BASE, or, for a base whose tree only a git host has and no --repo
    (without_tree), from BASE's variants alone: then PR.md and stderr say it was not applied to a tree.
    AUTHOR ("Name <email>") or else the user's git identity authors the commits (submitter), dated now or
    at SOURCE_DATE_EPOCH (export_date)."""
    who = submitter(author)
    date = export_date()
    out = Path(out).absolute()
    replace = check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_staging(out)
    repo_root = curated.root.parent
    measured_file = measured_file or repo_root / "bench" / "upstream" / f"upstream-test-{base}.json"
    treeless = without_tree(curated, base, repo)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 is for scratch, not for a result
        with state.temp_dir("export") as scratch:
            tree = scratch / "llama.cpp"
            if treeless:
                ui.warn(f"{base}'s tree is not here (no --repo): the export is made from series.toml's "
                        f"{base} variant alone and was NOT applied to a {base} tree; PR.md says so")
                with ui.step(f"squash the {base} variant, add the server test (no tree)"):
                    made = build_commits_without_tree(curated, base, tree, author=who, date=date)
                checked = {"kind": "series-variant", "repo": None, "commit": made["base_commit"]}
                base_commit = made["base_commit"]
            else:
                with ui.step(f"checkout {base} (a scratch tree)"):
                    checked = source.checkout(base, repo=repo, dest=tree)
                with ui.step("apply the series, squash it, add the server test"):
                    made = build_commits(curated, tree, base=base, author=who, date=date)
                base_commit = made["start"]
            patches_dir = staging
            with ui.step("git format-patch"):
                listed = _git(tree, "format-patch", "--zero-commit", "--no-signature", "--full-index",
                              "-o", str(patches_dir), f"{made['start']}..HEAD").split()
            names = [Path(p).name for p in listed]
            if treeless:  # the index lines name the real blobs, not the sparse files'
                for name in names:
                    path = staging / name
                    path.write_text(squash.real_index_lines(path.read_text(encoding="utf-8"), made["sparse"]),
                                    encoding="utf-8")
            template_path = tree / TEMPLATE
            template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
            recorded = _load_json(measured_file)
            measured = measured_for(recorded, base=base, fix_sha256=made.get("fix_sha256"))
            if recorded and not measured:
                ui.warn(f"{measured_file} was not measured with this export's test and fix at {base}; PR.md "
                        "reports no test result (run tests/test_export_real.py and record it)")
            text = pr_text(template, base=base, base_commit=base_commit or "", applied=made["applied"],
                           bug=curated.bug, measured=measured, requirements=made["requirements"],
                           made_on=made.get("made_on") if treeless else None,
                           converter=_load_json(repo_root / "bench" / "convert_drafts.json"))
            (staging / "PR.md").write_text(text, encoding="utf-8")
            names.append("PR.md")
        files = {name: sha256_file(staging / name) for name in names}
        data = {
            "written_by": "dfbuild", "schema": EXPORT_SCHEMA, "base": base, "base_commit": base_commit,
            "applied_to_tree": not treeless,
            "source": {k: checked.get(k) for k in ("kind", "repo", "commit")},
            "author": f"{who[0]} <{who[1]}>", "date": date,
            # what tests/test_export_real.py records beside its results: bench/upstream/upstream-test-BASE.json
            "test_sha256": digest(test_source()), "fix_sha256": made.get("fix_sha256"),
            "concerns": [{"id": a["id"], "file": a["file"], "how": a["how"]} for a in made["applied"]],
            "decided": [{"id": c["id"], "status": c["status"], "detail": c.get("detail")}
                        for c in made["section"]["concerns"] if c.get("status") != "applied"],
            # the commits a tree-based export made on the base; none without a tree
            "commits": None if treeless else [made["fix_commit"], made["test_commit"]],
            "files": files,
        }
        state.atomic_write_text(staging / MARKER_NAME, json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.chmod(staging / MARKER_NAME, 0o666 & ~_umask())
        _publish(staging, out, replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    ui.info("PR.md is a draft: " + SUBMITTER_NOTE)
    return {**{k: v for k, v in data.items() if k != "written_by"}, "out": str(out),
            "written": [str(out / name) for name in names]}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# the export's words live in export_text; the names its callers and tests use stay importable from here
__all__ = ["FIX_SUBJECT", "REQUIREMENTS", "TEST_NAME", "TEST_PATH", "WHEN", "DfbuildError", "build_commits",
           "check_out_dir", "digest", "export_upstream", "fix_message", "measured_for", "pr_text",
           "requirements_with_yaml", "submitter", "test_source", "upstream_message"]
