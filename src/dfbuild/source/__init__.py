"""dfbuild.source: (describe the stage)."""
