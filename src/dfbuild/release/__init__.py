"""The release stage: the proof, the archives, the wheel, SHA256SUMS and the manifest, in one output dir.

prove builds a tree unpatched and patched and smokes both (fixed, fixed upstream, still broken); pipeline
is `dfbuild release` (checkout, apply, prove, build, smoke, package; a rerun resumes); package the
archive's payload and layout, wheel the wheel through builder/, cudart the CUDA runtime archives, record
what a release dir records and is named by (the tag, SHA256SUMS, the stage record); track follows
upstream's new releases. Takes a base and a BuildRequest; hands on a release dir and the manifest's
`proof` and `release` sections.
"""
