"""A real release serves its web UI: `dfbuild release --base b11434`, then GET / on the unpacked archive.

The release comes from the "any head" proof's work dir, as test_release_e2e.py's does (its builds and
smoke are reused; the web UI is built once per test cache from b11434's tools/ui with npm, then taken
from dfbuild's cache). Away from the build dir, the archive's own llama-server, on 127.0.0.1 with the
tiny fixtures, answers GET / with the UI's HTML page (gzip, as llama.cpp serves it), the assets the
page loads too, and the manifest and release notes say where the UI came from. The browser test
(test_webui_browser.py, opt-in) chats through that page.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE, RELEASE_CPU_VARIANTS

from dfbuild import smoke
from dfbuild.core import unpack
from dfbuild.smoke import fixtures
from dfbuild.verify import release_dir as verify

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the offline CPU release is checked on Linux"),
]


def dfbuild(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("webui-release")
    out = tmp / "out"
    result = dfbuild("release", "--base", REAL_BASE, "--backend", "cpu", "--out", out, "--work", CACHE / "work" / REAL_BASE,
                     *(["--cpu-variants", RELEASE_CPU_VARIANTS] if RELEASE_CPU_VARIANTS else []), "-j", "2", "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    full = json.loads(result.stdout)
    unpack.extract(out / full["release"]["archive"], tmp / "unpacked")
    return {"out": out, "manifest": full, "server": smoke.server_binary(tmp / "unpacked" / full["release"]["root"])}


def get(url: str, gzip_ok: bool = True) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip_ok else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read()
            headers = dict(answer.headers)
            if headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            return answer.status, headers, body
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_archived_server_answers_get_root_with_its_web_ui(released, tmp_path):
    section = fixtures.ensure_fixtures(CACHE / "fixtures")
    fset = section["sets"]["qwen35-grid-plain-agree"]
    args = [a for a in smoke.base_server_args(fset, speculative=True) if a != "--no-webui"]
    with smoke.LlamaServer(released["server"], args, tmp_path / "server.log") as server:
        status, headers, body = get(server.url("/"))
        assert status == 200 and headers["Content-Type"].startswith("text/html"), (status, headers)
        page = body.decode("utf-8")
        assert "<html" in page.lower() and "_app/immutable/" in page  # the SvelteKit app's page
        # what the page loads is there too: its script bundle, and build.json naming this release's number
        bundle = re.search(r'(_app/immutable/[^"\']+\.js)', page)
        assert bundle, page[:2000]
        assert get(server.url("/" + bundle.group(1)))[0] == 200
        status, _, build_json = get(server.url("/build.json"))
        assert status == 200 and json.loads(build_json) == {"version": REAL_BASE}
        # --no-webui still turns it off at run time, as upstream's
    with smoke.LlamaServer(released["server"], args + ["--no-webui"], tmp_path / "server-no-webui.log") as server:
        assert get(server.url("/"))[0] == 404


def test_the_manifest_and_the_release_notes_say_where_the_ui_came_from(released):
    ui = released["manifest"]["build"]["ui"]
    assert ui["embedded"] and ui["source"] == "built" and ui["recipe"] == "ui-build-job"
    assert ui["npm_steps"][:2] == ["npm ci --no-audit --no-fund --prefer-offline", "npm run build"]
    assert ui["shows_version"] == REAL_BASE and ui["assets"] > 10
    assert ui["cmake"] == "UI: using pre-built assets from tools/ui/dist"
    assert released["manifest"]["build"]["flags"]["LLAMA_BUILD_UI"] == "OFF"
    notes = verify.release_notes(released["out"], REAL_BASE)
    assert f"`{released['manifest']['release']['archive']}`: web UI built from the tree's tools/ui sources" in notes
