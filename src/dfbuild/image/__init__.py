"""dfbuild.image: container images of a release's archives (issue 46, docs/images.md).

`recipe` reads the server image a tree's `.devops/` Dockerfile describes (data/images.toml says
the rest), `rootfs` makes and caches the Debian root an image stands on (mmdebstrap), `build`
assembles one OCI archive with umoci, `make` is the stage (`dfbuild image`, `release --image`:
verify first, build, run before publishing, add to SHA256SUMS and the manifest). The launcher
that starts an unpacked image's entrypoint is smoke.image_root; verify.image checks an image.
"""
