"""Grading executed notebooks on their recorded (GPU) results: checks, seals, sandbox, batch.

`labkit check NOTEBOOK.ipynb` (students) and `labkit grade SUBMISSIONS_DIR --out OUT_DIR` (instructors)
are the entry points; docs/grading.md explains the design and its limits. This package is imported
by `labkit.results.show/answer` (for the seal), so this file stays free of heavy imports.
"""
