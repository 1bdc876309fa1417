#!/usr/bin/env python3
"""Does DFlash speculation pay on image requests once the series is applied?

Measures generation tokens/s of llama-server for a text-only request and for a
request with an image, each with `--spec-type draft-dflash` and with
`--spec-type none`, on a PATCHED and an UNPATCHED build. The eight
configurations run interleaved request by request, in a shuffled order per
repetition, against four servers (one per build and mode) that stay up for the
whole run after a warm-up request, so drift on a shared machine hits every
configuration alike. A failed request gets its server restarted. Speed-ups are
paired per repetition (spec / none of the same repetition) and reported as
median and range.

The model is a larger "agree" qwen35 fixture (`--shape small`, the default,
is dfbuild.smoke.fixtures.BENCH_SHAPE: about 160 M parameters, F16, M-RoPE, the
bug's shape; `--shape large` is about 1.3 B for a GPU) with a one-layer DFlash
draft that always agrees, and the 2-D grid projector (qwen2vl_merger) by
default. Acceptance is therefore 100% wherever drafting works: the benchmark
measures what the fix costs or restores, not how good a draft is.

Tokens/s is llama-server's own `timings.predicted_per_second`; acceptance is
`draft_n_accepted / draft_n` from the same timings; mean accepted length is
1 + accepted / verification steps, from the /metrics counters
(`spec_decode_num_drafts_total` counts verification steps) around the request.

One command, CPU, here: the builds are `dfbuild prove`'s work dir for --base (default
b11434) under $DFBUILD_TEST_CACHE/work/BASE, the layout tests/realtrees.py uses;
--build-missing runs that proof first when a build is missing or was made with
another series than today's patches/series.toml:

    python bench/spec_images.py --base b11434 --build-missing --reps 15 --threads 1

On a GPU machine (python3 + numpy + gguf + dfbuild importable; no matplotlib):

    PYTHONPATH=src python bench/spec_images.py --backend cuda --shape large \\
        --build-missing --prove-arg=--cuda-arch=90 \\
        --threads 8 --server-arg="-ngl 99 -ngld 99"

Every result names the series it measured (the hash `dfbuild release` names a
release by, and the base); a patched build of another series than today's is
refused unless --allow-stale, and bench/report.py marks such a result stale.

Results merge into bench/results.json under --label; then, where matplotlib is
installed, `python bench/report.py` (or this script with --plot-only) redraws
bench/speedup.png and the generated tables of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import benchlib
from benchlib import log

from dfbuild import smoke
from dfbuild.core import errors
from dfbuild.smoke import fixtures

BUILDS = ("patched", "unpatched")
MODES = ("spec", "none")
KINDS = ("text", "image")
PROJECTORS = {"grid": "qwen35-grid-plain-agree", "mlp": "qwen35-mlp-plain-agree"}
# "small" suits 2 CPU cores; on a GPU a 160 M model decodes in about a millisecond a token,
# so launch and HTTP overheads would hide what speculation saves: "large" is ~1.3 B (2.6 GB F16).
SHAPES = {
    "small": fixtures.BENCH_SHAPE,
    "large": replace(fixtures.BENCH_SHAPE, n_embd=2048, n_head=16, n_head_kv=4, n_ff=6144, n_layer=24,
                     ssm_groups=8, ssm_dt_rank=16, draft_target_layers=(1, 12, 22)),
}

TEXT_PROMPT = "USER: tell me a long story about a quick brown fox and a lazy dog.\nASSISTANT: once upon a time"
# text after the image: a prompt that ends with an image aborts upstream servers
IMAGE_PROMPT = "USER: look here {media}\nwhat is in the picture? tell me a long story.\nASSISTANT: it shows"
WARMUP_PREDICT = 8
SEED = 42

# goals the product aims at (issue 8)
GOAL_IMAGE_OVER_TEXT = 0.95
GOAL_PATCHED_OVER_UNPATCHED = 0.98


def work_dir(base: str) -> Path:
    """`dfbuild prove`'s work dir for BASE, where tests/realtrees.py keeps it."""
    return benchlib.TEST_CACHE / "work" / base


def default_build(name: str, base: str, backend: str) -> Path:
    """prove's layout: the patched build in WORK/build-<backend>, the unpatched one in WORK/unpatched/."""
    work = work_dir(base)
    return work / f"build-{backend}" if name == "patched" else work / "unpatched" / f"build-{backend}"


def prove_builds(opts) -> int:
    """Build BASE unpatched and with today's series through `dfbuild prove` (one cold build, then
    the patched one incrementally; a rerun rebuilds only what a changed series touches), with one
    image scenario as its smoke: the bench then measures what `dfbuild release` would ship."""
    cmd = [sys.executable, "-m", "dfbuild", "prove", "--base", opts.base, "--work", str(work_dir(opts.base)),
           "--backend", opts.backend, "--scenario", "image", "--set", PROJECTORS["grid"], *opts.prove_args]
    log("building: " + shlex.join(cmd))
    started = time.monotonic()
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    log(f"dfbuild prove exited {rc} after {time.monotonic() - started:.0f} s")
    return rc


def server_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = [l for l in (out.stdout + out.stderr).splitlines() if l.startswith("version:")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"


# --- fixtures -------------------------------------------------------------------------


def ensure_bench_fixtures(directory: Path, shape: fixtures.Shape) -> dict:
    """Reuse the bench fixtures in DIRECTORY when they match SHAPE and are intact."""
    wanted = shape.to_dict()
    try:
        section = fixtures.load_fixtures(directory)
        intact = section.get("shape") == wanted and fixtures.files_intact(section)
        if intact:
            return section
    except errors.FixtureError:
        pass
    log(f"writing the bench fixtures ({shape.target_params() / 1e6:.0f} M-parameter target) into {directory}")
    return fixtures.write_bench_fixtures(directory, shape=shape)


# --- one measurement ------------------------------------------------------------------


def server_args(fixture_set: dict, mode: str, opts) -> list[str]:
    args = ["-m", fixture_set["target"], "--mmproj", fixture_set["mmproj"], "-c", str(opts.ctx), "-np", "1",
            "-t", str(opts.threads), "--metrics", "--no-webui"]
    if mode == "spec":
        args += ["-md", fixture_set["draft"], "--spec-type", "draft-dflash",
                 "--spec-draft-n-max", str(opts.spec_draft_n_max)]
    else:
        args += ["--spec-type", "none"]
    return args + opts.extra_server_args


def payload(kind: str, marker: str, image: Path, n_predict: int) -> dict:
    if kind == "image":
        prompt: object = {"prompt_string": IMAGE_PROMPT.replace("{media}", marker),
                          "multimodal_data": [base64.b64encode(image.read_bytes()).decode()]}
    else:
        prompt = TEXT_PROMPT
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": SEED,
            "cache_prompt": False, "ignore_eos": True}


def counters(server: smoke.LlamaServer) -> dict[str, float]:
    try:
        resp = server.request("GET", "/metrics", timeout=30)
    except OSError:
        return {}
    return smoke.prometheus_counters(resp.text) if resp.status == 200 else {}


class BenchServer:
    """One llama-server per (build, mode), kept up for the whole run and warmed up once.

    Idle servers wait on a condition variable, so the four of them can stay up
    and the requests interleave within seconds of each other. A request that
    fails (the unpatched image case) gets its server restarted, so the next
    request starts from a clean server as every other one does.
    """

    def __init__(self, binary: Path, args: list[str], log_dir: Path, name: str, opts, image: Path):
        self.binary, self.args, self.log_dir, self.name, self.opts, self.image = binary, args, log_dir, name, opts, image
        self.server: smoke.LlamaServer | None = None
        self.marker = "<__media__>"
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log_path = self.log_dir / f"{self.name}-{self.starts}.log"
        self.server = smoke.LlamaServer(self.binary, self.args, log_path, start_timeout=self.opts.start_timeout)
        self.server.start()
        props = self.server.request("GET", "/props", timeout=60).body or {}
        self.marker = props.get("media_marker", self.marker)
        warm = self.server.request("POST", "/completion", payload("text", self.marker, self.image, WARMUP_PREDICT),
                                   timeout=self.opts.request_timeout)
        if warm.error:
            raise SystemExit(f"{self.name}: the warm-up text request failed: {warm.error}; log {log_path}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def measure(self, build: str, mode: str, kind: str, rep: int) -> dict:
        """One measured request; the server's own figures, the draft counters around it, its log lines."""
        server = self.server
        record = {"rep": rep, "build": build, "mode": mode, "kind": kind, "log": str(server.log_path)}
        offset = server.log_size()
        before = counters(server)
        started = time.monotonic()
        try:
            resp = server.request("POST", "/completion", payload(kind, self.marker, self.image, self.opts.n_predict),
                                  timeout=self.opts.request_timeout)
            error, status, timings, content = resp.error, resp.status, resp.timings, resp.content
        except OSError as exc:  # the server died under the request
            error, status, timings, content = f"no response: {exc}", None, {}, None
        record["wall_s"] = round(time.monotonic() - started, 3)
        after = counters(server) if server.alive() else {}
        findings = smoke.scan_log(server.log_text(offset))

        def delta(name: str) -> float | None:
            return after[name] - before.get(name, 0.0) if name in after else None

        record.update({
            "status": status,
            "error": error,
            "content_sha256": hashlib.sha256(content.encode()).hexdigest()[:16] if content is not None else None,
            "predicted_n": timings.get("predicted_n"),
            "predicted_ms": timings.get("predicted_ms"),
            "tokens_per_s": timings.get("predicted_per_second") if not error else None,
            "prompt_n": timings.get("prompt_n"),
            "draft_n": timings.get("draft_n", 0),
            "draft_n_accepted": timings.get("draft_n_accepted", 0),
            "verification_steps": delta("spec_decode_num_drafts_total"),
            "metrics_accepted": delta("spec_decode_num_accepted_tokens_total"),
            "log_findings": [f["pattern"] for f in findings][:5],
        })
        if error or not server.alive():
            self.stop()
            self.start()
        return record


# --- summary --------------------------------------------------------------------------


def describe_failure(records: list[dict]) -> str:
    statuses = sorted({r["status"] for r in records if r["error"]}, key=str)
    if statuses and all(s is not None for s in statuses):
        return "fails (HTTP " + "/".join(str(s) for s in statuses) + ")"
    return "fails (" + (records[0]["error"] or "?")[:60] + ")"


def summarize_build(records: list[dict], build: str) -> dict:
    mine = [r for r in records if r["build"] == build]
    out: dict = {"tokens_per_s": {}}
    reps = sorted({r["rep"] for r in mine})
    for kind in KINDS:
        by_mode = {mode: {r["rep"]: r for r in mine if r["kind"] == kind and r["mode"] == mode} for mode in MODES}
        out["tokens_per_s"][kind] = {mode: benchlib.summary([r["tokens_per_s"] for r in by_mode[mode].values()])
                                     for mode in MODES}
        failed = [r for mode in MODES for r in by_mode[mode].values() if r["error"]]
        ratios = [by_mode["spec"][rep]["tokens_per_s"] / by_mode["none"][rep]["tokens_per_s"]
                  for rep in reps
                  if rep in by_mode["spec"] and rep in by_mode["none"]
                  and by_mode["spec"][rep]["tokens_per_s"] and by_mode["none"][rep]["tokens_per_s"]]
        stats = benchlib.summary(ratios)
        out[f"{kind}_speedup"] = stats["median"] if stats else None
        out[f"{kind}_speedup_range"] = [stats["min"], stats["max"]] if stats else None
        out[f"{kind}_status"] = "ok" if not failed else describe_failure(failed)
        if failed:
            out[f"{kind}_failures"] = {f"{r['mode']}": describe_failure([r]) for r in failed}
        spec = [r for r in by_mode["spec"].values() if not r["error"]]
        drafted = sum(r["draft_n"] for r in spec)
        accepted = sum(r["draft_n_accepted"] for r in spec)
        steps = sum(r["verification_steps"] or 0 for r in spec)
        out[f"{kind}_acceptance"] = round(accepted / drafted, 4) if drafted else None
        out[f"{kind}_mean_accepted_length"] = round(1 + accepted / steps, 3) if steps else None
        # greedy decoding: the draft must not change the output
        pairs = [(by_mode["spec"][rep], by_mode["none"][rep]) for rep in reps
                 if rep in by_mode["spec"] and rep in by_mode["none"]]
        same = [s["content_sha256"] == n["content_sha256"] for s, n in pairs if not s["error"] and not n["error"]]
        out[f"{kind}_output_identical_to_none"] = all(same) if same else None
    spec = [r for r in mine if r["mode"] == "spec" and not r["error"]]
    drafted = sum(r["draft_n"] for r in spec)
    accepted = sum(r["draft_n_accepted"] for r in spec)
    steps = sum(r["verification_steps"] or 0 for r in spec)
    out["acceptance"] = round(accepted / drafted, 4) if drafted else None
    out["mean_accepted_length"] = round(1 + accepted / steps, 3) if steps else None
    return out


def cross_build(records: list[dict]) -> dict:
    """Patched / unpatched tokens/s, paired per repetition, for each (mode, kind).

    With `--spec-type none` both builds run the same code (the series only
    touches common/speculative.cpp), so the none ratios show the noise floor of
    this machine; the text speed-up against the two builds' pooled none baseline
    compares the speculative paths alone.
    """
    def by_rep(build, mode, kind):
        return {r["rep"]: r["tokens_per_s"] for r in records
                if r["build"] == build and r["mode"] == mode and r["kind"] == kind and r["tokens_per_s"]}

    out = {}
    for mode in MODES:
        for kind in KINDS:
            p, u = by_rep("patched", mode, kind), by_rep("unpatched", mode, kind)
            out[f"{mode}_{kind}"] = benchlib.summary([p[rep] / u[rep] for rep in p if rep in u])
    pooled = {}
    none_p, none_u = by_rep("patched", "none", "text"), by_rep("unpatched", "none", "text")
    for build in BUILDS:
        spec = by_rep(build, "spec", "text")
        pooled[build] = benchlib.summary([spec[rep] / ((none_p[rep] + none_u[rep]) / 2)
                                          for rep in spec if rep in none_p and rep in none_u])
    out["text_speedup_vs_pooled_none"] = pooled
    if pooled["patched"] and pooled["unpatched"]:
        out["patched_over_unpatched_text_speedup_pooled"] = round(
            pooled["patched"]["median"] / pooled["unpatched"]["median"], 4)
    return out


def goals(patched: dict, unpatched: dict) -> dict:
    def ratio(a, b):
        return round(a / b, 4) if a is not None and b else None

    image_over_text = ratio(patched.get("image_speedup"), patched.get("text_speedup"))
    text_vs_unpatched = ratio(patched.get("text_speedup"), unpatched.get("text_speedup"))
    return {
        "patched_image_over_text": image_over_text,
        "patched_image_over_text_goal": GOAL_IMAGE_OVER_TEXT,
        "patched_image_over_text_met": image_over_text is not None and image_over_text >= GOAL_IMAGE_OVER_TEXT,
        "patched_text_over_unpatched_text": text_vs_unpatched,
        "patched_text_over_unpatched_text_goal": GOAL_PATCHED_OVER_UNPATCHED,
        "patched_text_over_unpatched_text_met": (text_vs_unpatched is not None
                                                 and text_vs_unpatched >= GOAL_PATCHED_OVER_UNPATCHED),
    }


def _cell(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(section: dict) -> None:
    print(f"\n{section['label']}: {section['settings']['fixture']['target_params_m']} M-param qwen35 target, "
          f"{section['settings']['projector']} projector, -t {section['settings']['threads']}, "
          f"n_max {section['settings']['spec_draft_n_max']}, {section['settings']['reps']} reps")
    rec = section["series"]
    print(f"base {section['base']}, series {rec['hash']}"
          + ("" if rec["current"] else f" (NOT today's: {rec.get('why') or 'cannot be told'})"))
    print(f"{'build':10} {'kind':6} {'spec tok/s':>11} {'none tok/s':>11} {'speed-up':>9} {'range':>13} "
          f"{'accept':>7} {'mean len':>8}")
    for build in BUILDS:
        b = section[build]
        for kind in KINDS:
            tps = b["tokens_per_s"][kind]
            spec = tps["spec"]["median"] if tps["spec"] else None
            none = tps["none"]["median"] if tps["none"] else None
            if b[f"{kind}_speedup"] is None:
                speedup, spread = b[f"{kind}_status"], ""
            else:
                speedup = f"{b[f'{kind}_speedup']:.2f}x"
                lo, hi = b[f"{kind}_speedup_range"]
                spread = f"{lo:.2f}-{hi:.2f}"
            print(f"{build:10} {kind:6} {_cell(spec):>11} {_cell(none):>11} {speedup:>9} {spread:>13} "
                  f"{_cell(b[f'{kind}_acceptance']):>7} {_cell(b[f'{kind}_mean_accepted_length']):>8}")
    x = section["patched_over_unpatched"]
    print("patched / unpatched tokens/s, paired: " + ", ".join(
        f"{key} {x[key]['median']:.3f}" for key in ("spec_text", "none_text", "none_image") if x.get(key))
        + " (none runs the same code in both builds: its ratio is the noise floor)")
    g = section["goals"]
    print(f"patched image/text speed-up: {g['patched_image_over_text']} (goal >= {GOAL_IMAGE_OVER_TEXT}: "
          f"{'met' if g['patched_image_over_text_met'] else 'NOT met'})")
    print(f"patched/unpatched text speed-up: {g['patched_text_over_unpatched_text']} "
          f"(goal >= {GOAL_PATCHED_OVER_UNPATCHED}: {'met' if g['patched_text_over_unpatched_text_met'] else 'NOT met'})")


# --- driver ---------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="b11434", help="the base measured (default b11434): picks the default builds")
    p.add_argument("--backend", default="cpu", help="backend of the default builds (build-<backend>; default cpu)")
    p.add_argument("--patched-build", type=Path, default=None,
                   help="build dir of the patched tree (default: $DFBUILD_TEST_CACHE/work/BASE/build-BACKEND)")
    p.add_argument("--unpatched-build", type=Path, default=None,
                   help="build dir of the unpatched tree (default: $DFBUILD_TEST_CACHE/work/BASE/unpatched/build-BACKEND)")
    p.add_argument("--build-missing", action="store_true",
                   help="run `dfbuild prove --base BASE` on the default work dir first when a default build is "
                        "missing or its series is not today's (shared ccache; $DFBUILD_CMAKE_ARGS applies)")
    p.add_argument("--prove-arg", dest="prove_args", action="append", default=[],
                   help="extra `dfbuild prove` argument for --build-missing (repeatable), e.g. --prove-arg=--cuda-arch=90")
    p.add_argument("--allow-stale", action="store_true",
                   help="measure a patched build of another series than today's (the result is marked stale)")
    p.add_argument("--label", default=None, help="label the results go under (default: the backend)")
    p.add_argument("--threads", "-t", type=int, default=2, help="llama-server -t (default 2)")
    p.add_argument("--server-arg", action="append", default=[],
                   help='extra llama-server arguments, split like a shell line; repeatable, '
                        'e.g. --server-arg="-ngl 99 -ngld 99"')
    p.add_argument("--spec-draft-n-max", type=int, default=3, help="--spec-draft-n-max (default 3)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the eight configurations (default 3)")
    p.add_argument("--n-predict", type=int, default=128, help="tokens generated per measured request")
    p.add_argument("--projector", choices=sorted(PROJECTORS), default="grid",
                   help="grid = qwen2vl_merger (2-D grid, the real bug's shape; default) or mlp")
    p.add_argument("--ctx", type=int, default=4096, help="llama-server -c")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small",
                   help="target size: small (~160 M, CPU; default) or large (~1.3 B, for a GPU)")
    p.add_argument("--fixtures", type=Path, default=None,
                   help="where the bench fixtures are written and reused (default: a cache dir per shape)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: FIXTURES/../logs-LABEL)")
    p.add_argument("--results", type=Path, default=benchlib.RESULTS_JSON, help="results.json to merge into")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--shuffle-seed", type=int, default=0, help="seed of the per-repetition order")
    p.add_argument("--plot-only", action="store_true",
                   help="only redraw speedup.png and RESULTS.md tables from results.json (needs matplotlib)")
    opts = p.parse_args(argv)
    opts.extra_server_args = [a for chunk in opts.server_arg for a in shlex.split(chunk)]
    opts.label = opts.label or opts.backend
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.plot_only:
        import report

        return report.main([])

    builds = {name: (given or default_build(name, opts.base, opts.backend)).resolve()
              for name, given in (("patched", opts.patched_build), ("unpatched", opts.unpatched_build))}
    if opts.build_missing and (opts.patched_build is None or opts.unpatched_build is None):
        missing = [n for n, d in builds.items() if not smoke.server_binary(d).is_file()]
        if missing or not smoke.server_binary(builds["patched"]).is_file() \
                or benchlib.series_record(builds["patched"]).get("current") is not True:
            prove_builds(opts)  # its verdict is not the bench's business: the checks below decide
    for name, build_dir in builds.items():
        if not smoke.server_binary(build_dir).is_file():
            log(f"no llama-server in {build_dir}: pass --{name}-build, or --build-missing for the default work dir")
            return 2
    binaries = {name: smoke.server_binary(d) for name, d in builds.items()}
    measured_series = benchlib.series_record(builds["patched"])
    if measured_series["current"] is not True:
        why = measured_series.get("why") or "today's series.toml gives no hash for its base"
        if measured_series["current"] is False and not opts.allow_stale:
            log(f"the patched build {builds['patched']} is not today's series: {why}; rebuild it "
                "(--build-missing) or pass --allow-stale to measure it anyway (marked stale)")
            return 2
        log(f"warning: the measured series cannot be told current: {why}")
    if measured_series["base"] and measured_series["base"] != opts.base:
        log(f"warning: the patched build is of {measured_series['base']}, not --base {opts.base}")

    fixtures_dir = opts.fixtures or benchlib.DEFAULT_CACHE / f"fixtures-{opts.shape}"
    fx = ensure_bench_fixtures(fixtures_dir, SHAPES[opts.shape])
    fixture_set = fx["sets"][PROJECTORS[opts.projector]]
    image = Path(fx["images"]["small"])
    log_dir = opts.log_dir or fixtures_dir.parent / f"logs-{opts.label}"
    log_dir.mkdir(parents=True, exist_ok=True)

    machine = benchlib.machine_info()
    started = time.monotonic()
    servers = {(b, m): BenchServer(binaries[b], server_args(fixture_set, m, opts), log_dir, f"{b}-{m}", opts, image)
               for b in BUILDS for m in MODES}
    configs = [(b, m, k) for b in BUILDS for m in MODES for k in KINDS]
    records = []
    try:
        for server in servers.values():
            server.start()
        for rep in range(opts.reps):
            order = configs[:]
            random.Random(opts.shuffle_seed * 1000 + rep).shuffle(order)
            for build, mode, kind in order:
                record = servers[(build, mode)].measure(build, mode, kind, rep)
                records.append(record)
                shown = f"{record['tokens_per_s']:.2f} tok/s" if record["tokens_per_s"] else record["error"][:80]
                extra = f", accepted {record['draft_n_accepted']}/{record['draft_n']}" if mode == "spec" else ""
                log(f"rep {rep + 1}/{opts.reps} {build:9} {mode:4} {kind:5}: {shown}{extra}")
    finally:
        for server in servers.values():
            server.stop()

    patched, unpatched = summarize_build(records, "patched"), summarize_build(records, "unpatched")
    machine["load_average_at_end"] = benchlib.load_average()
    shape = fx["shape"]
    section = {
        "label": opts.label,
        "date": benchlib.now_iso(),
        "command": benchlib.command_line(),
        "machine": machine,
        "wall_s": round(time.monotonic() - started, 1),
        "settings": {
            "threads": opts.threads,
            "server_args": opts.extra_server_args,
            "spec_draft_n_max": opts.spec_draft_n_max,
            "reps": opts.reps,
            "n_predict": opts.n_predict,
            "projector": {"grid": "qwen2vl_merger", "mlp": "mlp"}[opts.projector],
            "fixture": {"set": PROJECTORS[opts.projector], "shape": opts.shape, "target_params_m": round(fx["target_params"] / 1e6, 1),
                        "dtype": shape["dtype"], "n_embd": shape["n_embd"], "n_layer": shape["n_layer"],
                        "n_ff": shape["n_ff"], "draft_layers": shape["draft_layers"]},
        },
        "base": measured_series["base"] or opts.base,
        "series": measured_series,
        "build_flags_env": os.environ.get("DFBUILD_CMAKE_ARGS") or None,
        "builds": {name: {"dir": str(d), "version": server_version(binaries[name])} for name, d in builds.items()},
        "patched": patched,
        "unpatched": unpatched,
        "goals": goals(patched, unpatched),
        "patched_over_unpatched": cross_build(records),
        "runs": records,
    }
    benchlib.merge_results("spec_images", opts.label, section, opts.results)
    print_table(section)
    log(f"\nmerged into {opts.results} under spec_images.{opts.label}; "
        "redraw the chart and RESULTS.md tables with: python bench/report.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
