#!/usr/bin/env python3
"""Redraw bench/speedup.png and the generated tables of bench/RESULTS.md from bench/results.json.

    python bench/report.py        (needs matplotlib: pip install -e '.[bench]')

Only the blocks between `<!-- BEGIN generated: X -->` and `<!-- END generated: X -->`
in RESULTS.md are rewritten; the prose around them is kept as written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import benchlib

RESULTS_MD = benchlib.BENCH_DIR / "RESULTS.md"
CHART = benchlib.BENCH_DIR / "speedup.png"
BARS = (("patched", "text"), ("patched", "image"), ("unpatched", "text"), ("unpatched", "image"))
COLOURS = {("patched", "text"): "#2b6cb0", ("patched", "image"): "#63b3ed",
           ("unpatched", "text"): "#9c4221", ("unpatched", "image"): "#f6ad55"}

SKELETON = """# Benchmarks

<!-- BEGIN generated: spec_images -->
<!-- END generated: spec_images -->

<!-- BEGIN generated: build_cost -->
<!-- END generated: build_cost -->
"""


# --- chart -------------------------------------------------------------------------------


def draw_chart(spec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(spec)
    width = 0.2
    fig, ax = plt.subplots(figsize=(2.6 + 2.4 * len(labels), 4.2), dpi=120)
    top = 1.0
    for g, label in enumerate(labels):
        run = spec[label]
        for b, (build, kind) in enumerate(BARS):
            x = g + (b - 1.5) * width
            value = run[build].get(f"{kind}_speedup")
            name = f"{build} {kind}"
            if value is None:  # failed requests: no speed-up to draw
                ax.bar(x, 0.04, width, color="white", edgecolor=COLOURS[(build, kind)], hatch="xx",
                       label=name if g == 0 else None)
                ax.text(x, 0.08, run[build].get(f"{kind}_status", "fails").replace("fails ", "fails\n"),
                        ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            lo, hi = run[build][f"{kind}_speedup_range"]
            ax.bar(x, value, width, color=COLOURS[(build, kind)], label=name if g == 0 else None,
                   yerr=[[value - lo], [hi - value]], capsize=3, error_kw={"elinewidth": 1})
            ax.text(x, hi + 0.04, f"{value:.2f}x", ha="center", va="bottom", fontsize=8)
            top = max(top, hi)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([_group_label(label, spec[label]) for label in labels], fontsize=8)
    ax.set_ylabel("generation speed-up, draft-dflash / none")
    ax.set_ylim(0, top * 1.25)
    ax.set_title("DFlash speed-up on text and image requests\n(median and range over repetitions; "
                 "hatched: the request fails)", fontsize=9)
    ax.legend(fontsize=8, loc="upper right", ncols=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _group_label(label: str, run: dict) -> str:
    s = run["settings"]
    series = (run.get("series") or {}).get("hash") or "?"
    return (f"{label}{' (STALE)' if benchlib.stale(run) else ''}\n{run.get('base', '?')}, series {series}\n"
            f"{s['fixture']['target_params_m']:.0f} M params, -t {s['threads']}, n_max {s['spec_draft_n_max']}")


# --- tables --------------------------------------------------------------------------------


def _fmt(value, digits=2, suffix="") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _spread(stats: dict | None, digits=2) -> str:
    if not stats:
        return "–"
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"


def spec_tables(spec: dict) -> str:
    out = []
    for label, run in spec.items():
        s, m = run["settings"], run["machine"]
        gpu = ", GPU: " + "; ".join(m["gpus"]) if m.get("gpus") else ", no GPU"
        why = benchlib.stale(run)
        rec = run.get("series") or {}
        out += [
            f"### {label}" + (" (STALE)" if why else ""),
            "",
            *([f"> **Stale:** {why}. These figures do not measure today's series; rerun "
               "`bench/spec_images.py` (see below)."] if why else []),
            *([""] if why else []),
            f"- base: {run.get('base', '–')}; series: `{rec.get('hash', '–')}`"
            + (" (today's)" if not why else ""),
            f"- date: {run['date']}; machine: {m['cores']} cores, {m['cpu']}{gpu}; {m['os']}; "
            f"load average at start {m.get('load_average_at_start')}, at end {m.get('load_average_at_end')}",
            f"- command: `{run['command']}` ({run['wall_s'] / 60:.1f} min)",
            f"- fixture: {s['fixture']['set']} at {s['fixture']['target_params_m']} M parameters "
            f"({s['fixture']['dtype'].upper()}, n_embd {s['fixture']['n_embd']}, {s['fixture']['n_layer']} layers), "
            f"{s['fixture']['draft_layers']}-layer DFlash draft, {s['projector']} projector; "
            f"`-t {s['threads']}{(' ' + ' '.join(s['server_args'])) if s['server_args'] else ''}`, "
            f"`--spec-draft-n-max {s['spec_draft_n_max']}`, {s['n_predict']} tokens per request, "
            f"{s['reps']} repetitions",
            f"- builds: patched `{run['builds']['patched']['version']}`, unpatched `{run['builds']['unpatched']['version']}`",
            "",
            "| build | request | spec tok/s | none tok/s | speed-up | acceptance | mean accepted length | output = none |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for build in ("patched", "unpatched"):
            b = run[build]
            for kind in ("text", "image"):
                tps = b["tokens_per_s"][kind]
                if b[f"{kind}_speedup"] is None:
                    speedup = b[f"{kind}_status"]
                else:
                    lo, hi = b[f"{kind}_speedup_range"]
                    speedup = f"**{b[f'{kind}_speedup']:.2f}×** ({lo:.2f}–{hi:.2f})"
                spec_tps = _spread(tps["spec"]) if tps["spec"] else b.get(f"{kind}_failures", {}).get("spec", "–")
                identical = b.get(f"{kind}_output_identical_to_none")
                out.append(f"| {build} | {kind} | {spec_tps} | {_spread(tps['none'])} | {speedup} | "
                           f"{_fmt(b[f'{kind}_acceptance'])} | {_fmt(b[f'{kind}_mean_accepted_length'])} | "
                           f"{'–' if identical is None else ('yes' if identical else 'NO')} |")
        g = run["goals"]
        out += [
            "",
            f"- patched image speed-up / text speed-up = **{_fmt(g['patched_image_over_text'], 3)}** "
            f"(goal ≥ {g['patched_image_over_text_goal']}: {'met' if g['patched_image_over_text_met'] else 'not met'})",
            f"- patched text speed-up / unpatched text speed-up = **{_fmt(g['patched_text_over_unpatched_text'], 3)}** "
            f"(goal ≥ {g['patched_text_over_unpatched_text_goal']}: "
            f"{'met' if g['patched_text_over_unpatched_text_met'] else 'not met'})",
        ]
        x = run.get("patched_over_unpatched")
        if x:
            pooled = x.get("patched_over_unpatched_text_speedup_pooled")
            out += [
                "- patched / unpatched tokens/s, paired per repetition, median (min–max): "
                + "; ".join(f"{key.replace('_', ' ')} {_spread(x[key], 3)}"
                            for key in ("spec_text", "none_text", "none_image") if x.get(key))
                + ". With `--spec-type none` both builds run the same code, so the none ratios are this "
                "machine's noise floor"
                + (f"; against the two builds' pooled none baseline the text speed-ups are "
                   f"{x['text_speedup_vs_pooled_none']['patched']['median']:.2f}× patched and "
                   f"{x['text_speedup_vs_pooled_none']['unpatched']['median']:.2f}× unpatched "
                   f"(ratio **{pooled:.3f}**)" if pooled else "") + ".",
            ]
        out.append("")
    return "\n".join(out)


def build_cost_tables(cost: dict) -> str:
    out = []
    runs: dict[tuple, list[str]] = {}  # parts measured by the same run share one line
    for part, info in cost.get("runs_by_part", {}).items():
        m = info["machine"]
        key = (info["date"], info["command"], m["cores"], m["cpu"], str(m.get("load_average_at_start")))
        runs.setdefault(key, []).append(part)
    for (date, command, cores, cpu, load), parts in runs.items():
        out.append(f"- {', '.join(parts)}: {date}, `{command}`; {cores} cores, {cpu}, load average at start {load}")
    out.append("")
    if cost.get("cold"):
        out += ["**Cold build, fresh build dir, empty private ccache per run** (seconds, median (min–max)):", "",
                "| targets | reps | `dfbuild build` | `cmake` + `ninja` | dfbuild / cmake | goal ≤ 1.05 |",
                "| --- | --- | --- | --- | --- | --- |"]
        for key, c in cost["cold"].items():
            lo, hi = c["dfbuild_over_cmake_range"]
            out.append(f"| {key} | {c['reps']} | {_spread(c['dfbuild_s'], 1)} | {_spread(c['cmake_ninja_s'], 1)} | "
                       f"**{c['dfbuild_over_cmake']:.3f}** ({lo:.3f}–{hi:.3f}) | {'met' if c['goal_met'] else 'not met'} |")
        out.append("")
    if cost.get("apply"):
        a = cost["apply"]
        out += [f"**Patch series** ({a['concerns']} concerns on {a['base']}, seconds, median (min–max)): "
                f"`dfbuild apply` {_spread(a['apply_s'])}; `dfbuild checkout` back to the base "
                f"{_spread(a['checkout_reset_s'])}; first checkout "
                f"{'(fresh clone from the cache) ' if a['checkout_initial_was_fresh'] else ''}{a['checkout_initial_s']:.2f}.",
                ""]
    if cost.get("rebuild"):
        r = cost["rebuild"]
        i = r["initial_from_shared_ccache"]
        changed = r["changed_patch_runs"][0] if r["changed_patch_runs"] else {}
        touched = r["touch_runs"][0] if r["touch_runs"] else {}
        out += ["**Rebuild of llama-server** (`dfbuild build`, seconds, median (min–max)):", "",
                "| change | wall | notes |", "| --- | --- | --- |",
                f"| new build dir, shared warm ccache | {i['wall_s']:.1f} | {i['compiled_steps']} compile/link steps |",
                f"| nothing | {_spread(r['unchanged_s'])} | no compile, no link |",
                f"| `touch common/speculative.cpp` | {_spread(r['touch_s'])} | "
                f"{touched.get('compiled_steps')} compile/link steps (a ccache hit, then relinks) |",
                *([f"| an edit of it, not committed | {_spread(r['edit_s'])} | "
                   f"{r['edit_runs'][0].get('compiled_steps')} compile/link steps (the file compiles) |"]
                  if r.get("edit_s") else []),
                f"| one patch changed (new code, new commit) | {_spread(r['changed_patch_s'])} | "
                f"{'CMake re-runs (the version stamp changed), ' if changed.get('configured') else ''}"
                f"{changed.get('compiled_steps')} compile/link steps |", ""]
        if r.get("changed_over_edit"):
            ratio = r["changed_over_edit"]
            out += [f"A changed patch over the same edit uncommitted, pairwise: **{ratio['median']:.2f}** "
                    f"({ratio['min']:.2f}–{ratio['max']:.2f}, {ratio['n']} pairs); goal ≤ "
                    f"{r['changed_over_edit_goal']}: {'met' if ratio['max'] <= r['changed_over_edit_goal'] else 'not met'}. "
                    f"Over a touch: {r['changed_over_touch']['median']:.2f} (a touch keeps the bytes, so ccache "
                    "answers its compile).", ""]
    if cost.get("release"):
        rel = cost["release"]
        order = ["checkout", "apply", "build", "smoke", "package"]
        names = sorted(rel["fresh"]["stages"], key=lambda n: order.index(n) if n in order else len(order))
        out += ["**`dfbuild release --base b10359 --backend cpu`** (seconds per stage; fresh work dir with the "
                "shared ccache, then a rerun that resumes):", "",
                "| run | " + " | ".join(names) + " | total |", "| --- |" + " --- |" * (len(names) + 1)]
        for run in ("fresh", "rerun"):
            stages = rel[run]["stages"]
            cells = [f"{stages[n]['wall_s']:.1f}" + (" (reused)" if stages[n].get("reused") else "") for n in names]
            out.append(f"| {run} | " + " | ".join(cells) + f" | {rel[run]['wall_s']:.1f} |")
        out.append("")
    return "\n".join(out)


def targets_cost_table(cost: dict) -> str:
    """bench/targets_cost.py: every tool against llama-server alone, one run side by side."""
    machine = cost.get("machine", {})
    out = [f"- {cost['date']}, `{cost['command']}`; {machine.get('cores')} cores, {machine.get('cpu')}, "
           f"load average at start {machine.get('load_average_at_start')}, at end {machine.get('load_average_at_end')}; "
           f"base {cost['base']}, `--cpu-variants {cost['cpu_variants']}`, ccache {cost['ccache']}",
           "", "| target | ninja steps | compile/link steps | build wall | compile | programs | libraries | "
               "archive | archive files | wheel |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in cost["runs"]:
        out.append(f"| `{run['target']}` | {run['steps']} | {run['compiled_steps']} | {run['build_wall_s']:.0f} s | "
                   f"{run['compile_s']:.0f} s | {run['programs']} | {run['libraries']} | "
                   f"{run['archive_bytes'] / 1e6:.1f} MB | {run['archive_files']} | "
                   + (f"{run['wheel_bytes'] / 1e6:.1f} MB |" if run.get("wheel_bytes") else "- |"))
    ratios = cost["ratios_all_over_server"]
    out.append("| all / llama-server | " + " | ".join(
        _fmt(ratios.get(k), 2, "x") for k in ("steps", "compiled_steps", "build_wall_s", "compile_s")) +
        " | | | " + _fmt(ratios.get("archive_bytes"), 2, "x") + " | " + _fmt(ratios.get("archive_files"), 2, "x") +
        " | " + _fmt(ratios.get("wheel_bytes"), 2, "x") + " |")
    return "\n".join(out) + "\n"


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- BEGIN generated: {name} -->\n).*?(<!-- END generated: {name} -->)", re.S)
    if not pattern.search(text):
        text += f"\n<!-- BEGIN generated: {name} -->\n<!-- END generated: {name} -->\n"
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Redraw speedup.png and RESULTS.md tables from results.json")
    p.add_argument("--results", type=Path, default=benchlib.RESULTS_JSON)
    p.add_argument("--markdown", type=Path, default=RESULTS_MD)
    p.add_argument("--chart", type=Path, default=CHART)
    opts = p.parse_args(argv)
    results = benchlib.load_results(opts.results)
    if not results:
        benchlib.log(f"nothing in {opts.results}: run bench/spec_images.py or bench/build_cost.py first")
        return 2
    text = opts.markdown.read_text(encoding="utf-8") if opts.markdown.exists() else SKELETON
    if results.get("spec_images"):
        draw_chart(results["spec_images"], opts.chart)
        text = replace_block(text, "spec_images", spec_tables(results["spec_images"]))
    if results.get("build_cost"):
        text = replace_block(text, "build_cost", build_cost_tables(results["build_cost"]))
    if results.get("targets_cost"):
        text = replace_block(text, "targets_cost", targets_cost_table(results["targets_cost"]))
    opts.markdown.write_text(text, encoding="utf-8")
    benchlib.log(f"wrote {opts.chart} and the tables in {opts.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
