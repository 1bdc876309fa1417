"""build, release and verify: binaries, artifacts, and the check of a release dir."""

from __future__ import annotations

from pathlib import Path

import click

from dfbuild.cli.app import main
from dfbuild.cli.common import (
    _dir_label,
    _locks,
    _work_locks,
    check_can_build,
    removed_if_left_empty_handed,
    say_request,
    shown,
)
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import (
    arch_option,
    backend_option,
    base_option,
    json_option_for,
    no_ui_option,
    no_wait_option,
    os_option,
    smoke_run_options,
    toolchain_options,
    usable_path,
)
from dfbuild.core import errors, ui

# --- build --------------------------------------------------------------------

@main.command()
@click.option("--dir", "tree", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              required=True,
              help="The llama.cpp tree to build (e.g. made by `dfbuild apply`).")
@backend_option()
@click.option("--build-dir", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              default=None,
              help="Build directory (default: DIR/../build-BACKEND).")
@click.option("--target", "targets", multiple=True,
              help="CMake targets to build, e.g. llama-server,llama-cli, or 'all' (repeatable; default: llama-server).")
@click.option("--cpu-variants", default=None,
              help="The runtime-dispatched CPU variants to build, e.g. x64,haswell, or armv8.0_1,armv8.2_2 "
                   "with --arch arm64 (default: all).")
@click.option("--cuda-arch", default=None, help="CUDA architectures, e.g. 86 or '86;90' (cuda only).")
@click.option("--gpu-targets", default=None, help="AMD GPU targets or families, e.g. rdna4 or gfx1201 (hip only).")
@click.option("--vulkan-include-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Use these Vulkan headers instead of the system's (vulkan only).")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra argument for CMake configure (repeatable).")
@click.option("-j", "--jobs", type=int, default=None, help="Parallel compile jobs (default: ninja's).")
@click.option("--reconfigure", is_flag=True, help="Reuse a build dir made for another backend/source; re-run CMake.")
@click.option("--fresh", is_flag=True, help="Delete the build dir and start over.")
@click.option("--no-ccache", is_flag=True, help="Do not use ccache even when it is installed.")
@no_ui_option
@os_option
@arch_option
@no_wait_option
@json_option_for("the build section (flags, toolchain, binaries)")
@handle_errors
def build(tree, backend, build_dir, targets, cpu_variants, cuda_arch, gpu_targets, vulkan_include_dir, cmake_args,
          jobs, reconfigure, fresh, no_ccache, no_ui, target_os, target_arch, no_wait, as_json):
    """Configure and build a llama.cpp tree for one backend (checks the toolchain first)."""
    from dfbuild.build import tree as build_stage
    from dfbuild.build.request import BuildRequest
    from dfbuild.core import journal, manifest, paths

    # the request, made once (backend and --os/--arch checked: this host, or a cross target)
    request = BuildRequest.from_options(
        backend=backend, target_os=target_os, target_arch=target_arch, targets=targets, cpu_variants=cpu_variants,
        cuda_arch=cuda_arch, gpu_targets=gpu_targets, vulkan_include_dir=vulkan_include_dir, cmake_args=cmake_args,
        jobs=jobs, reconfigure=reconfigure, fresh=fresh, no_ccache=no_ccache, no_ui=no_ui)
    backend, host = request.backend, request.host
    # not a tree, or a backend, OS or toolchain this host cannot build: refused before the build dir is made
    build_stage.check_llama_tree(Path(tree).resolve())
    check_can_build(backend, target_os, vulkan_include_dir, target_arch)
    say_request(request, smoke=False)
    lock_build_dir = build_dir or build_stage.default_build_dir(Path(tree), backend, host)
    lock_build_dir = Path(lock_build_dir).absolute()
    with removed_if_left_empty_handed(lock_build_dir, lambda: (lock_build_dir / "CMakeCache.txt").exists()), \
            _locks(("tree", tree), ("build", lock_build_dir), no_wait=no_wait):
        if paths.is_git_tree(Path(tree)) and journal.recover(Path(tree)):
            ui.warn(f"{tree} is back at its state before the interrupted run; "
                    "run `dfbuild apply` first if you meant to build the patched tree")
        section = build_stage.build_tree(tree, request, build_dir)
        if paths.is_git_tree(Path(tree)):
            manifest.update_tree_manifest(Path(tree), "request", request.to_dict())
            manifest.update_tree_manifest(Path(tree), "build", section)
    if as_json:
        ui.emit_json(section)
        return
    state = "already up to date" if section["up_to_date"] else f"built in {section['wall_time_s']:.1f}s"
    ui.result(f"{backend}: {state}, commit {section['source_commit'][:12]} (build {section['build_number']})")
    for binary in section["binaries"]:
        ui.result(f"  {Path(section['build_dir']) / binary}")
    if section["binaries"] and not host.cross:  # what was built for this host can be smoked here
        ui.next_step(f"dfbuild smoke --build-dir {shown(section['build_dir'])} --backend {backend}")


# --- webui --------------------------------------------------------------------

@main.command("webui")
@click.option("--dir", "tree", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              required=True, help="The llama.cpp tree whose web UI to build (e.g. made by `dfbuild checkout`).")
@no_wait_option
@json_option_for("the build section's ui part, and the cache entry")
@handle_errors
def webui_cmd(tree, no_wait, as_json):
    """Build a tree's web UI (tools/ui, with npm) into dfbuild's cache, as `build` would; print the entry.

    What `build` then embeds without Node.js or the network: CI builds it once and hands the
    cache entry to the jobs whose machines have no Node.js (ci/release.yml's webui job).
    """
    from dfbuild.build import tree as build_stage
    from dfbuild.host import webui

    tree = Path(tree).resolve()
    build_stage.check_llama_tree(tree)
    with _locks(("tree", tree), no_wait=no_wait):
        number = build_stage.build_number(tree)
        section = webui.provide(tree, number)
    entry = webui.entry_path(section["sources_sha256"]) if section.get("source") == "built" else None
    if as_json:
        ui.emit_json({**section, "entry": str(entry) if entry else None})
        return
    if entry is None:
        ui.warn(f"nothing to build: {webui.describe(section)}")
        return
    ui.result(str(entry), soft_wrap=True, markup=False)


# --- release ------------------------------------------------------------------

def _human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)  # pragma: no cover


@main.command("release")
@base_option
@click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base.")
@click.option("--repo", default=None, help="Repository URL or path (default: implied by a known base).")
@backend_option()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              default=Path("dist"), show_default=True,
              help="Where the artifacts, SHA256SUMS and manifest.json go.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              default=None,
              help="Working dir: checkout, build dirs, fixtures, smoke logs (default: ./dfbuild-BASE). "
                   "Reruns resume here.")
@click.option("--skip-smoke", is_flag=True, help="Package without smoke tests (recorded in the manifest as skipped).")
@click.option("--reprove", is_flag=True,
              help="Prove a carried base again even when series.toml records its proof (by default the recorded "
                   "proof stands, as `dfbuild series epochs` shows it).")
@click.option("--target", "targets", multiple=True,
              help="CMake targets to build and ship (repeatable; default: all, every tool llama.cpp's own "
                   "archive has; e.g. llama-server for a quicker release of the server alone; "
                   "llama-server always included).")
@click.option("--cpu-variants", default=None,
              help="The runtime-dispatched CPU variants to ship, e.g. x64,haswell, or armv8.0_1,armv8.2_2 "
                   "with --arch arm64 (default: all).")
@toolchain_options
@os_option
@arch_option
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra argument for CMake configure (repeatable).")
@click.option("-j", "--jobs", type=int, default=None, help="Parallel compile jobs (default: ninja's).")
@no_ui_option
@smoke_run_options
@click.option("--image", "with_image", is_flag=True,
              help="Last stage: add the container image of the archive (as `dfbuild image OUT`: llama.cpp's "
                   "server image of this backend, run before it is added; Linux cpu, vulkan, cuda, hip).")
@no_wait_option
@json_option_for("the release manifest (what manifest.json holds)")
@handle_errors
def release_cmd(base, pr, repo, backend, out, work, skip_smoke, reprove, targets, cpu_variants, cuda_arch, gpu_targets,
                vulkan_include_dir, target_os, target_arch, cmake_args, jobs, no_ui, start_timeout, smoke_table,
                allow_cpu_fallback, with_image, no_wait, as_json):
    """Checkout, apply, build, smoke and package BASE: archive, wheel, SHA256SUMS, manifest.json."""
    from dfbuild.build.request import BuildRequest
    from dfbuild.release import pipeline as release_stage
    from dfbuild.source import checkout as source

    # the request, made once, for every stage (backend and --os/--arch checked); every tool unless --target
    request = BuildRequest.from_options(
        backend=backend, target_os=target_os, target_arch=target_arch,
        targets=targets or release_stage.RELEASE_TARGETS, cpu_variants=cpu_variants, cuda_arch=cuda_arch,
        gpu_targets=gpu_targets, vulkan_include_dir=vulkan_include_dir, cmake_args=cmake_args, jobs=jobs,
        no_ui=no_ui, start_timeout=start_timeout, smoke_table=smoke_table, allow_cpu_fallback=allow_cpu_fallback)
    backend = request.backend
    source.check_known(base, repo)
    # backend, OS, architecture and toolchain: refused now (33, 30), not after the checkout
    check_can_build(backend, target_os, vulkan_include_dir, target_arch)
    release_stage.check_wheel_tools()
    if with_image:  # refused now (53, 52), not after the build
        from dfbuild.image import build as image_build
        from dfbuild.image import recipe as image_recipe

        linux = request.cross_host is None and (target_os or "linux") == "linux"
        if image_recipe.image_for(backend) is None or not linux:
            raise errors.ImageInputError(f"llama.cpp has no container image of a {target_os or 'linux'} {backend} "
                                         "archive", "drop --image (images: Linux cpu, vulkan, cuda, hip)")
        image_build.check_tools()
    say_request(request)
    work_dir = Path(work or release_stage.default_work_dir(base)).resolve()
    # the work tree (WORK/src), its build dir and OUT, for the whole pipeline; a WORK this run made goes
    # again when it fails before the checkout
    with removed_if_left_empty_handed(work_dir, lambda: (work_dir / "src" / ".git").exists()), \
            _locks(*_work_locks(work_dir, _dir_label(backend, request.cross_host)), ("out", Path(out)),
                   no_wait=no_wait):
        full = release_stage.release(base, request=request, pr=pr, repo=repo, out=out, work=work,
                                     skip_smoke=skip_smoke, reprove=reprove)
        if with_image:
            from dfbuild.core import manifest
            from dfbuild.image import make as image_stage

            with ui.step("image"):
                # the image's run is the release's smoke again, on the same terms (a GPU release smoked on the
                # CPU with --allow-cpu-fallback runs its image there too, recorded)
                image_stage.make_images(Path(out), tree=work_dir / "src", run=not skip_smoke,
                                        allow_cpu_fallback=allow_cpu_fallback)
            full = manifest.load(Path(out).resolve() / release_stage.MANIFEST_NAME)
    if as_json:
        ui.emit_json(full)
        return
    rel = full["release"]
    ui.result(f"\n[bold]release {rel['tag']}[/bold] ({rel['os']} {rel['arch']} {rel['backend']}), "
              f"patched commit {full['series']['head'][:12]}")
    if full["smoke"].get("skipped"):
        ui.warn("not smoke-tested (--skip-smoke)")
    elif full["smoke"].get("cpu_fallback"):
        ui.warn(f"smoke-tested on the CPU, not on a {backend} device: {full['smoke'].get('ran_on')}")
    out_dir = Path(out).resolve()
    for artifact in rel["artifacts"]:  # soft_wrap: paths stay whole, to copy and paste
        ui.result(f"  {out_dir / artifact['name']}  {_human_size(artifact['size'])}  "
                  f"sha256 {artifact['sha256'][:16]}", soft_wrap=True, markup=False)
    ui.result(f"  {out_dir / release_stage.SUMS_NAME}\n  {out_dir / release_stage.MANIFEST_NAME}",
              soft_wrap=True, markup=False)
    times = ", ".join(f"{name} {s['wall_s']:.1f}s" + (" (reused)" if s["reused"] else "")
                      for name, s in rel["stages"].items())
    ui.result(f"stages: {times}", soft_wrap=True)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--no-run", is_flag=True, help="Do not unpack and run the archived llama-server --version.")
@click.option("--run", "run_any", is_flag=True,
              help="Also run llama-server --version from archives this dfbuild did not package (by default only "
                   "its own are run); never from an archive that failed a check.")
@click.option("--max-unpacked-size", "max_unpacked", default=None, metavar="SIZE",
              help="Raise the cap on an archive's unpacked size (default 4G, and 100x the archive), e.g. 16G.")
@json_option_for("the report (checked, problems, ok)")
@handle_errors
def verify(directory, no_run, run_any, max_unpacked, as_json):
    """Check a release dir: SHA256SUMS, archives against their manifest, the wheel, and --version's commit.

    llama-server --version is run only from archives that passed every check, and by default
    only from archives this dfbuild packaged; --run opts in for others, --no-run runs nothing.
    """
    from dfbuild.source import checkout as source
    from dfbuild.verify import release_dir as verify_stage

    if no_run and run_any:
        raise click.UsageError("--run and --no-run contradict each other")
    limits = source.Limits.raised_to(source.parse_size(max_unpacked) if max_unpacked else None)
    report = verify_stage.verify(directory, run_binaries=False if no_run else (True if run_any else None),
                                 limits=limits)
    if as_json:
        ui.emit_json(report)
    else:
        from rich.markup import escape

        for note in report["checked"]:
            ui.result(f"  [green]ok[/green]   {escape(note)}", soft_wrap=True)
        for problem in report["problems"]:
            ui.result(f"  [red]FAIL[/red] {escape(problem)}", soft_wrap=True)
    if not report["ok"]:
        count = len(report["problems"])
        raise errors.VerifyError(f"{directory}: {count} problem(s); first: {report['problems'][0]}",
                                 "do not publish these files; rebuild them with `dfbuild release`")
    if not as_json:
        ui.result(f"{directory}: all checks passed")


@main.command("release-notes")
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--base", default=None, help="The llama.cpp base the release was made from, for the first line.")
@click.option("--registry", default=None, metavar="REGISTRY",
              help="Where the images are pushed, e.g. ghcr.io/OWNER: the notes add a `docker run` line from there.")
@handle_errors
def release_notes(directory, base, registry):
    """Markdown release notes for a release dir: where each archive's smoke ran (its GPU, or the CPU backend).

    CI's publish job passes them to the draft release; run `dfbuild verify` on the directory first.
    """
    from dfbuild.verify import release_dir as verify_stage

    click.echo(verify_stage.release_notes(directory, base, registry), nl=False)
