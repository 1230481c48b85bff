"""A sample grid reaches TensorBoard's event file before its PNG is written: a resume takes the PNG for "this
step's grid is done" (`Validator._grid_recorded`) and does not make it again. Before, the PNG came first and the
image was left to the writer's thread and queue (flushed at the next log call, or 120 s; buffered until then where
tensorflow's gfile writes): a kill in between left TensorBoard without that step's grid for good."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from PIL import Image

from stages.train.trackers import Trackers
from stages.train.validate import Validator, grid_path


def _images_on_disk(logs) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logs), size_guidance={"images": 0})
    ea.Reload()
    return [e.step for e in ea.Images("samples/grid")] if "samples/grid" in ea.Tags()["images"] else []


def test_the_grid_image_is_on_disk_before_its_png(tmp_path):
    writer = Trackers(["tensorboard"], tmp_path, {}, None)
    try:
        seen_at_image = []
        real_add_image = writer.add_image

        def add_image(*args, **kwargs):
            seen_at_image.append(grid_path(tmp_path, 4).exists())
            real_add_image(*args, **kwargs)
            seen_at_image.append(_images_on_disk(tmp_path / "logs"))  # read by another reader, the writer open

        writer.add_image = add_image
        validator = Validator.__new__(Validator)
        validator.run_dir = tmp_path
        validator.samples_grid = lambda transformer: Image.fromarray(np.full((8, 16, 3), 200, np.uint8))
        validator._write_samples(SimpleNamespace(transformer=None, writer=writer), 4)
        assert seen_at_image == [False, [4]]  # no PNG yet when the image went in; the image flushed at once
        assert Image.open(grid_path(tmp_path, 4)).size == (16, 8)
    finally:
        writer.close()
