"""labkit: helpers for the course."""
from labkit import quiet as _quiet

_quiet.install()  # third-party import noise a student cannot act on (labkit.quiet says which)
