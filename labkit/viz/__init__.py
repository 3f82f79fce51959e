"""Drawing: every course figure and plot, the pipeline schedule drawing, the notebook widgets."""
