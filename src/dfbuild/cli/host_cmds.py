"""doctor and matrix: what this host can build, and the CI release matrix."""

from __future__ import annotations

import sys

import click

from dfbuild.cli.app import main
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import arch_option, backend_option, json_option_for, os_option
from dfbuild.core import errors, ui


@main.command()
@backend_option(default=None, help="Check one backend only (default: all).")
@os_option
@arch_option
@click.option("--image", "for_image", is_flag=True,
              help="Check what `dfbuild image` needs (umoci, skopeo, mmdebstrap, root); exit 52 when something is "
                   "missing.")
@click.option("--fetch-vulkan-headers", "fetch_vulkan", is_flag=True,
              help="(Debian 12) Unpack Debian 13's Vulkan headers into the cache and print their include dir.")
@json_option_for("the report: host, and per backend what is found and what to install")
@handle_errors
def doctor(backend, target_os, target_arch, for_image, fetch_vulkan, as_json):
    """Say per backend what is installed here and exactly what to install for what is missing."""
    from rich.markup import escape as esc

    from dfbuild.host import doctor as doctor_stage

    # for: dfbuild build --backend vulkan --vulkan-include-dir "$(dfbuild doctor --fetch-vulkan-headers)"
    if fetch_vulkan:
        click.echo(doctor_stage.fetch_debian_vulkan_headers())
        return
    from dfbuild.host import platforms

    host = platforms.target_host(target_os, arch=target_arch)  # --os macos on Linux: refused (33)
    backend = backend.lower() if backend else None
    report = doctor_stage.doctor(backend, host=host)
    if as_json:
        ui.emit_json(report)
        if for_image and not report["images"]["can_build"]:
            sys.exit(errors.ImageToolError.exit_code)
        if backend and not report["backends"][backend]["can_build"]:
            entry = report["backends"][backend]
            sys.exit((errors.ToolchainMissingError if entry["toolchain"] else errors.UnsupportedBackendError).exit_code)
        return
    host = report["host"]
    distro = f" ({host['distro']} {host['distro_version']})" if host["distro"] else ""
    ui.result(f"host: {host['os']} {host['arch']}{distro}")
    if report.get("target"):
        ui.result(f"target: {report['target']['os']} {report['target']['arch']} (cross-built here)")
    for name, entry in report["backends"].items():
        verdict = "[green]can build[/green]" if entry["can_build"] else "[red]cannot build here[/red]"
        ui.result(f"\n[bold]{name}[/bold] - {esc(entry['summary'])}: {verdict}")
        for probe in entry["toolchain"] + entry["runtime"]:
            if probe["ok"]:
                mark, detail = "[green]ok[/green]  ", esc(probe["version"] or probe["path"])
            else:
                mark = "[yellow]--[/yellow]  " if probe["optional"] else "[red]!![/red]  "
                detail = esc(probe["problem"] or "not found")
            ui.result(f"  {mark}{esc(probe['what'])}: {detail}")
            if not probe["ok"] and probe["install"]:
                ui.result(f"        [dim]install:[/dim] {esc(probe['install'])}")
        if not entry["toolchain"] and entry["reason"]:
            ui.result(f"  {esc(entry['reason'])}")
        if entry.get("rocm_root") and entry["can_build"]:
            ui.result(f"  [green]ok[/green]  {esc(entry['reason'])}")
    web = report["webui"]
    verdict = "[green]can build[/green]" if web["can_build"] else "[yellow]cannot build here[/yellow] (--no-ui)"
    ui.result(f"\n[bold]web UI[/bold] - {esc(web['what'])}: {verdict}")
    for probe in web["toolchain"]:
        mark = "[green]ok[/green]  " if probe["ok"] else "[yellow]--[/yellow]  "
        detail = (probe["version"] or probe["path"] or "") if probe["ok"] else (probe["problem"] or "not found")
        ui.result(f"  {mark}{esc(probe['what'])}: {esc(detail)}")
        if not probe["ok"] and probe["install"]:
            ui.result(f"        [dim]install:[/dim] {esc(probe['install'])}")
    if not web["can_build"]:
        ui.result(f"  {esc(web['without'])}")
    images = report["images"]
    verdict = "[green]can build[/green]" if images["can_build"] else "[yellow]cannot build here[/yellow]"
    ui.result(f"\n[bold]images[/bold] - {esc(images['what'])}: {verdict}")
    for probe in images["toolchain"]:
        ui.result(f"  {'[green]ok[/green]  ' if probe['ok'] else '[yellow]--[/yellow]  '}{esc(probe['what'])}")
        if not probe["ok"]:
            ui.result(f"        [dim]install:[/dim] {esc(probe['install'])}")
    if for_image and not images["can_build"]:
        raise errors.ImageToolError("dfbuild image cannot run here: " + "; ".join(
            p["what"].split(":")[0] for p in images["toolchain"] if not p["ok"]), "\n".join(images["install"]))
    if backend and not report["backends"][backend]["can_build"]:
        # one backend asked for: the exit code answers "can I build it here?" (30 or 33, as `build` would)
        doctor_stage.require(backend, platforms.target_host(target_os, arch=target_arch))


# --- matrix -------------------------------------------------------------------

@main.command()
@click.option("--tag", default=None, help="Release tag to put in the artifact names (default: <tag>).")
@click.option("--print-build-identifiers", "identifiers", is_flag=True,
              help="Print only the entry ids (os-backend-arch), one per line.")
@json_option_for("the GitHub Actions matrix (include: one entry per os, backend, arch)")
@handle_errors
def matrix(tag, identifiers, as_json):
    """The release matrix (one entry per os, backend, arch), generated from the backend table."""
    from dfbuild.host import matrix as matrix_stage

    data = matrix_stage.github_matrix(tag or matrix_stage.TAG_PLACEHOLDER)
    if as_json:
        ui.emit_json(data)
        return
    if identifiers:
        for entry in data["include"]:
            click.echo(entry["id"])
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    for column in ("id", "runner", "artifact", "verified"):
        table.add_column(column, overflow="fold")
    for entry in data["include"]:
        runner = entry["runner"] + (f" ({entry['container']})" if entry["container"] else "")
        table.add_row(entry["id"], runner, "\n".join([entry["artifact"], *entry.get("extra_artifacts", [])]),
                      entry["verified"])
    ui.result(table)
    # what each mark rests on (how, or why not), and where CI's smoke of a GPU entry runs
    for entry in data["include"]:
        line = f"{entry['id']}: {entry['verified']}: {entry['verified_note']}"
        if entry["smoke_on_cpu"]:
            line += f"; CI smokes it on the CPU backend ({entry['smoke_on_cpu']}), and its manifest says so"
        ui.result(line, soft_wrap=True, markup=False)
