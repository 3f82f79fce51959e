"""`show_source`: the "open the box" cell of a lab prints the real transform's source (issue #15)."""
import pytest

from labkit.course.exercises.show import show_source, source_of
from labkit.parallel.comm import bubble_fraction


def test_source_names_where_the_function_lives_and_holds_its_body(capsys):
    text = source_of(bubble_fraction)
    assert text.splitlines()[0].startswith("# labkit.parallel.comm.bubble_fraction  (")
    assert "comm.py:" in text.splitlines()[0]
    assert "return warmup_slots(stages, chunks) / step_slots(stages, microbatches, chunks)" in text
    show_source(bubble_fraction)
    assert capsys.readouterr().out.strip() == text.strip()


def test_an_object_without_python_source_is_one_clear_error():
    with pytest.raises(TypeError, match="no Python source to show"):
        source_of(len)
