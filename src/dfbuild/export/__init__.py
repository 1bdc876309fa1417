"""dfbuild.export: (describe the stage)."""
