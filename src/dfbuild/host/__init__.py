"""dfbuild.host: (describe the stage)."""
