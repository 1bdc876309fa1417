"""The proof: on the same fixtures and scenarios, unpatched llama-server fails and patched passes.

On an unpatched tree every scenario with an image fails on the M-RoPE (qwen35)
sets with the upstream symptom, while text-only requests and the llama control
(linear image positions) pass; that is what makes a pass on the patched build
mean something. An ablation without noise-block-base shows that concern is
needed too: on the 2-D grid fixture image requests then succeed but stop drafting.
"""

from __future__ import annotations

import json

import pytest
from realtrees import SLOW_BASES, server_for

from dfbuild import smoke

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGE_SCENARIOS = [name for name, s in smoke.SCENARIOS.items() if any(step.has_image for step in s.steps)]

# What an unpatched tree does, per base and fixture set: "bug" = every image scenario
# fails with the upstream symptom, "pass" = every scenario passes.
UNPATCHED = {
    "pydist-0.94.0": {
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


def run(binary, tmp_path, label, **kwargs) -> dict:
    section = smoke.run_smoke(binary.parent.parent, tmp_path / "fixtures", log_dir=tmp_path / f"logs-{label}",
                              **kwargs)
    (tmp_path / f"smoke-{label}.json").write_text(json.dumps(section, indent=1, default=str))
    return section


def table(unpatched: dict, patched: dict) -> str:
    """scenario/set: unpatched -> patched, with HTTP statuses and image drafts accepted."""
    lines = []
    for scenario, by_set in unpatched["results"].items():
        for set_name, before in by_set.items():
            after = patched["results"][scenario][set_name]

            def cell(r):
                verdict = "pass" if r["passed"] else ("FAIL(upstream symptom)" if r["upstream_symptom"] else "FAIL")
                return f"{verdict} {r['statuses']} drafts {r.get('image_accepted', 0)}/{r.get('image_drafted', 0)}"

            lines.append(f"{scenario:17} {set_name:27} {cell(before):55} -> {cell(after)}")
    return "\n".join(lines)


@pytest.mark.parametrize("base", [b for b in sorted(UNPATCHED) if b in SLOW_BASES])
def test_unpatched_fails_with_the_upstream_symptom_and_the_series_fixes_it(base, tmp_path, record_property):
    expected = UNPATCHED[base]
    unpatched = run(server_for(base, patched=False), tmp_path, "unpatched", sets=list(expected))
    patched = run(server_for(base, patched=True), tmp_path, "patched", sets=list(expected))
    record_property("unpatched_vs_patched", "\n" + table(unpatched, patched))
    print(f"\n{base}: unpatched -> patched\n{table(unpatched, patched)}")

    problems = []
    for scenario, by_set in unpatched["results"].items():
        for set_name, result in by_set.items():
            where = f"{scenario}/{set_name}"
            if expected[set_name] == "bug" and scenario in IMAGE_SCENARIOS:
                if result["passed"]:
                    problems.append(f"unpatched {where}: passed, so it cannot prove the fix")
                elif not result["upstream_symptom"]:
                    problems.append(f"unpatched {where}: failed, but not with the upstream symptom: "
                                    f"{result['failures'][:3]}")
            elif not result["passed"]:
                problems.append(f"unpatched {where}: should pass: {result['failures'][:3]}")
    for scenario, by_set in patched["results"].items():
        for set_name, result in by_set.items():
            if not result["passed"]:
                problems.append(f"patched {scenario}/{set_name}: {result['failures'][:3]}")
            elif scenario in IMAGE_SCENARIOS and set_name.endswith("-agree"):
                assert result["image_drafted"] > 0 and result["image_acceptance"] >= 0.9, (scenario, set_name)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif("pydist-0.94.0" not in SLOW_BASES, reason="builds b10359: DFBUILD_TEST_BASES=b10355,b10359 runs it")
def test_without_noise_block_base_grid_images_succeed_but_stop_drafting(tmp_path):
    """Ablation: zero-fill alone fixes the 500s; only noise-block-base brings drafting back on a 2-D grid."""
    binary = server_for("pydist-0.94.0", patched=True, skip=("noise-block-base",))
    section = run(binary, tmp_path, "ablation", sets=["qwen35-grid-plain-agree", "qwen35-mlp-plain-agree"],
                  scenarios=["image", "text-after-image", "two-images"])
    for scenario, by_set in section["results"].items():
        grid, mlp = by_set["qwen35-grid-plain-agree"], by_set["qwen35-mlp-plain-agree"]
        assert all(status == 200 for status in grid["statuses"]) and grid["alive"], (scenario, grid["statuses"])
        image_requests = [r for r in grid["requests"] if r["image"]]
        assert image_requests and all(r["draft_n_accepted"] == 0 for r in image_requests), (scenario, image_requests)
        assert not grid["passed"], f"{scenario}: the grid set should fail for lack of drafts"
        # why: the noise block, placed at the token count, fails the draft cache's continuity
        # check inside draft(), which gives up quietly; mirroring (process) itself succeeds
        log = open(grid["log"], encoding="utf-8", errors="replace").read()
        assert "draft: llama_decode returned -1" in log and "process: llama_decode(ctx_dft) failed" not in log
        # the mlp projector keeps token count and positions in step, which hides the missing concern
        assert mlp["passed"], (scenario, mlp["failures"][:3])
