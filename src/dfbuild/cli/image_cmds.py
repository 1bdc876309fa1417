"""image: the container images of a release dir's archives (image.py)."""

from __future__ import annotations

from pathlib import Path

import click

from dfbuild.cli.app import main
from dfbuild.cli.common import _locks
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import json_option_for, no_wait_option
from dfbuild.core import ui


@main.command("image")
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--tree", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="The llama.cpp tree whose .devops/ Dockerfiles to read (default: the base's sdist in "
                   "dfbuild's cache; without one, dfbuild's fallback recipe, recorded).")
@click.option("--no-run", is_flag=True,
              help="Do not run the image before adding it (by default its entrypoint is started in its unpacked "
                   "root and must answer the smoke's image request through DFlash); the manifest says so.")
@click.option("--label", "labels", multiple=True, metavar="NAME=VALUE",
              help="An extra OCI label (repeatable), e.g. org.opencontainers.image.source=https://github.com/O/R "
                   "(GHCR links the package to that repository).")
@click.option("--allow-cpu-fallback", is_flag=True,
              help="A GPU image on a machine without its GPU runs its check on the CPU backend (recorded) instead "
                   "of failing (exit 45).")
@no_wait_option
@json_option_for("the images added (name, ref, digest, platform, layers)")
@handle_errors
def image_cmd(directory, tree, no_run, labels, allow_cpu_fallback, no_wait, as_json):
    """Add container images of DIRECTORY's archives to it (OCI archives, in SHA256SUMS and manifest.json).

    One image per archive llama.cpp has an image for (server, server-vulkan, server-cuda,
    server-rocm), laid out as the base's .devops/ Dockerfile lays it out; built without a daemon
    (Debian packages, umoci); run before it is added. Needs root, umoci, skopeo and mmdebstrap.
    """
    from dfbuild.core.errors import UsageError
    from dfbuild.image import make as image_stage

    extra = {}
    for item in labels:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--label {item!r} is not NAME=VALUE", "e.g. --label org.opencontainers.image.source=URL")
        extra[name] = value
    with _locks(("out", Path(directory)), no_wait=no_wait):
        records = image_stage.make_images(directory, tree=tree, run=not no_run, labels=extra,
                                            allow_cpu_fallback=allow_cpu_fallback)
    if as_json:
        ui.emit_json({"images": records})
        return
    for record in records:
        ui.result(f"{Path(directory) / record['name']}  {record['ref']}  {record['digest']}", soft_wrap=True,
                  markup=False)
