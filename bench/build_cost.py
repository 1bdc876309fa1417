#!/usr/bin/env python3
"""What does dfbuild cost on top of the build itself?

Four measurements, each through the `dfbuild` command line as a user runs it:

* cold: `dfbuild build` against plain `cmake` + `ninja` with the very same
  configure arguments (taken from the dfbuild run's stamp: flags, version stamp,
  ccache launcher) and the same targets. Every run gets a fresh build dir and
  its own empty CCACHE_DIR, so both start cold; the order alternates per
  repetition. Goal: dfbuild / cmake <= 1.05.
  The default target is `ggml` (ggml-base + ggml-cpu: the whole CPU compute
  backend, 32 ninja steps, about 2 minutes cold on 2 cores); it has the same
  configure step as the full build and the least compile time to hide dfbuild's
  own work behind, so it is the strict case. `--targets llama-server` measures
  the full build (332 steps, ~7 minutes per run on 2 cores).
* apply: `dfbuild checkout` back to the base, then `dfbuild apply` of the series.
* rebuild: in a llama-server build dir filled from the shared ccache: an
  unchanged rebuild, a rebuild after `touch` of the patched file, one after an
  edit of it left uncommitted (the source change alone), and one after a changed
  patch (the same kind of edit, committed the way `dfbuild apply` commits a
  concern, so the version stamp changes too and CMake re-runs). Goal: changed
  patch <= 1.5 x edit.
* release: `dfbuild release` in a fresh work dir (shared ccache), then a rerun
  that resumes; the time per stage from the manifest's `release.stages`.
* unseen (issue 20): with ccache off (CCACHE_DISABLE=1, as on GPU images and
  fresh machines), one cold `dfbuild build` of llama-server at the base, then
  `dfbuild release` (or `prove`, --unseen-command) of the same base in a fresh
  work dir with a copy of the series that has never heard of it
  (DFBUILD_PATCHES_DIR), so it is carried and proven: the base builds once and
  the patched tree is an incremental rebuild. Goal: the release's builds (and,
  reported beside it, its whole wall time, smoke included) <= 1.1 x the cold build.
  `--base b11434` is the real case (carried from b11312 at +59);
  `--backend cuda --cuda-arch 90` on a GPU machine.
* fetch: time to first apply (`dfbuild apply --base b10359 --repo MIRROR` on an
  empty DFBUILD_CACHE_DIR) with the old full bare clone against the shallow
  fetch of the one tag, from a synthetic local mirror (see make_mirror).

One command (all parts; about 20 minutes on 2 shared cores):

    python bench/build_cost.py

The full cold comparison: `python bench/build_cost.py --parts cold --targets llama-server --reps 1`.
Results merge into bench/results.json under "build_cost".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from benchlib import log

from dfbuild.host import doctor

PARTS = ("apply", "cold", "rebuild", "release", "fetch", "unseen")
# `--cpu-variants` for every build and release the bench runs (set by main; empty: dfbuild's default, all)
VARIANT_ARGS: list[str] = []
GOAL_RATIO = 1.05
CHANGED_OVER_EDIT_GOAL = 1.5
UNSEEN_GOAL = 1.1


def dfbuild_command() -> list[str]:
    exe = shutil.which("dfbuild")
    return [exe] if exe else [sys.executable, "-c", "from dfbuild.cli import main; main()"]


class Runner:
    """Runs commands niced, with one environment, logging their output, and times them."""

    def __init__(self, log_dir: Path, nice: int, env: dict):
        self.log_dir = log_dir
        self.nice = nice
        self.env = env
        log_dir.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, args: list[str], *, env_extra: dict | None = None, cwd: Path | None = None) -> tuple[float, str]:
        """Run ARGS; return (wall seconds, stdout). Raise with the log's tail when it fails."""
        prefix = ["nice", "-n", str(self.nice)] if self.nice and shutil.which("nice") else []
        log_path = self.log_dir / f"{name}.log"
        env = self.env | (env_extra or {})
        with open(log_path, "w", encoding="utf-8") as err:
            err.write("$ " + " ".join(args) + "\n")
            err.flush()
            started = time.monotonic()
            proc = subprocess.run(prefix + args, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=cwd)
            wall = time.monotonic() - started
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
            raise SystemExit(f"{name} failed ({proc.returncode}); log {log_path}:\n{tail}")
        log(f"  {name}: {wall:.1f}s")
        return wall, proc.stdout


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout.strip()


# --- parts ------------------------------------------------------------------------------


def measure_apply(runner: Runner, tree: Path, base: str, reps: int) -> dict:
    dfb = dfbuild_command()
    first = not (tree / ".git").exists()
    checkout_s, _ = runner.run("checkout-initial", [*dfb, "checkout", "--base", base, "--dir", str(tree)])
    resets, applies = [], []
    for rep in range(reps):
        if rep or not first:
            wall, _ = runner.run(f"checkout-reset-{rep}", [*dfb, "checkout", "--base", base, "--dir", str(tree)])
            resets.append(wall)
        wall, out = runner.run(f"apply-{rep}", [*dfb, "apply", "--base", base, "--dir", str(tree), "--json"])
        applied = json.loads(out)["series"]
        if not applied["changed"]:
            raise SystemExit("dfbuild apply found the series already applied: the reset did not work")
        applies.append(wall)
    return {
        "base": base,
        "concerns": len(applied["concerns"]),
        "checkout_initial_s": round(checkout_s, 2),
        "checkout_initial_was_fresh": first,
        "checkout_reset_s": benchlib.summary(resets),
        "apply_s": benchlib.summary(applies),
    }


def cold_pair(runner: Runner, tree: Path, work: Path, targets: list[str], reps: int, jobs: int | None) -> dict:
    dfb = dfbuild_command()
    ninja = doctor.find_pypi_program("ninja")
    configure_args: list[str] | None = None
    runs = {"dfbuild": [], "cmake": []}
    details = {"dfbuild": [], "cmake": []}

    def run_dfbuild(rep: int) -> None:
        nonlocal configure_args
        build_dir, ccache = work / f"cold-dfbuild-{rep}", work / f"ccache-dfbuild-{rep}"
        _fresh(build_dir, ccache)
        args = [*dfb, "build", "--dir", str(tree), "--backend", "cpu", "--build-dir", str(build_dir), "--json", *VARIANT_ARGS,
                *[a for t in targets for a in ("--target", t)], *(["-j", str(jobs)] if jobs else [])]
        wall, out = runner.run(f"cold-dfbuild-{rep}", args, env_extra={"CCACHE_DIR": str(ccache)})
        section = json.loads(out)
        stamp = json.loads((build_dir / "dfbuild-stamp.json").read_text(encoding="utf-8"))
        configure_args = stamp["configured_args"]
        runs["dfbuild"].append(wall)
        details["dfbuild"].append({"wall_s": round(wall, 2), "configure_s": section["configure_s"],
                                   "compile_s": section["compile_s"], "steps": section["steps"],
                                   "compiled_steps": section["compiled_steps"]})
        _cleanup(build_dir, ccache)

    def run_cmake(rep: int) -> None:
        build_dir, ccache = work / f"cold-cmake-{rep}", work / f"ccache-cmake-{rep}"
        _fresh(build_dir, ccache)
        args = list(configure_args)
        args[args.index("-B") + 1] = str(build_dir)
        env = {"CCACHE_DIR": str(ccache)}
        configure_s, _ = runner.run(f"cold-cmake-configure-{rep}", [doctor.find_pypi_program("cmake"), *args],
                                    env_extra=env)
        compile_s, _ = runner.run(f"cold-cmake-ninja-{rep}",
                                  [ninja, "-C", str(build_dir), *(["-j", str(jobs)] if jobs else []), *targets],
                                  env_extra=env)
        runs["cmake"].append(configure_s + compile_s)
        details["cmake"].append({"wall_s": round(configure_s + compile_s, 2), "configure_s": round(configure_s, 2),
                                 "compile_s": round(compile_s, 2)})
        _cleanup(build_dir, ccache)

    for rep in range(reps):
        # dfbuild first on even repetitions; the first run must be dfbuild's (its stamp gives the flags)
        order = (run_dfbuild, run_cmake) if rep % 2 == 0 else (run_cmake, run_dfbuild)
        for step in order:
            step(rep)
    ratios = [d / c for d, c in zip(runs["dfbuild"], runs["cmake"])]
    ratio = benchlib.summary(ratios)
    return {
        "targets": targets,
        "jobs": jobs or "ninja default",
        "reps": reps,
        "configure_args": configure_args[4:],  # the flags; -S/-B/-G differ only by path
        "dfbuild_s": benchlib.summary(runs["dfbuild"]),
        "cmake_ninja_s": benchlib.summary(runs["cmake"]),
        "dfbuild_over_cmake": ratio["median"],
        "dfbuild_over_cmake_range": [ratio["min"], ratio["max"]],
        "goal": GOAL_RATIO,
        "goal_met": ratio["median"] <= GOAL_RATIO,
        "runs": details,
    }


def measure_rebuild(runner: Runner, tree: Path, reps: int) -> dict:
    """Rebuilds of llama-server after nothing, a touch, and a changed patch (committed)."""
    dfb = dfbuild_command()
    build_dir = tree.parent / "build-cpu"
    build_args = [*dfb, "build", "--dir", str(tree), "--backend", "cpu", "--build-dir", str(build_dir), "--json",
                  *VARIANT_ARGS]
    speculative = tree / "common" / "speculative.cpp"
    original_head = git(tree, "rev-parse", "HEAD")

    def build(name: str) -> dict:
        wall, out = runner.run(name, build_args)
        s = json.loads(out)
        return {"wall_s": round(wall, 2), "configured": s["configured"], "compiled_steps": s["compiled_steps"],
                "compile_s": s["compile_s"], "configure_s": s["configure_s"]}

    initial = build("rebuild-initial")  # from the shared ccache: fills this build dir
    unchanged, touched, edited, changed = [], [], [], []

    def edit_speculative(what: str) -> None:
        # new code in the patched file (a new marker each time, so ccache cannot answer it)
        marker = f"dfbuild_bench_edit_{time.time_ns()}"
        with open(speculative, "a", encoding="utf-8") as f:
            f.write(f"\n// dfbuild bench: {what}\nnamespace {{ [[maybe_unused]] const int {marker} = 1; }}\n")

    try:
        for rep in range(reps):
            unchanged.append(build(f"rebuild-unchanged-{rep}"))
            os.utime(speculative)  # same bytes: ccache answers the compile
            touched.append(build(f"rebuild-touch-{rep}"))
            edit_speculative("an edit, not committed")  # the source change alone: the file must compile
            edited.append(build(f"rebuild-edit-{rep}"))
            git(tree, "checkout", "-q", "--", "common/speculative.cpp")
            # a changed concern: the same kind of edit, committed like `dfbuild apply` commits it, so the
            # version stamp changes too
            edit_speculative("a changed patch")
            git(tree, "-c", "user.name=dfbuild bench", "-c", "user.email=bench@dfbuild.invalid",
                "commit", "-q", "--no-verify", "-am", "bench: a changed patch")
            changed.append(build(f"rebuild-changed-patch-{rep}"))
            git(tree, "reset", "-q", "--hard", original_head)
    finally:
        git(tree, "reset", "-q", "--hard", original_head)
    build("rebuild-restore")  # leave the build dir matching the tree

    def walls(rows):
        return benchlib.summary([r["wall_s"] for r in rows])

    def ratio(numerators, denominators):
        # pairwise per repetition: each pair ran back to back on the same build dir
        return benchlib.summary([n["wall_s"] / d["wall_s"] for n, d in zip(numerators, denominators) if d["wall_s"]])

    return {
        "target": "llama-server",
        "initial_from_shared_ccache": initial,
        "unchanged_s": walls(unchanged),
        "touch_s": walls(touched),
        "changed_patch_s": walls(changed),
        "edit_s": walls(edited),
        # the maintainer loop's goal (issue 11): a changed patch rebuilds only what its source change
        # needs, i.e. costs at most 1.5 x the same edit left uncommitted. Against a touch (the first
        # yardstick) it cannot: a touch keeps the bytes, so ccache answers the compile a real change needs.
        "changed_over_edit": ratio(changed, edited),
        "changed_over_edit_goal": CHANGED_OVER_EDIT_GOAL,
        "changed_over_touch": ratio(changed, touched),
        "edit_runs": edited,
        "changed_patch_runs": changed,
        "touch_runs": touched,
    }


def measure_release(runner: Runner, work: Path, base: str) -> dict:
    dfb = dfbuild_command()
    release_work, out = work / "release", work / "release-dist"
    _fresh(release_work, out)
    args = [*dfb, "release", "--base", base, "--backend", "cpu", "--work", str(release_work), "--out", str(out), *VARIANT_ARGS,
            "--json"]
    first_s, first = runner.run("release-fresh", args)
    rerun_s, rerun = runner.run("release-rerun", args)
    stages = json.loads(first)["release"]["stages"]
    again = json.loads(rerun)["release"]["stages"]
    result = {
        "base": base,
        "fresh": {"wall_s": round(first_s, 2), "stages": stages},
        "rerun": {"wall_s": round(rerun_s, 2), "stages": again},
        "manifest": str(out / "manifest.json"),
    }
    return result


# --- unseen: a release of a base the series has no variant for, ccache off ---------------------


def series_without(base: str, dest: Path, patches: Path | None = None) -> Path:
    """A copy of the series (PATCHES, default: dfbuild's) that has never heard of BASE."""
    import tomlkit

    from dfbuild import series

    shipped = Path(patches or series.default_patches_dir())
    _cleanup(dest)
    shutil.copytree(shipped, dest, ignore=shutil.ignore_patterns(base))
    doc = tomlkit.parse((dest / "series.toml").read_text(encoding="utf-8"))
    doc.get("bases", {}).pop(base, None)
    for concern in doc.get("concern", []):
        concern.get("variants", {}).pop(base, None)
    (dest / "series.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    return dest


def measure_unseen(runner: Runner, work: Path, base: str, *, backend: str = "cpu", cuda_arch: str | None = None,
                   command: str = "release", repo: str | None = None, patches: Path | None = None,
                   jobs: int | None = None) -> dict:
    """One cold build of BASE, then the release (or proof) of BASE as an unseen base; ccache off in both."""
    dfb = dfbuild_command()
    env = {"CCACHE_DISABLE": "1"}  # no ccache anywhere: most users have none (issue 20)
    repo_args = ["--repo", str(repo)] if repo else []
    build_args = [*VARIANT_ARGS, *(["--cuda-arch", cuda_arch] if cuda_arch else []),
                  *(["-j", str(jobs)] if jobs else [])]
    cold_root, release_work, out = work / "unseen-cold", work / "unseen-work", work / "unseen-dist"
    _cleanup(cold_root, release_work, out)
    runner.run("unseen-checkout", [*dfb, "checkout", "--base", base, *repo_args, "--dir", str(cold_root / "src")],
               env_extra=env)
    cold_s, cold_out = runner.run("unseen-cold-build", [
        *dfb, "build", "--dir", str(cold_root / "src"), "--backend", backend, "--build-dir",
        str(cold_root / f"build-{backend}"), "--no-ccache", "--json", *build_args], env_extra=env)
    cold = json.loads(cold_out)
    _cleanup(cold_root)  # its disk, not its time: the release below starts from nothing

    unseen = series_without(base, work / "unseen-patches", patches)
    env["DFBUILD_PATCHES_DIR"] = str(unseen)
    if command == "release":
        args = [*dfb, "release", "--base", base, *repo_args, "--backend", backend, "--work", str(release_work),
                "--out", str(out), "--json", *build_args]
    else:  # prove has no --cuda-arch: it builds the backend's default architectures
        args = [*dfb, "prove", "--base", base, *repo_args, "--backend", backend, "--work", str(release_work),
                "--json", *VARIANT_ARGS, *(["-j", str(jobs)] if jobs else [])]
    wall_s, _ = runner.run(f"unseen-{command}", args, env_extra=env)
    proofs = json.loads((release_work / f"proof-{backend}.json").read_text(encoding="utf-8"))
    proof = next(iter(proofs.values()))
    times = proof.get("times", {})
    build_s = times.get("build_unpatched", 0.0) + times.get("build_patched", 0.0)
    result = {
        "base": base, "backend": backend, "cuda_arch": cuda_arch, "command": command, "ccache": "disabled",
        "cold_build_s": round(cold_s, 2),
        "cold_compiled_steps": cold.get("compiled_steps"),
        f"{command}_wall_s": round(wall_s, 2),
        "outcome": proof.get("outcome"),
        "proof_times": times,
        "builds": proof.get("builds"),
        "build_s": round(build_s, 2),
        "builds_over_cold": round(build_s / cold_s, 3) if cold_s else None,
        "wall_over_cold": round(wall_s / cold_s, 3) if cold_s else None,
        "goal": UNSEEN_GOAL,
    }
    result["goal_met"] = result["builds_over_cold"] is not None and result["builds_over_cold"] <= UNSEEN_GOAL
    if command == "release" and (out / "manifest.json").is_file():
        result["release_stages"] = json.loads((out / "manifest.json").read_text())["release"]["stages"]
    return result


# --- fetch: time to first apply from a git repository, full clone vs shallow fetch ------------

MIRROR_VERSION = "1"  # bump when the synthetic mirror's recipe changes (it is rebuilt then)
MILESTONES = ("b10355", "b10359", "b11312", "b11434")  # real trees, imported from their sdists
FIRST_TAG = 10000


def _milestone_tree(mirror: Path, name: str) -> list[str]:
    """fast-import lines putting milestone NAME's real tree in place (its objects are in MIRROR)."""
    lines = []
    for entry in git(mirror, "ls-tree", "-r", "-z", f"refs/import/{name}").split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob":
            lines.append(f"M {mode} {sha} {path}\n")
    return lines


def make_mirror(path: Path, junk_kib: int, branches: int) -> dict:
    """A local bare mirror shaped like llama.cpp's GitHub repo (built once, kept beside the work dir).

    llama.cpp's own history is not available offline, so the mirror is synthetic,
    made of real parts: a master branch of 1435 commits tagged b10000 .. b11434,
    one tag per commit as llama.cpp tags its builds; the trees of the real
    releases b10355, b10359, b11312 and b11434 (imported from their sdists) as
    milestones at their tags; and churn between them: every commit rewrites two
    of eight files of JUNK_KIB KiB random (incompressible) bytes under junk/, so
    history outweighs any one snapshot as it does upstream. BRANCHES side
    branches of 8 commits each add more of it, reachable only from their branch.
    """
    stamp = path / "dfbuild-bench-mirror"
    recipe = f"{MIRROR_VERSION} {junk_kib} {branches}"
    if stamp.is_file() and stamp.read_text() == recipe:
        return json.loads((path / "dfbuild-bench-mirror.json").read_text())
    _cleanup(path)
    subprocess.run(["git", "init", "-q", "--bare", "-b", "master", str(path)], check=True)
    imports = benchlib.TEST_CACHE / "imports"
    available = [name for name in MILESTONES if (imports / f"{name}.git").is_dir()]
    if "b10359" not in available:
        raise SystemExit(f"fetch: the b10359 import is missing under {imports}; run `dfbuild checkout --base b10359` "
                         f"with DFBUILD_CACHE_DIR={benchlib.TEST_CACHE} once (or the integration tests)")
    # the imports' objects are borrowed (they are loose: a fetch would pack them twice), then packed in below
    (path / "objects" / "info" / "alternates").write_text(
        "".join(f"{imports / f'{name}.git' / 'objects'}\n" for name in available))
    for name in available:
        git(path, "update-ref", f"refs/import/{name}", git(imports / f"{name}.git", "rev-parse", f"{name}^{{commit}}"))
    rng = random.Random(10359)
    size = junk_kib * 1024

    def junk(index: int) -> bytes:
        data = rng.randbytes(size)
        return b"M 100644 inline junk/f%d.bin\ndata %d\n" % (index, size) + data + b"\n"

    def commit(ref: str, mark: int, message: str, parent: int | None) -> bytes:
        text = (f"commit {ref}\nmark :{mark}\ncommitter Bench <bench@localhost> {1700000000 + mark} +0000\n"
                f"data {len(message)}\n{message}\n" + (f"from :{parent}\n" if parent else ""))
        return text.encode()

    proc = subprocess.Popen(["git", "-C", str(path), "fast-import", "--quiet", "--force"], stdin=subprocess.PIPE)
    last = FIRST_TAG + 1434
    current = None
    for i in range(last - FIRST_TAG + 1):
        build = FIRST_TAG + i
        milestone = next((m for m in reversed(available) if int(m[1:]) <= build), available[0])
        proc.stdin.write(commit("refs/heads/master", i + 1, f"commit {build}", i or None))
        if milestone != current:  # a release's real tree, plus the junk files
            current = milestone
            proc.stdin.write(b"deleteall\n" + "".join(_milestone_tree(path, milestone)).encode())
            for j in range(8):
                proc.stdin.write(junk(j))
        else:
            proc.stdin.write(junk(i % 8) + junk((i + 3) % 8))
        proc.stdin.write(f"\nreset refs/tags/b{build}\nfrom :{i + 1}\n\n".encode())
    mark = last - FIRST_TAG + 2
    for k in range(branches):
        fork = 1 + (k * 97) % (last - FIRST_TAG + 1)
        for n in range(8):
            proc.stdin.write(commit(f"refs/heads/feature-{k}", mark, f"feature {k}.{n}", fork if n == 0 else None))
            proc.stdin.write(junk((k + n) % 8) + b"\n")
            mark += 1
    proc.stdin.close()
    if proc.wait() != 0:
        raise SystemExit("fetch: git fast-import failed building the mirror")
    for name in available:
        git(path, "update-ref", "-d", f"refs/import/{name}")
    git(path, "repack", "-a", "-d", "-q")  # one pack, borrowed objects included, as a server keeps it
    (path / "objects" / "info" / "alternates").unlink()
    info = {
        "commits": int(git(path, "rev-list", "--all", "--count")),
        "branches": len(git(path, "for-each-ref", "refs/heads").splitlines()),
        "tags": len(git(path, "for-each-ref", "refs/tags").splitlines()),
        "packed_mb": round(_size(path / "objects") / 1e6, 1),
        "milestones": available,
        "junk_kib": junk_kib,
    }
    (path / "dfbuild-bench-mirror.json").write_text(json.dumps(info))
    stamp.write_text(recipe)
    return info


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def measure_fetch(runner: Runner, work: Path, junk_kib: int, branches: int, reps: int) -> dict:
    """Time to first apply, `dfbuild apply --base b10359 --repo MIRROR` on an empty cache: the old full
    clone (emulated exactly: `git clone --bare` into the cache, as dfbuild did, then the same command,
    which reads an existing full clone the old way) against the shallow fetch. The order alternates per
    repetition; the mirror is a local file:// repo, so the network costs nothing and the server's work
    (packing what is sent) runs on this machine."""
    from dfbuild.source import checkout as source  # the cache path of a URL

    mirror = work / "fetch-mirror.git"
    started = time.monotonic()
    info = make_mirror(mirror, junk_kib, branches)
    log(f"  mirror: {info['commits']} commits, {info['branches']} branches, {info['tags']} tags, "
        f"{info['packed_mb']} MB packed ({time.monotonic() - started:.0f}s to make or check)")
    url = mirror.as_uri()
    expected = git(mirror, "rev-parse", "refs/tags/b10359^{commit}")
    dfb = dfbuild_command()
    runs = {"full": [], "shallow": []}
    for rep in range(reps):
        for mode in (("full", "shallow") if rep % 2 == 0 else ("shallow", "full")):
            cache, tree = work / f"fetch-cache-{mode}", work / f"fetch-tree-{mode}"
            _cleanup(cache, tree)
            env = {"DFBUILD_CACHE_DIR": str(cache)}
            clone_s = 0.0
            if mode == "full":
                repo = cache / "repos" / f"{source.slug(url)}.git"
                repo.parent.mkdir(parents=True)
                clone_s, _ = runner.run(f"fetch-full-clone-{rep}", ["git", "clone", "--bare", "--quiet", url,
                                                                   str(repo)])
            apply_s, out = runner.run(f"fetch-{mode}-apply-{rep}",
                                      [*dfb, "apply", "--base", "b10359", "--repo", url, "--dir", str(tree),
                                       "--json"], env_extra=env)
            data = json.loads(out)
            if data["source"]["commit"] != expected or not data["series"]["changed"]:
                raise SystemExit(f"fetch: the {mode} run did not patch b10359 ({data['source']['commit']})")
            (repo,) = (cache / "repos").glob("*.git")
            runs[mode].append({
                "clone_s": clone_s, "apply_s": apply_s, "first_apply_s": clone_s + apply_s,
                "cache_mb": round(_size(repo) / 1e6, 1),
                "cache_commits": int(git(repo, "rev-list", "--all", "--count")),
                "cache_shallow": git(repo, "rev-parse", "--is-shallow-repository") == "true",
            })
            _cleanup(cache, tree)
    result = {"mirror": info, "base": "b10359", "reps": reps}
    for mode, rows in runs.items():
        result[mode] = {key: benchlib.summary([row[key] for row in rows])
                        for key in ("clone_s", "apply_s", "first_apply_s")}
        result[mode].update({key: rows[-1][key] for key in ("cache_mb", "cache_commits", "cache_shallow")})
    result["full_over_shallow"] = round(result["full"]["first_apply_s"]["median"]
                                        / result["shallow"]["first_apply_s"]["median"], 2)
    result["cache_mb_full_over_shallow"] = round(result["full"]["cache_mb"] / result["shallow"]["cache_mb"], 1)
    return result


def _fresh(*dirs: Path) -> None:
    _cleanup(*dirs)
    for d in dirs:
        d.mkdir(parents=True)


def _cleanup(*dirs: Path) -> None:
    for d in dirs:
        if d.exists():
            shutil.rmtree(d)


# --- driver -------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(p for p in PARTS if p != "unseen"),
                   help=f"comma-separated subset of {','.join(PARTS)} (default: all but unseen, two cold builds)")
    p.add_argument("--base", default="b10359", help="base to check out and patch (default b10359, offline)")
    p.add_argument("--targets", default="ggml", help="comma-separated CMake targets of the cold comparison "
                                                      "(default ggml; llama-server for the full build)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the cold pair (default 3)")
    p.add_argument("--apply-reps", type=int, default=3)
    p.add_argument("--rebuild-reps", type=int, default=3)
    p.add_argument("--jobs", "-j", type=int, default=None, help="ninja -j for both (default: ninja's)")
    p.add_argument("--cpu-variants", default=None,
                   help="CPU variants every build compiles (e.g. x64, to replay the tests' ccache; default: all)")
    p.add_argument("--nice", type=int, default=10, help="run every build under nice -n N (0: not niced)")
    p.add_argument("--work-dir", type=Path, default=benchlib.DEFAULT_CACHE / "build-cost",
                   help="trees, build dirs and private ccaches (build dirs are deleted after each run)")
    p.add_argument("--junk-kib", type=int, default=48, help="fetch: KiB of each random file the synthetic "
                   "mirror's commits rewrite (two per commit; default 48)")
    p.add_argument("--mirror-branches", type=int, default=40, help="fetch: side branches of the mirror (default 40)")
    p.add_argument("--fetch-reps", type=int, default=2, help="fetch: repetitions, alternating the order (default 2)")
    p.add_argument("--backend", default="cpu", help="unseen: the backend to build (default cpu; cuda on a GPU machine)")
    p.add_argument("--cuda-arch", default=None, help="unseen: CUDA architectures, e.g. 90 (cuda only)")
    p.add_argument("--unseen-command", choices=("release", "prove"), default="release",
                   help="unseen: the path measured after the cold build (default release)")
    p.add_argument("--repo", default=None, help="unseen: repository of the base (default: implied by the base)")
    p.add_argument("--patches", type=Path, default=None, help="unseen: the series to copy (default: dfbuild's)")
    p.add_argument("--results", type=Path, default=benchlib.RESULTS_JSON)
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    parts = [p for p in opts.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        log(f"unknown parts: {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
        return 2
    targets = [t for t in opts.targets.split(",") if t]
    VARIANT_ARGS[:] = ["--cpu-variants", opts.cpu_variants] if opts.cpu_variants else []
    work = opts.work_dir.resolve()
    tree = work / "tree" / "src"  # NAME/src + NAME/build-cpu: the layout whose ccache entries are shared
    env = dict(os.environ)
    runner = Runner(work / "logs", opts.nice, env)

    section = benchlib.load_results(opts.results).get("build_cost", {})
    machine = benchlib.machine_info()
    started = time.monotonic()
    if "apply" in parts or ({"cold", "rebuild"} & set(parts) and not (tree / ".git").exists()):
        log("apply: dfbuild checkout + dfbuild apply")
        section["apply"] = measure_apply(runner, tree, opts.base, opts.apply_reps)
    if "cold" in parts:
        log(f"cold: dfbuild build vs cmake + ninja, targets {','.join(targets)}, private empty ccache per run")
        section.setdefault("cold", {})[",".join(targets)] = cold_pair(runner, tree, work, targets, opts.reps, opts.jobs)
    if "rebuild" in parts:
        log("rebuild: llama-server after nothing, a touch, a changed patch")
        section["rebuild"] = measure_rebuild(runner, tree, opts.rebuild_reps)
    if "release" in parts:
        log("release: fresh work dir, then a rerun")
        section["release"] = measure_release(runner, work, opts.base)
    if "fetch" in parts:
        log("fetch: time to first apply on an empty cache, full clone vs shallow fetch, from a local mirror")
        section["fetch"] = measure_fetch(runner, work, opts.junk_kib, opts.mirror_branches, opts.fetch_reps)
    if "unseen" in parts:
        log(f"unseen: cold build of {opts.base}, then {opts.unseen_command} of it as an unseen base, ccache off")
        section["unseen"] = measure_unseen(runner, work, opts.base, backend=opts.backend, cuda_arch=opts.cuda_arch,
                                           command=opts.unseen_command, repo=opts.repo, patches=opts.patches,
                                           jobs=opts.jobs)
        log(f"  builds / cold = {section['unseen']['builds_over_cold']} (goal <= {UNSEEN_GOAL}), "
            f"whole {opts.unseen_command} / cold = {section['unseen']['wall_over_cold']}")
    machine["load_average_at_end"] = benchlib.load_average()

    # the headline ratio: the full llama-server build when it was measured, else the cheaper target's
    cold = section.get("cold", {})
    headline = cold.get("llama-server") or next(iter(cold.values()), None)
    if headline:
        section["dfbuild_over_cmake"] = headline["dfbuild_over_cmake"]
        section["dfbuild_over_cmake_targets"] = headline["targets"]
    section.setdefault("runs_by_part", {})
    for part in parts:
        section["runs_by_part"][part] = {"date": benchlib.now_iso(), "command": benchlib.command_line(),
                                         "machine": machine}
    section["wall_s_last_run"] = round(time.monotonic() - started, 1)
    benchlib.merge_results("build_cost", None, section, opts.results)
    print(json.dumps({k: v for k, v in section.items() if k != "runs_by_part"}, indent=2)[:6000])
    log(f"merged into {opts.results} under build_cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
