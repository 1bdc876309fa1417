"""`dfbuild verify`: a release dir checked as a user's tools would read it, before anything in it runs.

release_dir walks the dir (SHA256SUMS, each archive against its manifest, the wheel, the runs last) and
writes the release notes; members checks an archive's members (modes, links, the folder they lie in, PE
files, the manifest fields verify reads); wheel what pip would install and that it is the archive's build;
programs runs the unpacked programs (`--version`'s commit, every program starting, under Wine, qemu or the
ROCm root). Takes a release dir; hands on a report, or a VerifyError (exit 51).
"""
