"""Course machinery: grading, reservations and lease timelines, slides, the notebook runner, node checks."""
