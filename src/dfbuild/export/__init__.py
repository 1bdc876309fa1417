"""`dfbuild series export --upstream`: the fix in upstream's own form, for a llama.cpp pull request.

upstream squashes a base's variant into `git format-patch` commits in llama.cpp's style (`spec : ...`),
with the submitter's identity, and writes the output dir (.dfbuild-export.json, the patches, PR.md); text
holds the export's words: the commit messages, the server test it adds to tools/server/tests/unit/ and
PR.md in the tree's pull-request template. Takes a base and the series; hands on an output dir.
"""
