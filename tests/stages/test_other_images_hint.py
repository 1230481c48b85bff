"""The hint `open_features` adds where a table was encoded from images that are no longer current
(features/open.py `_encoded_from_other_images`), on a store stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import features.open as opened


class Store:
    """vae v1, encoded by model "fp" from images v1; images v1 kept; `current`: the current images version."""

    def __init__(self, current):
        self.current = current

    def tables(self):
        return {} if self.current is None else {"images": self.current}

    def versions(self, table):
        return [1, 2] if table == "images" else [1]

    def version_dir(self, table, v):
        return f"{table}/v{v}"

    def checked_schema(self, table, v):
        return SimpleNamespace(lineage=SimpleNamespace(model_fingerprint="fp", upstream={"images": "1"}))


def test_no_current_images_gives_no_hint(monkeypatch):
    """With no current images version the hint read "not the current images vNone"."""
    monkeypatch.setattr(opened.fmt, "is_complete", lambda path: True)
    assert opened._encoded_from_other_images(Store(None), "vae", "fp", "M") is None
    hint = opened._encoded_from_other_images(Store(2), "vae", "fp", "M")  # the hint where one is current
    assert hint is not None and "from images v1, not the current images v2" in hint
