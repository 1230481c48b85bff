"""The `images` rows `open_writer` looked up travel with the keys they belong to (`intake.Todo`) into
`read_inputs`: no second lookup (~2 s per 1M keys), and no way for a caller to change the keys in place and leave
the rows misaligned (before, the rows waited in `job.todo_rows` and were reused for the very same list object
only: such a change would have refused the wrong samples for their control count, silently)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from schemas.errors import Rejected
from stages.encode.intake import Todo, control_count_rejection, key_rows, read_inputs

KEYS = ["a", "b", "c"]  # the table's rows, in order
COUNTS = [1, 2, 1]  # b has two controls: an Edit model refuses it


class _Images:
    """The part of a TableReader `read_inputs` uses; counts its key lookups."""

    def __init__(self):
        self.counts, self.lookups = pa.chunked_array([pa.array(COUNTS, pa.int64())]), 0

    def rows_of_keys(self, keys):
        self.lookups += 1
        return np.array([KEYS.index(k) for k in keys.to_pylist()], np.int64)

    def column(self, name):
        return self.counts

    def has_column(self, name):
        return name == "num_controls"

    def get(self, key):
        return {"key": key, "num_controls": COUNTS[KEYS.index(key)]}

    def check_ahead(self, rows):
        pass


def _refused(job, keys) -> list[str]:
    rule = lambda n, key: control_count_rejection("edit", n, key)  # noqa: E731
    return [key for key, sample in read_inputs(job, keys, rule) if isinstance(sample, Rejected)]


def test_the_rows_come_with_their_keys_and_are_not_looked_up_again():
    job = SimpleNamespace(images=_Images(), on_damaged="stop", control_census=None)
    order = ["c", "b", "a"]
    todo = Todo(tuple(order), key_rows(job, order))  # as open_writer hands them over
    assert job.images.lookups == 1
    assert _refused(job, todo) == ["b"] and job.images.lookups == 1  # its own rows, no second lookup
    with pytest.raises(AttributeError):
        todo.keys.reverse()  # the keys cannot change under their rows
    assert _refused(job, list(reversed(todo))) == ["b"] and job.images.lookups == 2  # other keys: looked up
    assert _refused(job, Todo(("b", "a"))) == ["b"]  # no rows handed over: looked up
