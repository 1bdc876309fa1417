"""dfbuild.draft: (describe the stage)."""
