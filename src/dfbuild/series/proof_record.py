"""The record of what was proved: `dfbuild prove` records read, and series.toml's epochs and their
proofs written (series record-proof) and shown (series epochs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomlkit

from dfbuild.core import state
from dfbuild.core.errors import UsageError
from dfbuild.host.backends import machine_facts
from dfbuild.model.series import Series
from dfbuild.source import checkout as source

# --- the record of what was proved: series.toml's epochs ----------------------------------------------


def read_proofs(path: Path) -> list[dict]:
    """The proofs in a `dfbuild prove` record: WORK/proof-<backend>.json maps keys to proofs; a copy
    of one proof (bench/proofs) is the proof itself."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the proof record {path}: {exc}", "pass a `dfbuild prove` record") from None
    proofs = [data] if isinstance(data, dict) and "outcome" in data else (
        [v for v in data.values() if isinstance(v, dict) and "outcome" in v] if isinstance(data, dict) else [])
    if not proofs:
        raise UsageError(f"{path} holds no proof", "pass WORK/proof-<backend>.json of a finished `dfbuild prove`")
    return proofs


def _counts(summary: dict | None, *, unpatched: bool) -> str:
    if not summary:
        return "not run"
    runs, failed = summary.get("runs"), len(summary.get("failed") or [])
    if summary.get("passed"):
        return f"all {runs} passed"
    symptom = " with the upstream symptom" if unpatched and summary.get("upstream_symptom") else ""
    return f"{failed} of {runs} scenario runs failed{symptom}"


def describe_machine(machine: dict | None) -> str:
    if not machine:
        return "not recorded"
    return (f"{machine.get('cores')} {machine.get('arch')} cores, {machine.get('cpu') or 'unknown CPU'}, "
            f"{machine.get('system')}")


def proof_entry(proof: dict, *, record_name: str) -> dict:
    """A `dfbuild prove` proof as series.toml records it: what, how it went, where and when."""

    machine = proof.get("machine")
    where = describe_machine(machine) if machine else f"{describe_machine(machine_facts())} (where it was recorded)"
    table = (proof.get("smoke_table") or {}).get("table")
    loaded = proof.get("fixtures_loaded")
    return {
        "release": proof["base"],
        "outcome": proof["outcome"],
        "unpatched": _counts(proof.get("unpatched"), unpatched=True),
        "patched": _counts(proof.get("patched"), unpatched=False),
        "fixtures": f"all {len(loaded)} sets load" if loaded else "not checked",
        "where": f"{where}; {proof.get('backend', '?')}" + (f", {table} table" if table else ""),
        "when": proof.get("proven_at") or "unknown",
        "record": f"dfbuild prove --base {proof['base']} --backend {proof.get('backend', 'cpu')} ({record_name})",
    }


def record_proofs(series: Series, proofs: list[dict], *, record_name: str, new_epoch: dict | None = None) -> dict:
    """Add each proof to the epoch of series.toml that holds its release; a proof of the same release
    there is replaced. An epoch is never made silently: NEW_EPOCH (first, last, variant, change) makes one."""
    doc = tomlkit.parse(series.path.read_bytes().decode("utf-8"))
    if "epoch" not in doc:
        doc.append("epoch", tomlkit.aot())
    epochs = doc["epoch"]
    created = None
    if new_epoch:
        first, last = source.release_build(new_epoch["first"]), source.release_build(new_epoch["last"])
        if first is None or last is None or first > last:
            raise UsageError(f"--epoch-first {new_epoch['first']} --epoch-last {new_epoch['last']}: "
                             "two releases bNNNN, oldest first", "name the epoch's first and last release")
        if new_epoch["variant"] not in series.variant_bases:
            raise UsageError(f"--variant {new_epoch['variant']} is not a base series.toml knows",
                             "record the variant first: dfbuild series record --dir D --onto BASE")
        for epoch in series.epochs:
            if epoch.first <= last and first <= epoch.last:
                raise UsageError(f"epoch b{first}..b{last} overlaps {epoch.name}", "epochs follow each other")
        table = tomlkit.table()
        table.update({"first": f"b{first}", "last": f"b{last}", "variant": new_epoch["variant"],
                      "upstream_change": new_epoch.get("change") or ""})
        table.add(tomlkit.nl())  # a blank line after it, as the curated file has
        at = sum(1 for epoch in series.epochs if epoch.first < first)  # kept in release order
        epochs.insert(at, table)
        created = f"b{first}..b{last}"
    added = []
    for proof in proofs:
        build = source.release_build(proof.get("base"))
        if build is None:
            raise UsageError(f"the proof of {proof.get('base')} is not of a release bNNNN",
                             "epochs hold releases; a PR head or commit is recorded by its own prove record")
        holder = next((e for e in epochs if _holds(e, build)), None)
        if holder is None:
            raise UsageError(f"no epoch in series.toml holds {proof['base']}; nothing was written",
                             "make one: --epoch-first bN --epoch-last bM --variant BASE --change TEXT")
        entry = proof_entry(proof, record_name=record_name)
        entry["code"] = series.variant_code(str(holder["variant"]))  # what it proved (Series.variant_code)
        table = tomlkit.table()
        table.update(entry)
        table.add(tomlkit.nl())
        kept = holder.setdefault("proof", tomlkit.aot())
        same = [i for i, p in enumerate(kept) if p.get("release") == entry["release"]]
        if same:
            kept[same[0]] = table
        else:
            kept.append(table)
        added.append({**entry, "epoch": f"{holder['first']}..{holder['last']}", "replaced": bool(same)})
    state.atomic_write_text(series.path, tomlkit.dumps(doc))
    return {"series": str(series.path), "created_epoch": created, "proofs": added}


def _holds(epoch: Mapping[str, Any], build: int) -> bool:
    """Whether the epoch table EPOCH (series.toml's, whose ends load_series checked are releases) holds BUILD."""
    first, last = source.release_build(epoch["first"]), source.release_build(epoch["last"])
    return first is not None and last is not None and first <= build <= last


def epochs_table(series: Series) -> list[dict]:
    return [{"name": e.name, "first": f"b{e.first}", "last": f"b{e.last}", "variant": e.variant,
             "upstream_change": e.upstream_change,
             "proofs": [{**p, "current": series.proof_is_current(e, p)} for p in e.proofs]} for e in series.epochs]
