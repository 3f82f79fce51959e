"""Declared checks of the course notebooks: one module `lab<NOTEBOOK>.py` per notebook.

Each module defines `NOTEBOOK = "<name>"` (the notebook's `metadata.labkit.notebook`) and
`CHECKS = (Check, ...)` built with the kinds in `labkit.course.grading.checks`.
"""
