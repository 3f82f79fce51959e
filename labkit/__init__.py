"""labkit: helpers for the course."""
from labkit.runtime import quiet as _quiet

_quiet.install()  # third-party import noise a student cannot act on (labkit.runtime.quiet says which)


def _course_seal(payload: dict, text: str) -> dict:
    """The course layer's seal on what a notebook publishes, imported when the first payload is shown,
    so `import labkit.results` (the core) never imports `labkit.course.grading` (labkit.results says why)."""
    from labkit.course.grading.fingerprint import seal

    return seal(payload, text)


def _register_course_hooks() -> None:
    from labkit import results

    results.register_publisher("seal", _course_seal)


_register_course_hooks()


def free_gpu_memory() -> None:
    """Release what this process no longer uses: collect garbage and, on a GPU, empty torch's cache so
    the next notebook (or another student's kernel) gets the memory back. Call it at the end of a lab;
    shutting the kernel down frees everything."""
    from labkit.train.metrics import free_device_memory

    free_device_memory()
