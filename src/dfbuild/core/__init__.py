"""The floor every stage stands on: it imports nothing of dfbuild outside itself.

Typed errors with their exit codes (errors), the one way to run a program (proc) and git (gitrun), talk on
stderr and results on stdout (ui), atomic writes and records read safely (state), locks, the rollback
journal, the strict readers of every format dfbuild reads back (readers), archives, unpacking, downloads,
ELF checks and the manifest's file. Takes paths and plain data; hands back plain data or a DfbuildError.
"""
