"""The walk a BuildRequest makes from release() through the build, counted (docs/architecture.md, issue 45).

Runs a test under a profile hook and counts, from the function followed until it returns:
- stops: calls that cross from one dfbuild module into another (a call inside a module is no stop);
- modules: how many modules those stops reach;
- re-entries: stops into a module the walk had already left;
- backend lookups: stops into the backend table (dfbuild's backends module), and which functions they call;
- lookups: those that look the backend or the host up again by name (get, resolve handed a name,
  current_host), by caller.
Two walks: release() with its stages stubbed (tests/test_release_unit.py) and build_tree on the tests'
fake tree with real CMake and ninja (tests/test_build.py), each as its test runs it.
Layout-agnostic (it reads file paths), so the same script measures the flat layout and the packages.

    python bench/request_walk.py [REPO]     # prints the counts as JSON (REPO: another checkout, e.g. an
                                            # old commit's worktree, measured the same way)
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import pytest

    SRC = str(Path(os.environ["WALK_SRC"]).resolve())
    ENTRY = os.environ["WALK_ENTRY"]                       # the function whose calls are followed
    HOMES = tuple(os.environ["WALK_HOMES"].split(","))     # the modules it may live in (old and new layout)
    stops, depth = [], {"in": 0}

    def module_of(code):
        name = code.co_filename
        if not name.startswith(SRC):
            return None
        return name[len(SRC) + 1:].removesuffix(".py").replace("/", ".").removesuffix(".__init__")

    def profile(frame, event, arg):
        if event != "call":
            if event == "return" and frame.f_code.co_name == ENTRY and (module_of(frame.f_code) or "").endswith(HOMES):
                depth["in"] -= 1
            return
        here = module_of(frame.f_code)
        if here is None:
            return
        if frame.f_code.co_name == ENTRY and here.endswith(HOMES):
            depth["in"] += 1
        if depth["in"] <= 0:
            return
        caller = frame.f_back
        while caller is not None and module_of(caller.f_code) is None:
            caller = caller.f_back
        there = module_of(caller.f_code) if caller is not None else None
        if there is not None and there != here:
            name = frame.f_code.co_name
            if name == "resolve":  # a lookup only when handed a name; a table entry passes through
                name = "resolve(name)" if isinstance(frame.f_locals.get("backend"), str) else "resolve(entry)"
            stops.append((there, here, name, f"{there}:{caller.f_code.co_name}"))

    def pytest_collection_finish(session):  # the fixture that releases runs at setup: profile it too
        sys.setprofile(profile)

    def pytest_sessionfinish(session, exitstatus):
        sys.setprofile(None)
        Path(os.environ["WALK_OUT"]).write_text(json.dumps(stops))
''')


# (the test that runs it, the function followed, the modules it lives in: the flat layout's and the packages')
WALKS = {
    "release": ("tests/test_release_unit.py::test_pipeline_records_stage_times_and_a_rerun_reuses_smoke_and_artifacts",
                "release", "dfbuild.release,dfbuild.release.pipeline"),
    "build": ("tests/test_build.py::test_build_configures_once_then_is_a_noop",
              "build_tree", "dfbuild.build,dfbuild.build.tree"),
}


def measure(root: Path, walk: str) -> dict:
    test, entry, homes = WALKS[walk]
    work = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True, check=True).stdout.strip())
    (work / "walk_plugin.py").write_text(PLUGIN)
    out = work / "stops.json"
    env = {**__import__("os").environ, "PYTHONPATH": f"{work}:{root / 'src'}", "WALK_SRC": str(root / "src"),
           "WALK_OUT": str(out), "WALK_ENTRY": entry, "WALK_HOMES": homes}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "walk_plugin", "-p", "no:cacheprovider",
                    test],
                   cwd=root, env=env, check=True, capture_output=True)
    records = json.loads(out.read_text())
    stops = [tuple(s[:3]) for s in records]
    lookups = collections.Counter(f"{s[3]} -> {s[2]}" for s in records
                                  if s[1].endswith("backends") and s[2] in ("get", "resolve(name)", "current_host"))
    left: set[str] = set()
    reentries = 0
    current = None
    for caller, callee, _ in stops:
        if current is not None and current != caller:
            left.add(current)
        if callee in left:
            reentries += 1
        left.add(caller)
        current = callee
    backend_calls = collections.Counter(f for _, callee, f in stops if callee.endswith("backends"))
    return {"stops": len(stops), "modules": len({c for _, c, _ in stops} | {c for c, _, _ in stops}),
            "re_entries": reentries, "backend_lookups": sum(backend_calls.values()),
            "backend_functions": dict(sorted(backend_calls.items())),
            "lookups": sum(lookups.values()), "lookups_by_caller": dict(sorted(lookups.items()))}


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    print(json.dumps({walk: measure(where, walk) for walk in WALKS}, indent=1))
