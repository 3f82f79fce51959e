"""Course machinery: code exercises and grading, reservations and lease timelines, slides, the notebook runner, node checks."""
