"""dfbuild.core: (describe the stage)."""
