"""The smoke driver: each scenario on each fixture set, speculative and plain, on a fresh llama-server."""

from __future__ import annotations

import base64
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

from dfbuild.core import errors
from dfbuild.smoke import fixtures
from dfbuild.smoke.client import prometheus_counters
from dfbuild.smoke.judge import EXACT, N_PROBS, _excerpt, judge, upstream_symptom
from dfbuild.smoke.logscan import begin_warnings, draft_trace, scan_log, warned_fill_spans, zero_filled_spans
from dfbuild.smoke.scenarios import (
    DEFAULT_SCENARIOS,
    DEFAULT_SETS,
    N_PREDICT,
    SCENARIOS,
    SEED,
    SLOT_FILE,
    Scenario,
    Step,
    _merge_args,
    base_server_args,
)
from dfbuild.smoke.server import DEFAULT_REQUEST_TIMEOUT, DEFAULT_START_TIMEOUT, LlamaServer, server_binary


def _payload(step: Step, marker: str, images: dict[str, str], n_probs: int = 0) -> dict:
    prompt_text = step.text.replace("{media}", marker)
    prompt: object = prompt_text
    if step.images:
        prompt = {"prompt_string": prompt_text,
                  "multimodal_data": [base64.b64encode(Path(images[i]).read_bytes()).decode() for i in step.images]}
    if step.endpoint.startswith("/slots/"):
        return {"filename": SLOT_FILE}  # save and restore name the file; erase ignores it
    if step.endpoint != "/completion":
        return {"input": prompt}
    payload = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "top_k": 1, "seed": SEED,
               "cache_prompt": True, "ignore_eos": True, "stream": step.stream}
    if n_probs:
        # the pre-sampling top candidates of each generated token (the plain run's,
        # for the near-tie identity rule); it does not change what is generated
        payload["n_probs"] = n_probs
    return payload


def _metrics(server: LlamaServer) -> dict[str, float]:
    try:
        resp = server.request("GET", "/metrics", timeout=10)
    except OSError:
        return {}
    return prometheus_counters(resp.text) if resp.status == 200 else {}


DRAFTED = "spec_decode_num_draft_tokens_total"
ACCEPTED = "spec_decode_num_accepted_tokens_total"


def _compact_probs(entries: list[dict]) -> list[dict]:
    """Each generated token's bytes and its top candidates' (bytes, logprob), nothing else."""
    def piece(entry: dict) -> list[int]:
        raw = entry.get("bytes")
        return list(raw) if isinstance(raw, list) else list(str(entry.get("token", "")).encode())

    def logprob(entry: dict) -> float:
        if "logprob" in entry:
            return float(entry["logprob"])
        prob = float(entry.get("prob", 0.0))  # post-sampling form
        return math.log(prob) if prob > 0 else -math.inf

    return [{"bytes": piece(e),
             "top": [[piece(c), logprob(c)] for c in (e.get("top_logprobs") or e.get("top_probs") or [])]}
            for e in entries]


def _run_step(server: LlamaServer, step: Step, marker: str, images: dict[str, str], n_probs: int = 0) -> dict:
    log_offset = server.log_size()
    started = time.monotonic()
    try:
        resp = server.request("POST", step.endpoint, _payload(step, marker, images, n_probs))
        error = resp.error
    except OSError as exc:  # connection reset: the server died under the request
        resp, error = None, f"no response: {exc}"
    timings = resp.timings if resp else {}
    extra = {"probs": _compact_probs(resp.probabilities) if resp else []} if n_probs else {}
    return {
        **extra,
        "label": step.label,
        "image": step.has_image,
        "generates": step.endpoint == "/completion",
        "stream": step.stream,
        "status": resp.status if resp else None,
        "error": error,
        "content": resp.content if resp else None,
        "draft_n": int(timings.get("draft_n", 0)),
        "draft_n_accepted": int(timings.get("draft_n_accepted", 0)),
        "wall_s": round(time.monotonic() - started, 3),
        "log_offset": log_offset,
    }


def run_steps(server: LlamaServer, steps: tuple[Step, ...], images: dict[str, str], n_probs: int = 0) -> list[dict]:
    """Send the steps in order (a parallel group at once), reading the draft counters around each."""
    props = server.request("GET", "/props", timeout=30)
    marker = (props.body or {}).get("media_marker", "<__media__>")
    results: list[dict] = []
    i = 0
    while i < len(steps):
        group = [steps[i]]
        while (steps[i].parallel_group is not None and i + len(group) < len(steps)
               and steps[i + len(group)].parallel_group == steps[i].parallel_group):
            group.append(steps[i + len(group)])
        before = _metrics(server)
        outcomes: list[Any]
        if len(group) == 1:
            outcomes = [_run_step(server, group[0], marker, images, n_probs)]
        else:
            outcomes = [None] * len(group)  # each filled by its thread

            def worker(k: int) -> None:
                # run and joined within this iteration: the loop's names are the ones meant
                outcomes[k] = _run_step(server, group[k], marker, images, n_probs)  # noqa: B023

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(group))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        after = _metrics(server)
        for outcome in outcomes:
            outcome["metrics_drafted_before"] = before.get(DRAFTED)
            outcome["metrics_accepted_before"] = before.get(ACCEPTED)
            outcome["metrics_drafted_after"] = after.get(DRAFTED)
            outcome["metrics_accepted_after"] = after.get(ACCEPTED)
        results.extend(outcomes)
        i += len(group)
    return results


# --- driver -----------------------------------------------------------------------------


def _run_server_scenario(binary: Path, args: list[str], log_path: Path, scenario: Scenario,
                         images: dict[str, str], env: dict | None, *, start_timeout: float = DEFAULT_START_TIMEOUT,
                         n_probs: int = 0) -> tuple[list[dict], bool, str]:
    # a device slow to start is slow to answer too (its first request compiles shaders)
    request_timeout = max(DEFAULT_REQUEST_TIMEOUT, start_timeout)
    with LlamaServer(binary, args, log_path, env=env, start_timeout=start_timeout,
                     request_timeout=request_timeout) as server:
        steps = run_steps(server, scenario.steps, images, n_probs)
        alive = server.alive()
        if alive:
            try:  # a server that still answers is alive, not merely not yet reaped
                alive = server.request("GET", "/health", timeout=10).status == 200
            except OSError:
                alive = False
    return steps, alive, log_path.read_text(encoding="utf-8", errors="replace")


def _slot_args(scenario: Scenario, folder: Path) -> list[str]:
    """--slot-save-path FOLDER (made here: llama-server takes only a folder that exists) for a
    scenario with slot actions; nothing for the others."""
    if not scenario.slot_save:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    return ["--slot-save-path", str(folder)]


def run_scenario(binary: Path, fixture_set_name: str, fixture_set: dict, scenario: Scenario, images: dict[str, str],
                 log_dir: Path, *, extra_server_args=(), env=None, compare_no_spec: bool = True,
                 baseline_cache: dict | None = None, start_timeout: float = DEFAULT_START_TIMEOUT,
                 identity: dict | None = None) -> dict:
    """One scenario on one fixture set: the speculative run, then (unless cached) the plain one.

    The plain run does not involve the draft, so sets that share a target and an
    mmproj share it: `baseline_cache` keeps it per (target, mmproj, scenario, args).
    """
    started = time.monotonic()
    spec_args = _merge_args(base_server_args(fixture_set, speculative=True),
                            [*scenario.server_args, *extra_server_args,
                             *_slot_args(scenario, log_dir / f"{scenario.name}--{fixture_set_name}--spec-slots")])
    spec_log = log_dir / f"{scenario.name}--{fixture_set_name}--spec.log"
    identity = identity or EXACT
    spec_steps, alive, log_text = _run_server_scenario(binary, spec_args, spec_log, scenario, images, env,
                                                       start_timeout=start_timeout)
    findings = scan_log(log_text)

    base_steps = None
    if compare_no_spec:
        # one slot folder for every set's plain run: sets that share a target share that run
        base_args = _merge_args(base_server_args(fixture_set, speculative=False),
                                [*scenario.server_args, *extra_server_args,
                                 *_slot_args(scenario, log_dir / f"{scenario.name}--nospec-slots")])
        key = (scenario.name, *base_args)
        cache = baseline_cache if baseline_cache is not None else {}
        if key not in cache:
            base_log = log_dir / f"{scenario.name}--{fixture_set_name}--nospec.log"
            n_probs = N_PROBS if identity["rule"] == "near-tie" else 0
            cache[key] = _run_server_scenario(binary, base_args, base_log, scenario, images, env,
                                              start_timeout=start_timeout, n_probs=n_probs)[0]
        base_steps = cache[key]

    result = judge(fixture_set, spec_steps, base_steps, alive=alive, log_findings=findings, identity=identity)
    fills, warned = zero_filled_spans(log_text), warned_fill_spans(log_text)
    spans = fills if scenario.linear_images_only else []
    # every fill warns (issue 44): the draft goes on without that context, an image's or a restored prefix's
    quiet = [span for span in fills if span not in warned]
    if quiet:
        result["passed"] = False
        result["failures"].append("draft positions the draft never processed were zero-filled without a warning: "
                                  + ", ".join(f"[{a}, {b})" for a, b in quiet))
    if scenario.expect_log and not re.search(scenario.expect_log, log_text):
        result["passed"] = False
        result["failures"].append(f"the scenario did not reach its case: no log line matches {scenario.expect_log!r}")
    if spans:
        result["passed"] = False
        result["failures"].append("image rows with linear positions reached the draft as zero-fill, not the "
                                  "target's features: draft positions " + ", ".join(f"[{a}, {b})" for a, b in spans))
    result.update({
        "zero_filled": [list(span) for span in spans],
        # every zero-filled span and how it was logged (warn; debug only from a series before issue 44)
        "fills": [[a, b, "warn" if (a, b) in warned else "debug"] for a, b in fills],
        **({"draft_trace": draft_trace(log_text)} if scenario.unpatched == "same" else {}),
        # begin()'s warning, recorded and never judged: (draft pos_max, N-1) of each (issue 29)
        "begin_warnings": [list(w) for w in begin_warnings(log_text)],
        "set": fixture_set_name,
        "scenario": scenario.name,
        "failure_excerpt": _excerpt(log_text, findings, spec_steps) if not result["passed"] else "",
        "upstream_symptom": None,
        "log_findings": findings[:20],
        "requests": [{k: v for k, v in s.items() if k != "log_offset"} for s in spec_steps],
        "log": str(spec_log),
        "server_args": spec_args,
        "wall_s": round(time.monotonic() - started, 2),
    })
    result["upstream_symptom"] = upstream_symptom(result)
    return result


def run_smoke(build_dir: Path, fixtures_dir: Path, *, sets=None, scenarios=None, log_dir=None,
              extra_server_args=(), env=None, compare_no_spec: bool = True, on_result=None,
              start_timeout: float | None = None, identity: dict | None = None, table: str | None = None,
              device: str | None = None, ran_on: str | None = None, cpu_fallback: bool = False) -> dict:
    """Run every scenario on every fixture set; return the smoke section.

    Fixtures are written into `fixtures_dir` when it has none. `on_result` is
    called with each scenario result as it lands (progress for the CLI).
    `plan(...).run_kwargs()` gives the backend's settings (server arguments,
    environment, start timeout, identity rule, table and the device it chose by).
    """
    start_timeout = float(start_timeout or DEFAULT_START_TIMEOUT)
    identity = identity or EXACT
    started = time.monotonic()
    binary = server_binary(build_dir)
    if not binary.is_file():
        raise errors.ServerStartError(f"no llama-server at {binary}",
                                      hint="build it first (`dfbuild build`) or pass the right --build-dir")
    section_fixtures = fixtures.ensure_fixtures(Path(fixtures_dir))
    set_names = list(sets or DEFAULT_SETS)
    scenario_names = list(scenarios or DEFAULT_SCENARIOS)
    for name in set_names:
        if name not in section_fixtures["sets"]:
            raise errors.FixtureError(f"unknown fixture set {name!r}",
                                      hint="choose from: " + ", ".join(section_fixtures["sets"]))
    for name in scenario_names:
        if name not in SCENARIOS:
            raise errors.SmokeFailedError(f"unknown scenario {name!r}", hint="choose from: " + ", ".join(SCENARIOS))
    log_dir = Path(log_dir) if log_dir else Path(fixtures_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, dict]] = {}
    baseline_cache: dict = {}
    for scenario_name in scenario_names:
        for set_name in set_names:
            if not SCENARIOS[scenario_name].runs_on(section_fixtures["sets"][set_name]):
                continue  # e.g. linear-image on an M-RoPE set, whose pinned images are zero-filled by design
            result = run_scenario(binary, set_name, section_fixtures["sets"][set_name], SCENARIOS[scenario_name],
                                  section_fixtures["images"], log_dir, extra_server_args=extra_server_args, env=env,
                                  compare_no_spec=compare_no_spec, baseline_cache=baseline_cache,
                                  start_timeout=start_timeout, identity=identity)
            results.setdefault(scenario_name, {})[set_name] = result
            if on_result:
                on_result(result)

    failed = [f"{sc}/{st}" for sc, by_set in results.items() for st, r in by_set.items() if not r["passed"]]
    return {
        "build_dir": str(build_dir),
        "server": str(binary),
        "fixtures_dir": str(fixtures_dir),
        "log_dir": str(log_dir),
        "sets": set_names,
        "scenarios": scenario_names,
        "table": table or ("full" if sets is None and scenarios is None else "custom"),
        "device": device,
        "ran_on": ran_on or device or "the CPU backend",   # in words: what verify and the release notes show
        "cpu_fallback": bool(cpu_fallback),                # a GPU backend run on the CPU, because the user asked
        "identity": identity,
        "start_timeout_s": start_timeout,
        "results": results,
        "failed": failed,
        "passed": not failed,
        "wall_s": round(time.monotonic() - started, 1),
    }


def fixtures_that_do_not_load(binary: Path, fixtures_section: dict, log_dir: Path, *, sets=None,
                              env: dict | None = None, extra_server_args: tuple[str, ...] = (),
                              start_timeout: float | None = None) -> dict[str, str]:
    """Every fixture set, started in BINARY's llama-server with its draft: {set: why} for those that fail.

    A set loads when the server becomes healthy with the mmproj (a media marker)
    and the DFlash draft set up, and answers a plain text completion. A proof
    that some set cannot load in is no proof (a loader that refuses a fixture
    fails every scenario of it, patched or not), so `prove` runs this first.
    """
    problems: dict[str, str] = {}
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    for name in sorted(sets or fixtures_section["sets"]):
        entry = fixtures_section["sets"][name]
        args = _merge_args(base_server_args(entry, speculative=True), extra_server_args)
        timeout: dict[str, Any] = {"start_timeout": start_timeout} if start_timeout else {}
        try:
            with LlamaServer(binary, args, Path(log_dir) / f"load-{name}.log", env=env, **timeout) as server:
                props = server.request("GET", "/props").body or {}
                text = server.request("POST", "/completion", {"prompt": "hello there", "n_predict": 4,
                                                              "temperature": 0})
                log = server.log_text()
        except errors.DfbuildError as exc:  # did not start, or died: the log says why
            problems[name] = exc.message
            continue
        if not props.get("media_marker"):
            problems[name] = "no media marker (the mmproj did not load)"
        elif "adding speculative implementation 'draft-dflash'" not in log:
            problems[name] = "the DFlash draft was not set up"
        elif text.error:
            problems[name] = f"a text completion failed: {text.error}"
    return problems
