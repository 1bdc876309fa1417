"""Verdicts: what one scenario observed, judged (HTTP, log, drafts accepted, identity with the plain run)."""

from __future__ import annotations

from dfbuild.smoke.logscan import tail

MIN_ACCEPTANCE = 0.9
MAX_DISAGREE_ACCEPTANCE = 0.1


# --- identity with the plain run ---------------------------------------------------------
#
# On CPU (and CUDA) drafted and plain greedy decoding give byte-identical output:
# "exact". On a device whose arithmetic depends on the batch shape (Vulkan, and
# lavapipe above all) the drafted run verifies tokens in batches while the plain
# run decodes one by one, so where the target's top two candidates are nearly tied
# the two runs may pick different tokens without any bug. "near-tie" tells that
# noise from a real divergence at the *first* differing token (everything after it
# follows from different text, so it says nothing):
# - the plain run's top candidates there are within `near_tie_logprob` nats, and
# - the drafted run picked one of those near-tied candidates.
# Anything else (a decisive position, a token the plain run did not rank near the
# top, a shorter output) fails as on CPU. The plain run is asked for its top
# candidates (n_probs), which changes nothing about what it generates.

IDENTITY_RULES = ("exact", "near-tie")
N_PROBS = 4  # candidates the plain run reports per token under "near-tie"
EXACT = {"rule": "exact"}


def identity_verdict(drafted: str, plain: str, plain_probs: list[dict], near_tie_logprob: float) -> dict:
    """Is DRAFTED's difference from PLAIN device noise? `plain_probs` is `_compact_probs` of the plain run.

    Returns {"noise": bool, "why": words, ...where it differs and by what margin}.
    """
    d_bytes, p_bytes = drafted.encode(), plain.encode()
    first = next((i for i, (x, y) in enumerate(zip(d_bytes, p_bytes, strict=False)) if x != y),
                 min(len(d_bytes), len(p_bytes)))
    offset = 0
    for index, entry in enumerate(plain_probs):  # noqa: B007 - index is read after the loop
        piece = bytes(entry["bytes"])
        if offset + len(piece) > first:
            break
        offset += len(piece)
    else:
        return {"noise": False, "why": f"the outputs differ at byte {first}, past the plain run's reported tokens"}
    candidates = sorted(entry["top"], key=lambda c: -c[1])
    where = {"token_index": index, "plain_token": piece.decode("utf-8", "replace"),
             "drafted_text": d_bytes[offset:offset + 8].decode("utf-8", "replace")}
    if len(candidates) < 2:
        return {"noise": False, **where, "why": f"token {index}: the plain run reported no runner-up to compare with"}
    best = candidates[0][1]
    margin = best - candidates[1][1]
    where["margin"] = round(margin, 6)
    tied = [bytes(c[0]) for c in candidates[1:] if best - c[1] <= near_tie_logprob]
    picked = next((c for c in tied if c and d_bytes[offset:].startswith(c)), None)
    if picked is not None:
        return {"noise": True, **where, "drafted_token": picked.decode("utf-8", "replace"),
                "why": f"token {index}: a near-tie ({margin:.4g} nats between the top two), and the drafted run "
                       f"picked a near-tied candidate"}
    if not tied:
        why = (f"token {index}: the plain run's top two are {margin:.4g} nats apart, more than the "
               f"{near_tie_logprob:g} a near-tie may differ by: a real divergence")
    else:
        why = (f"token {index}: a near-tie ({margin:.4g} nats), but the drafted run picked "
               f"{where['drafted_text']!r}, not one of the near-tied candidates: a real divergence")
    return {"noise": False, **where, "why": why}


# --- judging ---------------------------------------------------------------------------


def judge(fixture_set: dict, spec_steps: list[dict], base_steps: list[dict] | None, *,
          alive: bool, log_findings: list[dict], identity: dict | None = None) -> dict:
    """Pure verdict over what one scenario observed; every reason it failed, in words.

    IDENTITY is the rule for comparing with the plain run ({"rule": "exact"} by
    default; "near-tie" with its near_tie_logprob, see identity_verdict).
    """
    identity = identity or EXACT
    failures = []
    for step in spec_steps:
        if step["error"]:
            failures.append(f"{step['label']}: {step['error']}")
    if not alive:
        failures.append("llama-server died during the scenario")
    for finding in log_findings:
        failures.append(f"log: {finding['pattern']}: {finding['text']}")

    image_steps = [s for s in spec_steps if s["image"] and not s["error"] and s.get("generates", True)]
    drafted = sum(s["draft_n"] for s in spec_steps)
    accepted = sum(s["draft_n_accepted"] for s in spec_steps)
    image_drafted = sum(s["draft_n"] for s in image_steps)
    image_accepted = sum(s["draft_n_accepted"] for s in image_steps)
    acceptance = accepted / drafted if drafted else None
    image_acceptance = image_accepted / image_drafted if image_drafted else None

    agree = fixture_set.get("agree")
    if agree is True:
        for s in image_steps:
            if s["draft_n"] == 0:
                failures.append(f"{s['label']}: no drafts on an image request")
            elif s["draft_n_accepted"] == 0:
                failures.append(f"{s['label']}: drafts on an image request, none accepted")
        if drafted == 0:
            if any(s.get("generates", True) for s in spec_steps):
                failures.append("no drafts at all")
        elif acceptance is not None and acceptance < MIN_ACCEPTANCE:  # drafts, so a ratio
            failures.append(f"acceptance {acceptance:.2f} < {MIN_ACCEPTANCE} with an agreeing draft")
    elif agree is False and drafted and acceptance is not None and acceptance > MAX_DISAGREE_ACCEPTANCE:
        failures.append(f"acceptance {acceptance:.2f} > {MAX_DISAGREE_ACCEPTANCE} with a disagreeing draft: "
                        "counters are wrong")

    identical = None
    near_ties = []
    if base_steps is not None:
        mismatched = [(s, b) for s, b in zip(spec_steps, base_steps, strict=False)
                      if not s["error"] and not b["error"] and s["content"] != b["content"]]
        base_errors = [f"{b['label']}: {b['error']}" for b in base_steps if b["error"]]
        identical = not mismatched and not base_errors and len(spec_steps) == len(base_steps)
        for s, b in mismatched:
            if identity["rule"] == "near-tie":
                found = identity_verdict(s["content"] or "", b["content"] or "", b.get("probs") or [],
                                         float(identity["near_tie_logprob"]))
                if found["noise"]:
                    near_ties.append({"label": s["label"], **found})  # recorded, never silent
                else:
                    failures.append(f"{s['label']}: output differs from --spec-type none; {found['why']}")
            else:
                failures.append(f"{s['label']}: output differs from --spec-type none")
        for err in base_errors:
            failures.append(f"baseline (--spec-type none) {err}")

    image_idx = [k for k, s in enumerate(spec_steps) if s["image"]]
    first, last = (spec_steps[image_idx[0]], spec_steps[image_idx[-1]]) if image_idx else (None, None)
    return {
        "passed": not failures,
        "failures": failures,
        "statuses": [s["status"] for s in spec_steps],
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(acceptance, 4) if acceptance is not None else None,
        "image_drafted": image_drafted,
        "image_accepted": image_accepted,
        "image_acceptance": round(image_acceptance, 4) if image_acceptance is not None else None,
        # the server's own /metrics totals around the image requests
        "drafted_before": first["metrics_drafted_before"] if first else None,
        "accepted_before": first["metrics_accepted_before"] if first else None,
        "drafted_after": last["metrics_drafted_after"] if last else None,
        "accepted_after": last["metrics_accepted_after"] if last else None,
        "identical_to_no_spec": identical,
        "identity_rule": identity["rule"],
        "near_ties": near_ties,  # differences accepted as device noise, each with its margin
        "alive": alive,
    }


UPSTREAM_PATTERNS = ("draft decode failed", "inconsistent positions", "mtmd chunk failed", "speculative batch failed")


def upstream_symptom(result: dict) -> bool:
    """Did this scenario fail the way the upstream bug fails (a 5xx, or a draft-side
    decode failure in the log), rather than some other way?"""
    server_error = any(
        (r["status"] or 0) >= 500 or (r["error"] or "").startswith("stream error event")
        for r in result["requests"]
    )
    decode_failure = any(f["pattern"] in UPSTREAM_PATTERNS for f in result["log_findings"])
    return server_error or decode_failure


def _excerpt(log_text: str, findings: list[dict], steps: list[dict], context: int = 3) -> str:
    """The log lines around the first failure line, or the tail after the first failed request."""
    lines = log_text.splitlines()
    if findings:
        n = findings[0]["line"] - 1
        return "\n".join(lines[max(0, n - context):n + context + 1])
    failed = next((s for s in steps if s["error"]), None)
    if failed:
        return failed["error"] + "\n" + tail(log_text, 8)
    return ""
