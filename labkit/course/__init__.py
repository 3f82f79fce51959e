"""Course machinery: grading, reservations, slides, the notebook runner."""
