"""dfbuild.model: (describe the stage)."""
