"""The smoke scenarios on real, unpatched llama-server builds: proof that they can fail.

On an unpatched tree, every scenario with an image fails on the M-RoPE (qwen35)
sets with the upstream symptom, while text-only requests and the llama control
(linear image positions) pass. That is what makes a pass on the patched build
mean something. The patched half of the proof runs the same scenarios through
`run_smoke` and asserts `passed` (the lead's build fixtures wire it).
"""

from __future__ import annotations

import pytest

from dfbuild import smoke

from test_fixtures import server_binary_for

IMAGE_SCENARIOS = [name for name, s in smoke.SCENARIOS.items() if any(step.has_image for step in s.steps)]

# What an unpatched tree does, per base and fixture set: "bug" = every image scenario
# fails with the upstream symptom, "pass" = every scenario passes.
UNPATCHED = {
    "b10359": {
        "llama-mlp-agree": "pass",
        "qwen35-mlp-plain-agree": "bug",
        "qwen35-grid-plain-agree": "bug",
        "qwen35-grid-sections-agree": "bug",  # b10359 ignores dflash.rope.dimension_sections
        "qwen35-grid-plain-random": "bug",
    },
    "b11312": {
        "llama-mlp-agree": "pass",
        "qwen35-mlp-plain-agree": "bug",
        "qwen35-grid-plain-agree": "bug",
        "qwen35-grid-sections-agree": "pass",  # upstream's "reconvert your GGUF" answer
        "qwen35-grid-plain-random": "bug",
    },
}


@pytest.mark.integration
@pytest.mark.parametrize("base", sorted(UNPATCHED))
def test_unpatched_server_fails_image_scenarios_with_the_upstream_symptom(base, tmp_path):
    binary = server_binary_for(base)
    if binary is None:
        pytest.skip(f"no llama-server for {base}: set DFBUILD_TEST_SERVER_{base.upper()}")
    expected = UNPATCHED[base]
    section = smoke.run_smoke(binary.parent.parent, tmp_path / "fixtures", sets=list(expected),
                              log_dir=tmp_path / "logs")

    problems = []
    for scenario, by_set in section["results"].items():
        for set_name, result in by_set.items():
            where = f"{scenario}/{set_name}"
            if expected[set_name] == "bug" and scenario in IMAGE_SCENARIOS:
                if result["passed"]:
                    problems.append(f"{where}: passed on the unpatched tree, so it cannot prove the fix")
                elif not result["upstream_symptom"]:
                    problems.append(f"{where}: failed, but not with the upstream symptom: {result['failures'][:3]}")
            elif not result["passed"]:
                problems.append(f"{where}: should pass unpatched: {result['failures'][:3]}")
    assert not problems, "\n".join(problems)


def patched_server_binary_for(base: str):
    """The llama-server built from `base` with the series applied, or None.

    DFBUILD_TEST_PATCHED_SERVER_<BASE> points at it until the build fixtures make one.
    """
    import os
    from pathlib import Path

    override = os.environ.get(f"DFBUILD_TEST_PATCHED_SERVER_{base.upper()}")
    return Path(override) if override else None


@pytest.mark.integration
@pytest.mark.parametrize("base", sorted(UNPATCHED))
def test_patched_server_passes_every_scenario(base, tmp_path):
    binary = patched_server_binary_for(base)
    if binary is None:
        pytest.skip(f"no patched llama-server for {base}: set DFBUILD_TEST_PATCHED_SERVER_{base.upper()}")
    section = smoke.run_smoke(binary.parent.parent, tmp_path / "fixtures", sets=list(UNPATCHED[base]),
                              log_dir=tmp_path / "logs")
    failures = [f"{sc}/{st}: {r['failures'][:3]}" for sc, by_set in section["results"].items()
                for st, r in by_set.items() if not r["passed"]]
    assert not failures, "\n".join(failures)
