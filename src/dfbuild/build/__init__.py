"""The build stage: a patched tree configured and compiled for one backend, and what its binaries say.

request is the BuildRequest (frozen: backend, target, targets, CPU variants, CMake arguments, smoke
options), made once by the CLI; config the CMake flags, llama.cpp's own release options (upstream_release
reads them from the tree's release.yml) and the build's environment; directory a build dir's name, owner
stamp and claim; run one CMake or ninja step with its log; version the commit and build number the
binaries print; tree is build_tree itself and what a build ships. Takes a tree and a BuildRequest; hands
on a build dir and the manifest's `build` section.
"""
