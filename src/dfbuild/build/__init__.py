"""dfbuild.build: (describe the stage)."""
