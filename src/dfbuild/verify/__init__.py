"""dfbuild.verify: (describe the stage)."""
