"""The series as data: patches/series.toml read, validated and typed, and its patch files.

series holds the concerns, their variants (one patch file per epoch's base), the bases, the epochs and
their proofs (load_series, Series, Concern, Variant, Epoch) and llama.cpp's release names; patchfile the
patch files themselves (sha256, DEP-3 author and message, hunks). Every stage from source up reads it, so
it sits below them all, as pip keeps its `models` below its stages. Takes the patches dir; hands on frozen
records.
"""
