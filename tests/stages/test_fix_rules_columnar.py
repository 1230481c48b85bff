"""Which stored rows a fix changes, decided for whole columns (stages/encode/plan.py `changed_rows`, store/row_rule.py:
each fix's rule called once per distinct value of the columns it reads) against the rule row by row as it was
written (each row's whole `images` meta, kept here as the reference), for every fix the stages declare, on a
mixed table: alpha and turned-mask notes alone and together, no notes, rows whose images row records no notes,
keys the images lack, lengths on both sides of the 2.1 frame limit and none, several chunks; and
an images table without the conversions column. Resize's mask rule the same way over an images manifest, and its
caption rule (revision 3) over the caption column against the cleaning itself."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from schemas import FieldSpec, Lineage, TableSchema
from schemas.fixes import mask_orientation_changes, prompt_was_emptied
from stages.encode import qwen21, text, vae
from stages.encode.plan import Fixes, changed_rows
from stages.resize.images_table import MASK_FIX
from store import Store
from store.reuse import _unchanged
from store.row_rule import RowRule, codes

KEYS = sorted(f"{i * 7919:032x}" for i in range(10))
ALPHA, TURNED = "kept with its alpha (RGBA)", "mask turned as its target (EXIF 6)"
EXIF, RESIZED = "EXIF orientation 6 applied", "mask resized to its target"
KEPT = "kept instead of its first copy, which the rendering rejected"
NOTES = [[], [ALPHA], [TURNED], [ALPHA, TURNED], None, [EXIF, RESIZED], [EXIF], [ALPHA], [KEPT], [TURNED]]
HAS_MASK = [False, False, True, True, True, True, True, None, False, True]
SHAPES = [[[1, 64, 64]], [[1, 64, 64], [1, 4000, 8]], [[1, 2, 2]], [[1, 8, 8], [1, 100, 100], [1, 4100, 4]],
          [[1, 64, 64]], [[1, 8, 8]], [[1, 8, 8], [1, 8191, 8]], [[1, 64, 64]], [[1, 64, 64]], [[1, 8, 8]]]


def _images(st: Store, name: str, notes: bool):
    cols = {"conversions": NOTES, "has_mask": HAS_MASK, "img_shapes": SHAPES} if notes else \
        {"has_mask": HAS_MASK, "img_shapes": SHAPES}
    schema = TableSchema(name=name, lineage=Lineage("resize-bucket", config_hash=name, upstream={}, code_version="x"),
                         fields=[FieldSpec("target.png", "png", kind="file"),
                                 *(FieldSpec(c, "json", kind="column", optional=True) for c in cols)])
    w = st.writer(name, schema, shard_size_mb=0.0005)
    for i, k in enumerate(KEYS[:8]):  # the last two keys: stored rows the images lack
        w.add(k, files={"target.png": bytes([i]) * 100}, meta={c: v[i] for c, v in cols.items() if v[i] is not None})
    w.commit()
    return st.reader(name)


def _row_by_row(images, fixes, own_since: int | None, images_since: int | None):
    """stages/encode/plan.py `changed_by` as it was (before bench/fix_rules.py)."""
    def changed(row):
        if row["key"] not in images:
            return True
        meta = images.meta(row["key"])
        return any(rule(meta, row) for r, rule in fixes.own if own_since is not None and r >= own_since) or \
            any(rule(meta, row) for r, rule in fixes.by_images if images_since is not None and r >= images_since)
    return changed


def test_the_columnar_fix_rules_keep_exactly_the_rows_the_row_by_row_rule_keeps(tmp_path):
    st = Store(tmp_path / "store")
    readers = {"notes": _images(st, "images", True), "no notes column": _images(st, "images_old", False)}
    order = [6, 1, 9, 0, 7, 3, 2, 8, 5, 4]  # a version's rows are not in the images' order
    lengths = [10, 300, 4000, 8000, None, 4200, 1, 8200, 10, 10]
    rows = pa.table({"key": [KEYS[i] for i in order], "shard": ["s"] * 10,
                     "length": pa.array([lengths[i] for i in order], pa.int64())})
    # the empty prompt's stored length: the prompt's (encoded from caption '') or not
    empty = {"emptied": [5, 300, 3000, 8000, 2, None, 1, 8000, 10, 4], "read": [5] * 10}
    tables = {"one chunk": rows, "chunks": pa.concat_tables([rows.slice(0, 4), rows.slice(4)]),
              "without length": rows.drop_columns(["length"])}
    for case, lengths in empty.items():
        tables[f"empty length: {case}"] = rows.append_column("empty_length",
                                                             pa.array([lengths[i] for i in order], pa.int64()))
    fixes = {"vae": vae.FIXES, "text": text.FIXES, "vae21": qwen21.VAE_FIXES, "text21": qwen21.TEXT_FIXES}
    kept_somewhere = set()
    for name, images in readers.items():
        for fix_name, fix in fixes.items():
            for own, images_fix in ((1, None), (None, 1), (1, 1), (None, 2), (1, 2)):
                for case, table in tables.items():
                    want = [not _row_by_row(images, fix, own, images_fix)(r) for r in table.to_pylist()]
                    got = _unchanged(table, lambda t: changed_rows(images, fix, t, own, images_fix))
                    assert got.to_pylist() == table.filter(pa.array(want)).to_pylist(), \
                        (name, fix_name, own, images_fix, case)
                    kept_somewhere.add(got.num_rows)
    assert len(kept_somewhere) > 3  # the fixes separate these rows (not all kept, or none, everywhere)
    # e.g. the RGBA fix of the Edit encoders: every row noting an alpha picture, and the keys the images lack
    got = ~changed_rows(readers["notes"], vae.FIXES, rows, 1, None)
    assert [KEYS[i] for i, keep in zip(order, got) if keep] == [KEYS[i] for i in (6, 0, 2, 5, 4)]


def test_a_turned_mask_alone_changes_only_the_mask_of_a_vae_row(tmp_path):
    """encode-vae's rows the EXIF mask fix changed the mask of alone keep their latents (`ChangedRows.mask_alone`);
    one another fix changes too (an alpha picture under the RGBA fix), or one whose key the images lack, is
    changed beyond its mask (encoded whole)."""
    from stages.encode.plan import ChangedRows

    images = _images(Store(tmp_path / "store"), "images", True)
    rows = pa.table({"key": KEYS, "shard": ["s"] * 10})
    # [TURNED] alone: 2 (9 too, but the images lack its key); [ALPHA, TURNED]: 3, under vae's own RGBA fix too
    for fix, want in ((vae.FIXES, [2]), (qwen21.VAE_FIXES, [2, 3])):
        changed = ChangedRows(images, fix, own_since=1, images_since=1)
        beyond = changed.beyond_mask(rows)
        alone = ~beyond & changed.mask_alone(rows)
        assert [i for i in range(10) if alone[i]] == want
        assert list(changed(rows)) == list(beyond | alone) and beyond[8] and beyond[9]


def test_encode_text_redoes_a_copy_kept_instead_only_where_its_prompt_was_the_empty_one():
    """Revision 2 stored a copy kept instead of its rejected first copy with caption '': its prompt was the empty
    prompt (same length); a key whose first copy revision 2 kept (its mask refused now) was encoded from its caption."""
    kept, plain = {"conversions": [KEPT]}, {"conversions": []}
    assert prompt_was_emptied(kept, {"length": 12, "empty_length": 12})
    assert not prompt_was_emptied(kept, {"length": 15, "empty_length": 12})
    assert prompt_was_emptied(kept, {"length": 15}) and prompt_was_emptied(kept, {})  # unrecorded: cannot tell
    assert not prompt_was_emptied(plain, {"length": 12, "empty_length": 12})


def test_a_rule_reading_a_column_not_declared_is_refused(tmp_path):
    images = _images(Store(tmp_path / "store"), "images", True)
    rows = pa.table({"key": KEYS, "length": list(range(10))})
    undeclared = Fixes(by_images=((1, lambda meta, row: bool(meta.get("has_mask"))),), reads=("conversions",))
    with pytest.raises(KeyError, match="'has_mask', not among those declared"):
        changed_rows(images, undeclared, rows, own_since=None, images_since=1)
    with pytest.raises(KeyError, match="'key'"):
        changed_rows(images, Fixes(own=((1, lambda meta, row: row["key"] == ""),)), rows, 1, None)
    with pytest.raises(KeyError, match="'conversions'"):
        RowRule(mask_orientation_changes, ("has_mask",))(images.manifest)


def test_resize_mask_rule_over_columns_is_the_row_by_row_rule(tmp_path):
    images = _images(Store(tmp_path / "store"), "images", True)
    manifest = images.manifest
    for table in (manifest, pa.concat_tables([manifest.slice(0, 3), manifest.slice(3)]), manifest.slice(2)):
        want = [mask_orientation_changes(r) for r in table.to_pylist()]
        assert MASK_FIX(table).tolist() == want
    # a mask resized across an EXIF-turned target, and a mask whose row records no notes (cannot tell)
    flagged = manifest.column("key").filter(pa.array(MASK_FIX(manifest))).to_pylist()
    assert sorted(flagged) == [KEYS[4], KEYS[5]]


def test_codes_are_equal_exactly_where_the_values_are():
    values = [[[1, 2]], [[1, 2]], [[1], [2]], [[12]], None, [], [None], [[]], [[1, 2], None], [[1, 2]], [None],
              [[2, 1]]]
    col = pa.array(values, pa.list_(pa.list_(pa.int64())))
    for arr in (col, col.slice(3), pa.chunked_array([col.slice(0, 5), col.slice(5)])):
        c, py = codes(arr), arr.to_pylist()
        assert len(c) == len(py)
        assert all((c[i] == c[j]) == (py[i] == py[j]) for i in range(len(py)) for j in range(len(py)))
    strings = pa.array(["a", None, "a", "", "b"])
    assert (codes(strings)[[0, 1, 3]] != codes(strings)[[2, 2, 2]]).tolist() == [False, True, True]
    assert np.array_equal(codes(pa.array([True, None, False, True])) == 0, [True, False, False, True])


def test_resize_caption_rule_over_the_column_flags_exactly_the_captions_cleaning_changes():
    from stages.resize.caption_text import clean_caption
    from stages.resize.images_table import REVISION_3_FIX

    # as revision 2 stored them (decoded, BOM and outer whitespace off), and '' (a copy kept instead)
    captions = ["plain", "tab\there", "two\nlines", "crlf\r\nline", "lone\rcr", "\x1b[31mred\x1b[0m", "nul\x00byte",
                "del\x7f", "c1 \x85 next line", "bell\x07", "é 中 \u2028 separator", "emoji 🙂", ""]
    rows = pa.table({"caption": captions, "has_mask": [False] * len(captions),
                     "conversions": [[] for _ in captions]})
    want = [c == "" or clean_caption(c.encode()) != c for c in captions]
    assert REVISION_3_FIX(rows).tolist() == want
    assert REVISION_3_FIX(pa.concat_tables([rows.slice(0, 5), rows.slice(5)])).tolist() == want
    assert want.count(True) == 8
