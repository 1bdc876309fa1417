"""dfbuild.release: (describe the stage)."""
