"""The release's own web UI in a real browser: headless Chromium chats with an image through it.

`dfbuild release --base b11434` (realtrees.REAL_BASE, from the "any head" proof's work dir, as
test_release_e2e.py does) builds llama-server with the web UI built from the tree's own tools/ui.
The unpacked archive's llama-server runs on 127.0.0.1 with the tiny M-RoPE fixtures (the qwen35
target, the qwen2vl_merger projector, the plain-rope DFlash draft, all agreeing) and
`--spec-type draft-dflash`. Debian's Chromium, driven by Playwright (playwright from PyPI; no
browser download: executable_path is Debian's /usr/bin/chromium), opens GET /, attaches an
image, sends a message, and the answer appears; the server log shows no draft decode failure
and the draft counters show accepted drafts. A screenshot of the answer is written (docs/
keeps one: DFBUILD_SCREENSHOT=PATH writes it there). The unpatched build of the same tree
(the proof's), through the same browser steps, shows the error instead: upstream's bug.

Marked `browser` (release runs), opt-in: DFBUILD_BROWSER_TESTS=1, with which scripts/test.sh
installs Debian's chromium and the `browser` extra (playwright) (docs/ci.md); missing either fails
the opted-in run rather than skipping it.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE, RELEASE_CPU_VARIANTS, server_for

from dfbuild import smoke
from dfbuild.core import unpack
from dfbuild.smoke import fixtures
from dfbuild.smoke.run import ACCEPTED, DRAFTED

OPT_IN = "DFBUILD_BROWSER_TESTS"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.skipif(os.environ.get(OPT_IN) != "1", reason=f"opt-in (release runs): {OPT_IN}=1"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Debian's Chromium, on Linux"),
]

CHROMIUM = os.environ.get("DFBUILD_CHROMIUM", "/usr/bin/chromium")
# as the machine's notes say a headless Chromium runs here: no sandbox (root), no GPU, and no
# background connections (this machine's closed network refuses them, many at a time)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FIXTURE_SET = "qwen35-grid-plain-agree"   # M-RoPE target, 2-D grid projector, plain-rope draft: the bug's shape
MESSAGE = "What is in this picture?"
N_PREDICT = "24"   # the agree fixtures never stop on their own; the UI asks for as many as the server gives
ANSWER_TIMEOUT_MS = 240_000


def dfbuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def playwright_api():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser test needs Playwright's Python package: pip install -e '.[browser]' "
                    "(no `playwright install`: it drives Debian's Chromium)")
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set DFBUILD_CHROMIUM)")
    return sync_playwright


@pytest.fixture(scope="module")
def patched_server(tmp_path_factory) -> Path:
    """llama-server of the release's own archive, unpacked away from its build dir."""
    tmp = tmp_path_factory.mktemp("browser-release")
    out = tmp / "out"
    result = dfbuild("release", "--base", REAL_BASE, "--backend", "cpu", "--out", out, "--work",
                     CACHE / "work" / REAL_BASE, *(["--cpu-variants", RELEASE_CPU_VARIANTS] if RELEASE_CPU_VARIANTS
                                                     else []), "-j", "2", "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    full = json.loads(result.stdout)
    assert full["build"]["ui"]["embedded"] and full["build"]["ui"]["source"] == "built", full["build"]["ui"]
    unpack.extract(out / full["release"]["archive"], tmp / "unpacked")
    return smoke.server_binary(tmp / "unpacked" / full["release"]["root"])


@pytest.fixture(scope="module")
def unpatched_server() -> Path:
    """The same tree's base commit, built the same way (the proof's unpatched binaries)."""
    return server_for(REAL_BASE, patched=False)


@pytest.fixture(scope="module")
def fixture_set(tmp_path_factory) -> tuple[dict, str]:
    section = fixtures.ensure_fixtures(CACHE / "fixtures")
    return section["sets"][FIXTURE_SET], section["images"]["small"]


def get_root(url: str) -> dict:
    """GET / as a browser asks for it: the embedded UI is gzip-compressed (llama-server answers 415 to a
    client that does not accept gzip)."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=30) as page:
        body = page.read()
        if page.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return {"status": page.status, "type": page.headers.get("Content-Type", ""),
                "html": body.decode("utf-8", errors="replace")}


def chat_in_browser(sync_playwright, binary: Path, fixture_set: tuple[dict, str], log_dir: Path,
                    screenshot: Path | None = None) -> dict:
    """Start BINARY on 127.0.0.1 with the UI, chat with an image through Chromium; what the page, the
    browser's request and the server showed."""
    fset, image = fixture_set
    args = [a for a in smoke.base_server_args(fset, speculative=True) if a != "--no-webui"] + ["-n", N_PREDICT]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "server.log"
    with smoke.LlamaServer(binary, args, log_path) as server:
        seen: dict = {"root": get_root(server.url("/"))}
        with tempfile.TemporaryDirectory(prefix="dfbuild-chromium-") as profile, sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
                viewport={"width": 1100, "height": 720})
            try:
                seen.update(_chat(context, server.url("/"), image, screenshot))
            finally:
                context.close()
        seen["metrics"] = smoke.prometheus_counters(server.request("GET", "/metrics", timeout=30).text)
        seen["alive"] = server.alive()
    seen["log"] = log_path.read_text(encoding="utf-8", errors="replace")
    seen["findings"] = smoke.scan_log(seen["log"])
    return seen


def _chat(context, url: str, image: str, screenshot: Path | None) -> dict:
    page = context.new_page()
    console: list[str] = []
    sent: list[dict] = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))

    def on_request(request) -> None:
        if request.method == "POST" and request.url.endswith("/v1/chat/completions"):
            try:
                sent.append(json.loads(request.post_data or "{}"))
            except ValueError:
                sent.append({"unreadable": request.post_data})

    page.on("request", on_request)
    page.goto(url, wait_until="domcontentloaded")
    box = page.locator("textarea, [contenteditable='true']").first  # the chat box
    box.wait_for(state="visible", timeout=120_000)
    page.locator("input[type='file']").first.set_input_files(image)
    box.click()
    page.keyboard.type(MESSAGE)
    page.keyboard.press("Enter")
    # the answer (the agree fixtures answer one letter, over and over) or the UI's error dialog
    page.wait_for_function(
        """([letter, n]) => {
            const text = document.body.innerText;
            return text.includes(letter.repeat(n)) || text.includes("Server Error");
        }""", arg=[fixtures.AGREE_LETTER, int(N_PREDICT)], timeout=ANSWER_TIMEOUT_MS)
    time.sleep(1.0)  # the stream's last event, and the page drawn after it
    text = page.locator("body").inner_text()
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot))
    return {"text": text, "console": console, "sent": sent}


def _answered(seen: dict) -> bool:
    return fixtures.AGREE_LETTER * int(N_PREDICT) in seen["text"]


def _sent_the_image(seen: dict) -> bool:
    """The UI's request carried the picture: an image_url part with the PNG as a data URL."""
    for body in seen["sent"]:
        for message in body.get("messages") or []:
            content = message.get("content")
            for part in content if isinstance(content, list) else []:
                url = (part.get("image_url") or {}).get("url", "") if isinstance(part, dict) else ""
                if url.startswith("data:image/png;base64,"):
                    return True
    return False


def test_the_release_serves_its_web_ui_and_answers_an_image_chat_with_accepted_drafts(
        playwright_api, patched_server, fixture_set, tmp_path):
    shot = Path(os.environ.get("DFBUILD_SCREENSHOT") or tmp_path / "webui-image-chat.png")
    seen = chat_in_browser(playwright_api, patched_server, fixture_set, tmp_path / "patched", screenshot=shot)
    assert seen["root"]["status"] == 200 and seen["root"]["type"].startswith("text/html")
    assert "<html" in seen["root"]["html"].lower()
    assert _sent_the_image(seen), seen["sent"]
    assert _answered(seen), (seen["text"][-2000:], seen["console"][-20:])
    assert MESSAGE in seen["text"] and "Server Error" not in seen["text"]
    assert seen["findings"] == [], seen["findings"]
    assert seen["alive"]
    accepted, drafted = seen["metrics"].get(ACCEPTED, 0), seen["metrics"].get(DRAFTED, 0)
    assert drafted > 0 and accepted > 0, seen["metrics"]
    assert shot.is_file() and shot.stat().st_size > 0


def test_the_unpatched_build_shows_the_error_in_the_same_browser_steps(playwright_api, unpatched_server,
                                                                        fixture_set, tmp_path):
    seen = chat_in_browser(playwright_api, unpatched_server, fixture_set, tmp_path / "unpatched",
                           screenshot=tmp_path / "webui-unpatched.png")
    assert seen["root"]["status"] == 200  # the same UI: the tree's own, built the same way
    assert _sent_the_image(seen), seen["sent"]
    assert "Server Error" in seen["text"] and not _answered(seen), seen["text"][-2000:]
    assert any(f["pattern"] in ("draft decode failed", "speculative batch failed", "inconsistent positions")
               for f in seen["findings"]), seen["log"][-3000:]
