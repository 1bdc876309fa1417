"""Bad luck: `dfbuild apply` interrupted (Ctrl-C, kill -9) anywhere, and two applies on one tree.

The runs are real CLI runs in their own processes. Most are forked from the
test process (the CLI's `main` in a child: a real process, real signals, none of
the interpreter's start-up cost), a few are `python -m dfbuild.cli` subprocesses.
After every interruption a plain rerun must reach the fully patched tree with
the reproducible commit id, and nothing of the user's may change.

The synthetic llama.cpp and its four-patch series come from test_series.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import private_cache, run_git
from test_series import IDS, Synthetic, bare_upstream, head, template  # noqa: F401  (template: the module fixture syn copies)

from dfbuild import cli
from dfbuild.core import journal, paths, state
from dfbuild.source import checkout as source

# a new DIR: cloned beside DIR, checked out there, renamed into place (then the apply steps)
NEW_DIR_STEPS = 3
SIGNALS = {"INT": signal.SIGINT, "KILL": signal.SIGKILL}
REPORT = Path(os.environ.get("DFBUILD_CRASH_REPORT", "")) if os.environ.get("DFBUILD_CRASH_REPORT") else None


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


def run_forked(args, *, env: dict | None = None, kill_after: float | None = None, sig: int = signal.SIGKILL,
               start: bool = True):
    """Run `dfbuild ARGS` in a forked child; returns its pid (start=False) or its exit code (-N: killed by N)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.environ.update(env or {})
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            try:
                cli.main(args=[str(a) for a in args], prog_name="dfbuild")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = 99
        finally:
            os._exit(code)
    if not start:
        return pid
    if kill_after is not None:
        time.sleep(kill_after)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return wait(pid)


def wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def apply_args(syn: Synthetic, bare: Path, dest: Path, *extra) -> tuple:
    return ("apply", "--base", syn.base_commit, "--repo", bare, "--dir", dest, "--patches", syn.patches, *extra)


def leftovers(dest: Path, cache: Path) -> list[str]:
    """dfbuild's own debris that must not survive a successful rerun."""
    found = []
    if journal.journal_path(dest).exists():
        found.append("journal")
    if source.staging_dir(dest).exists():
        found.append("staging dir")
    if (dest / ".git" / "index.lock").exists():
        found.append("index.lock")
    tmp = cache / "tmp"
    found += [f"tmp/{p.name}" for p in (tmp.iterdir() if tmp.is_dir() else [])]
    return found


def assert_fully_patched(dest: Path, syn: Synthetic, expected_head: str) -> None:
    assert head(dest) == expected_head
    commits = run_git(dest, "rev-list", "--reverse", f"{syn.base_commit}..HEAD").split()
    assert len(commits) == len(IDS)
    assert run_git(dest, "status", "--porcelain", "--untracked-files=all") == ""
    record = json.loads((dest / ".git" / "dfbuild" / "manifest.json").read_text())
    assert record["series"]["head"] == expected_head


def user_files(dest: Path) -> dict:
    return {p.name: p.read_bytes() for p in (dest / "notes.local", dest.parent / "next-to-it.txt") if p.exists()}


def _report(name: str, data: dict) -> None:
    print(f"{name}: {json.dumps(data, sort_keys=True)}")
    if REPORT:
        with open(REPORT, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"test": name, **data}, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def world(template, tmp_path_factory):
    """Made once per module: a bare upstream, the expected patched commit id, and a ready checkout
    holding a user's ignored file (each test copies it)."""
    root = tmp_path_factory.mktemp("crash-world")
    saved = os.environ.get(paths.CACHE_ENV)
    os.environ[paths.CACHE_ENV] = str(root / "cache")
    try:
        syn = Synthetic(template.upstream, template.base_commit, template.work, template.concern_commits,
                        template.patches, template.blob)
        bare = bare_upstream(syn, root)
        reference = root / "reference"
        assert run_forked(apply_args(syn, bare, reference)) == 0
        expected = head(reference)
        prepared = root / "prepared"
        assert run_forked(("checkout", "--base", syn.base_commit, "--repo", bare, "--dir", prepared)) == 0
    finally:
        if saved is None:
            os.environ.pop(paths.CACHE_ENV, None)
        else:
            os.environ[paths.CACHE_ENV] = saved
    with open(prepared / ".git" / "info" / "exclude", "a") as exclude:
        exclude.write("*.local\n")
    (prepared / "notes.local").write_text("the user's notes: never touched\n")
    return syn, bare, expected, prepared


def fresh_copy(prepared: Path, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(prepared), str(dest)], check=True)
    (dest.parent / "next-to-it.txt").write_text("a user's file beside the tree\n")
    return dest


def test_fault_injection_at_every_step(world, tmp_path, own_cache):
    """Stop `apply` after each of its steps (Ctrl-C and kill -9), on an existing and on a new DIR; rerun."""
    syn, bare, expected, prepared = world
    outcomes: dict[str, int] = {}
    runs = 0
    # Ctrl-C and kill -9 after every step on an existing DIR; kill -9 (the harsher) after each step of making a new one
    for kind, sig_names in (("existing", ("INT", "KILL")), ("new", ("KILL",))):
        for sig_name in sig_names:
            step = 0
            while True:
                step += 1
                where = tmp_path / f"{kind}-{sig_name}-{step}"
                where.mkdir()
                dest = where / "llama"
                if kind == "existing":
                    fresh_copy(prepared, dest)
                else:
                    (where / "next-to-it.txt").write_text("a user's file beside the tree\n")
                before = user_files(dest)
                env = {state.STOP_AFTER_ENV: str(step), state.STOP_SIGNAL_ENV: sig_name}
                code = run_forked(apply_args(syn, bare, dest), env=env)
                runs += 1
                outcomes[str(code)] = outcomes.get(str(code), 0) + 1
                if code == 0:  # past the last step: the run was not stopped
                    assert_fully_patched(dest, syn, expected)
                    break
                assert code == (130 if sig_name == "INT" else -signal.SIGKILL), (kind, sig_name, step, code)
                rerun = run_forked(apply_args(syn, bare, dest))
                runs += 1
                assert rerun == 0, (kind, sig_name, step)
                assert_fully_patched(dest, syn, expected)
                assert user_files(dest) == before
                assert leftovers(dest, own_cache) == []
                if kind == "new" and step == NEW_DIR_STEPS:
                    break  # past these, a new DIR runs exactly the steps of an existing one
            assert step >= NEW_DIR_STEPS, f"{kind}: only {step - 1} steps; the fault points are not reached"
    _report("fault-injection (deterministic)", {"runs": runs, "outcomes": outcomes})


def test_randomised_interrupts(world, tmp_path, own_cache):
    """Ctrl-C or kill -9 at random moments of `apply` (seeded), on new and existing DIRs; rerun."""
    syn, bare, expected, prepared = world
    t0 = time.monotonic()
    assert run_forked(apply_args(syn, bare, fresh_copy(prepared, tmp_path / "timing" / "llama"))) == 0
    duration = time.monotonic() - t0
    rng = random.Random(1313)
    outcomes: dict[str, int] = {}
    for number in range(6):
        where = tmp_path / f"random-{number}"
        where.mkdir()
        dest = where / "llama"
        if number % 2:
            fresh_copy(prepared, dest)
        before = user_files(dest)
        sig_name = rng.choice(["INT", "KILL"])
        code = run_forked(apply_args(syn, bare, dest), kill_after=rng.uniform(0, duration), sig=SIGNALS[sig_name])
        outcomes[f"{sig_name}:{code}"] = outcomes.get(f"{sig_name}:{code}", 0) + 1
        assert code in (0, 130, -signal.SIGKILL, -signal.SIGINT), code
        rerun = run_forked(apply_args(syn, bare, dest))
        assert rerun == 0, (number, sig_name, code)
        assert_fully_patched(dest, syn, expected)
        assert user_files(dest) == before
        assert leftovers(dest, own_cache) == []
    _report("fault-injection (random)", {"runs": 12, "outcomes": outcomes})


def test_real_subprocess_interrupted_and_rerun(world, tmp_path, own_cache):
    """The same with `python -m dfbuild.cli`: Ctrl-C to its process group at a fault point, then kill -9."""
    syn, bare, expected, prepared = world
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for sig_name, step in (("INT", 4), ("KILL", 7)):
        dest = fresh_copy(prepared, tmp_path / sig_name / "llama")
        before = user_files(dest)
        stopped = subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, apply_args(syn, bare, dest))],
                                 env={**env, state.STOP_AFTER_ENV: str(step), state.STOP_SIGNAL_ENV: sig_name},
                                 capture_output=True, text=True)
        assert stopped.returncode == (130 if sig_name == "INT" else -signal.SIGKILL), stopped.stderr
        if sig_name == "INT":
            assert "interrupted" in stopped.stderr and "Traceback" not in stopped.stderr
        rerun = subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, apply_args(syn, bare, dest))],
                               env=env, capture_output=True, text=True)
        assert rerun.returncode == 0, rerun.stderr
        if sig_name == "KILL":  # Ctrl-C rolled back in the run itself; after kill -9 the rerun does it, and says so
            assert "was interrupted" in " ".join(rerun.stderr.split())
        assert_fully_patched(dest, syn, expected)
        assert user_files(dest) == before


def test_two_applies_at_once(world, tmp_path, own_cache):
    """Two applies on one tree, many times: both succeed (one waits) or one says 'locked' (--no-wait)."""
    syn, bare, expected, prepared = world
    outcomes: dict[str, int] = {}
    rounds = 0
    for number in range(6):
        no_wait = number >= 3
        where = tmp_path / f"pair-{number}"
        where.mkdir()
        dest = where / "llama"
        if number % 2:
            fresh_copy(prepared, dest)
        extra = ("--no-wait",) if no_wait else ()
        first = run_forked(apply_args(syn, bare, dest, *extra), start=False)
        second = run_forked(apply_args(syn, bare, dest, *extra), start=False)
        codes = sorted([wait(first), wait(second)])
        rounds += 1
        key = ("no-wait " if no_wait else "wait ") + "+".join(map(str, codes))
        outcomes[key] = outcomes.get(key, 0) + 1
        if no_wait:
            assert codes in ([0, 0], [0, 15]), codes
        else:
            assert codes == [0, 0], codes
        assert_fully_patched(dest, syn, expected)
        assert leftovers(dest, own_cache) == []
    _report("concurrency", {"rounds": rounds, "runs": 2 * rounds, "outcomes": outcomes})
