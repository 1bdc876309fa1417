"""dfbuild.image.make: (describe the stage)."""
