"""The export's proof (export_proof), fast: pytest's words read, the verdict, the offline plugin under both conftest
styles upstream has had, a pytest run's environment, and the export with the proof faked (its record, PR.md, exit
28 and nothing written). The real proof, on b11434's builds, is in test_export_real.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import dfbuild, said
from test_export import a_submitter, own_cache, run_export  # noqa: F401  (the fixtures of test_export)
from test_series import syn, template  # noqa: F401

from dfbuild.core.errors import ExportProofError
from dfbuild.export import proof as export_proof
from dfbuild.export import upstream as export

FAILED_OUTPUT = """\
unit/test_speculative_mtmd.py::test_dflash_plain_rope_draft_after_mrope_image FAILED [100%]
E       AssertionError: {'error': {'code': 500, 'message': 'decode() failed: failed to process speculative batch', 'type': 'server_error'}}
0.00.336.298 E init: the tokens of sequence 0 in the input batch have inconsistent sequence positions:
 - the last position stored in the memory module of the context (i.e. the KV cache) for sequence 0 is X = 21
 - the tokens for sequence 0 in the input batch have a starting position of Y = 25
=========================== short test summary info ============================
FAILED unit/test_speculative_mtmd.py::test_dflash_plain_rope_draft_after_mrope_image - AssertionError: {'error'
============================== 1 failed in 1.15s ===============================
"""
PASSED_OUTPUT = """\
unit/test_speculative_mtmd.py::test_dflash_plain_rope_draft_after_mrope_image PASSED [100%]
============================== 1 passed in 2.53s ===============================
"""


def test_pytests_words_are_read_as_passed_or_failed_with_its_summary_and_the_symptom():
    failed = export_proof.read_run(1, FAILED_OUTPUT)
    assert failed["result"] == "failed" and failed["returncode"] == 1
    assert failed["summary"] == [
        "FAILED unit/test_speculative_mtmd.py::test_dflash_plain_rope_draft_after_mrope_image - AssertionError: {'error'",
        "1 failed in 1.15s"]
    assert failed["symptom"] == ("HTTP 500 `decode() failed: failed to process speculative batch`, after "
                                 "`inconsistent sequence positions` (X = 21, Y = 25)")
    passed = export_proof.read_run(0, PASSED_OUTPUT)
    assert passed == {"result": "passed", "returncode": 0, "summary": ["1 passed in 2.53s"], "symptom": None}
    # an error at setup, no tests, a crash: never "passed"
    assert export_proof.read_run(1, "=== 1 error in 0.20s ===\n")["result"] == "failed"
    assert export_proof.read_run(5, "=== no tests ran in 0.01s ===\n")["result"] == "failed"
    assert export_proof.read_run(0, "")["result"] == "failed"  # exit 0 but pytest said nothing


def run(result: str, symptom: str | None = None, last: str = "1 failed in 1s") -> dict:
    return {"result": result, "returncode": 0 if result == "passed" else 1, "summary": [last],
            "symptom": symptom, "log": f"/w/pytest-{result}.log"}


def test_the_verdict_holds_only_for_failed_with_the_symptom_then_passed():
    export_proof.verdict("b1", run("failed", "HTTP 500"), run("passed", last="1 passed in 1s"))
    cases = {
        "patched failed (1 failed in 1s)": (run("failed", "HTTP 500"), run("failed", "HTTP 500")),
        "unpatched passed (1 passed in 1s)": (run("passed", last="1 passed in 1s"),
                                              run("passed", last="1 passed in 1s")),
        "unpatched failed (1 failed in 1s, but not with the bug's symptom)": (run("failed"),
                                                                              run("passed", last="1 passed")),
    }
    for said_, (unpatched, patched) in cases.items():
        with pytest.raises(ExportProofError) as refused:
            export_proof.verdict("b1", unpatched, patched)
        assert refused.value.exit_code == 28
        assert said_ in str(refused.value) and "nothing was written" in str(refused.value)
        assert "/w/pytest-failed.log" in refused.value.hint or "/w/pytest-passed.log" in refused.value.hint


# the two conftest styles upstream has had: a module fixture (b10159) and a session fixture with a lock (b11046)
CONFTESTS = {
    "module": """
        import pytest
        from utils import *

        @pytest.fixture(scope="module", autouse=True)
        def do_something():
            ServerPreset.load_all()
    """,
    "session": """
        import pytest
        from utils import *

        @pytest.fixture(scope="session", autouse=True)
        def load_server_presets(tmp_path_factory):
            ServerPreset.load_all()
    """,
}
UTILS = """
    import os

    class ServerPreset:
        @staticmethod
        def load_all() -> None:
            raise RuntimeError("downloading the presets: no network")

    SERVER = os.environ.get("LLAMA_SERVER_BIN_PATH")
"""


def fake_harness(tree: Path, conftest: str) -> Path:
    tests = tree / export_proof.TESTS_DIR
    (tests / "unit").mkdir(parents=True)
    (tests / "conftest.py").write_text(textwrap.dedent(conftest))
    (tests / "utils.py").write_text(textwrap.dedent(UTILS))
    (tests / "unit" / export.TEST_NAME).write_text(textwrap.dedent("""
        import os
        from utils import *

        def test_it():
            assert SERVER.endswith("llama-server") and os.environ["PORT"].isdigit()
            assert os.environ["SERVER_SAYS"] == "pass", "inconsistent sequence positions"
    """))
    return tree


@pytest.mark.parametrize("style", sorted(CONFTESTS))
def test_the_offline_plugin_skips_the_presets_preload_and_nothing_else(tmp_path, monkeypatch, style):
    tree = fake_harness(tmp_path / "tree", CONFTESTS[style])
    server = tmp_path / "build" / "bin" / "llama-server"
    monkeypatch.setenv("SERVER_SAYS", "pass")
    monkeypatch.setenv("PYTEST_ADDOPTS", "-x --no-such-option")  # the user's pytest options stay out
    passed = export_proof.run_pytest(Path(sys.executable), tree, server, tmp_path / "passed.log")
    assert passed["result"] == "passed", Path(passed["log"]).read_text()
    monkeypatch.setenv("SERVER_SAYS", "fail")
    failed = export_proof.run_pytest(Path(sys.executable), tree, server, tmp_path / "failed.log")
    assert failed["result"] == "failed" and failed["symptom"] == "`inconsistent sequence positions`"
    assert failed["summary"][-1].startswith("1 failed in ")
    # without the plugin, the preload fails the session: what a machine without network sees
    from dfbuild.core import proc

    result = proc.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"unit/{export.TEST_NAME}"],
                      cwd=tree / export_proof.TESTS_DIR,
                      extra_env={"LLAMA_SERVER_BIN_PATH": str(server), "PORT": "1", "PYTEST_ADDOPTS": ""})
    assert result.returncode != 0 and "no network" in result.stdout
    # and no file of the harness was changed
    assert "load_all()" in (tree / export_proof.TESTS_DIR / "conftest.py").read_text()


PROOF = {"unpatched": "failed", "patched": "passed", "symptom": "HTTP 500 `x`, after `inconsistent sequence positions`",
         "summary": {"unpatched": ["1 failed in 1.0s"], "patched": ["1 passed in 1.0s"]}, "backend": "cpu",
         "offline_plugin": "dfbuild_offline_presets"}


def test_the_export_records_its_proof_and_pr_md_shows_it(syn, tmp_path, monkeypatch):
    seen = {}

    def prove(base, patches, *, request, work, commit_env, repo):
        seen.update(base=base, patches=[p.name for p in patches], request=request, work=work, repo=repo)
        assert all(p.is_file() for p in patches)  # the export's own files, before anything is published
        return PROOF

    monkeypatch.setattr(export_proof, "prove_export", prove)
    out = tmp_path / "export"
    result = run_export(syn, out, "--json", "--backend", "cpu", "--cpu-variants", "x64", "--work", tmp_path / "w",
                        prove=True)
    assert result.exit_code == 0, said(result)
    assert seen["base"] == syn.base_commit and len(seen["patches"]) == 2 and seen["repo"] == str(syn.upstream)
    assert seen["request"].backend == "cpu" and seen["request"].cpu_variants == ("x64",)
    assert seen["request"].targets == ("llama-server",) and seen["request"].web_ui is False
    assert seen["work"] == tmp_path / "w"
    record = json.loads((out / ".dfbuild-export.json").read_text())
    assert record["proof"] == PROOF == json.loads(result.stdout)["proof"]
    text = (out / "PR.md").read_text()
    assert f"| {syn.base_commit} + this PR | `1 passed in 1.0s` |" in text and "not recorded" not in text


def test_an_export_whose_test_proves_nothing_exits_28_and_writes_nothing(syn, tmp_path, monkeypatch):
    def prove(base, patches, **_):
        raise ExportProofError("the exported test does not prove the fix: unpatched failed, patched failed", "logs")

    monkeypatch.setattr(export_proof, "prove_export", prove)
    out = tmp_path / "export"
    result = run_export(syn, out, prove=True)
    assert result.exit_code == 28, said(result)
    assert "patched failed" in said(result)
    assert not out.exists() and not list(tmp_path.glob(".export.export-*"))
    # an earlier export in OUT stays as it was
    assert run_export(syn, out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert run_export(syn, out, prove=True).exit_code == 28
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_default_work_dir_is_dfbuilds_own(tmp_path, monkeypatch):
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path))
    assert export_proof.default_work("b11434") == tmp_path / "export-proofs" / "b11434"
    assert export_proof.default_work("a/b c") == tmp_path / "export-proofs" / "a-b-c"
    assert (export_proof.plugin_dir() / f"{export_proof.PLUGIN}.py").is_file()


def test_the_harness_python_is_the_given_one_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv(export_proof.PYTHON_ENV, "/opt/py/bin/python3")
    assert export_proof.harness_python(tmp_path / "requirements.txt") == Path("/opt/py/bin/python3")


def test_a_proof_killed_in_its_git_am_is_cleared_by_the_next(syn, tmp_path, monkeypatch):
    """kill -9 during the proof's git am leaves dfbuild's work tree mid-am; the next proof starts over there."""
    from helpers import run_git

    from dfbuild.build import tree as build
    from dfbuild.release import prove
    from dfbuild.source import checkout as source

    work = tmp_path / "w"
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    patches = sorted(out.glob("*.patch"))
    tree = work / "src"
    source.checkout(syn.base_commit, repo=str(syn.upstream), dest=tree)
    (tree / "common" / "speculative.cpp").write_text("// in the way\n")
    run_git(tree, "commit", "-qam", "in the way")
    stopped = subprocess.run(["git", "-C", str(tree), "am", "-q", *map(str, patches)], capture_output=True)
    assert stopped.returncode != 0 and (tree / ".git" / "rebase-apply").is_dir()  # stopped mid-am
    built = []
    monkeypatch.setattr(prove, "build_unpatched", lambda *a, **k: built.append("unpatched") or {"build_dir": "u"})
    monkeypatch.setattr(build, "build_tree", lambda *a, **k: built.append("patched") or {})
    monkeypatch.setattr(export_proof, "harness_python", lambda requirements: Path(sys.executable))
    monkeypatch.setattr(export_proof, "run_pytest",
                        lambda python, tree, server, log: {**run("failed", "HTTP 500"), "wall_s": 0})
    with pytest.raises(ExportProofError):  # the fake runs fail both: exit 28, after a clean checkout and git am
        export_proof.prove_export(syn.base_commit, patches, request=export._proof_request(), work=work,
                                  commit_env={"GIT_COMMITTER_NAME": "A", "GIT_COMMITTER_EMAIL": "a@example.org"},
                                  repo=str(syn.upstream))
    assert built == ["unpatched", "patched"] and not (tree / ".git" / "rebase-apply").exists()
    assert (tree / export.TEST_PATH).is_file()
