"""Parquet sources: image-edit datasets published as parquet with the image bytes in columns (the layout of HF
datasets' `Image` feature, a `{bytes, path}` struct, or plain binary columns), read with pyarrow.

Which column holds what is `resize.columns` (target, references, instruction, optional mask). `references` names
one list column (0..N images per row) or several single-image columns (controls in that order; a null ends the
list, a null followed by an image is not contiguous). Read in row batches of the mapped columns only, so memory
is bounded by one row group of those columns (pyarrow decodes a row group's pages together; HF datasets writes
image datasets in row groups of 100 rows), never the whole file. Rows become `SourceSample`s that
the stage judges like every other format: a null or oversized image, a path without bytes, a non-text
instruction quarantines the row with the same reasons as a file would; a missing or mistyped mapped column is
the user's to fix (one UserError naming the column and the file). A local file whose read fails (EIO, EACCES: an
OSError with an errno, not pyarrow's "corrupt") is one `read-error` row for the rows not read (counting them), the
file marked unread (`_unread_rows`: a rerun reads it again), as a tar's samples are (webdataset_source.py).

Within `remembered_footers()` (one resize-bucket run) each file's footer is read once, shared by the bar's row
count, the column check and the reader (three reads before). A local file read for the first time is hashed from
the bytes its reader reads (hashed_parquet.py, first_read.py). A file at a URL is read a block at a time, by range
requests, as the object whose identity was asked (known_tars.KnownTars.still: the same sizes put again between two
blocks read on into the new bytes, rows of neither object): its footer read again through them, each sending the
ETag asked as If-Match over http(s) (412 for one put again; s3fs's file sends its own), its tag asked again after
its last row where no If-Match was sent (s3, a weak tag); put again, the run stops with one line (rerun).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from schemas.errors import UserError
from store.remote import is_transport_error, is_url

URL_BLOCK_BYTES = 8 << 20  # a parquet file at a URL is fetched by range requests of this size
BATCH_ROWS = 16  # rows converted to Python at a time: images are large, a few MB per row is common
MASK_COLUMN = "mask"  # resize.columns.mask unset: the column read as the edit mask where a file has it
_STORE_MARKER = "store.json"  # = store.format.STORE_JSON: a store kept inside the source is not read as data


def parquet_files(root: str | Path) -> list[Any]:
    """A `.parquet` file, or every `.parquet` under a folder (HF layout `data/train-*.parquet` included), by
    relative path; dot-folders and store folders inside the source are skipped. At a URL (`s3://...`): the file,
    or the `.parquet` objects under the prefix, as URL strings (read through fsspec: shards.py's file system)."""
    if is_url(root):
        return remote_parquet_files(str(root))
    from stages.resize.sources import refuse_no_file

    root = Path(root)
    if root.is_file():
        return [root]
    out = []
    for f in sorted(root.rglob("*.parquet")):
        rel = f.relative_to(root).parts
        if any(p.startswith(".") for p in rel):
            continue
        if any((root.joinpath(*rel[:i]) / _STORE_MARKER).exists() for i in range(len(rel))):
            continue
        if f.is_file():
            out.append(f)
        else:  # a folder is skipped (Spark's `x.parquet/`: its part files are listed); a link to nothing is refused
            refuse_no_file(root, [f], links=True)
    return out


def is_parquet_url(source: str) -> bool:
    """A parquet source at a URL: a `.parquet` object, or a prefix (no brace list, no `.tar`) holding `.parquet`
    objects and no `.tar` (then a webdataset prefix)."""
    if not is_url(source) or "::" in source or "{" in source:
        return False
    if source.endswith(".parquet"):
        return True
    if source.endswith(".tar") or not source.startswith(("s3://", "s3a://")):
        return False
    from stages.resize.shards import remote_fs, remote_source_errors

    fs, path = remote_fs(source)
    with remote_source_errors(source):
        names = fs.find(path.rstrip("/"))
    return any(n.endswith(".parquet") for n in names) and not any(n.endswith(".tar") for n in names)


def remote_parquet_files(url: str) -> list[str]:
    """The parquet file at `url`, or the `.parquet` objects under the prefix (dot-folders skipped), sorted."""
    from stages.resize.shards import remote_fs, remote_source_errors

    fs, path = remote_fs(url)
    scheme = url.split("://", 1)[0]
    with remote_source_errors(url):
        if url.endswith(".parquet"):
            fs.info(path)  # a missing file: one line naming it
            return [url]
        found = sorted(fs.glob(path.rstrip("/") + "/**/*.parquet"))
    base = path.rstrip("/") + "/"
    return [f"{scheme}://{name}" for name in found
            if not any(part.startswith(".") for part in name[len(base):].split("/"))]


def _open(path: Any, **match: Any) -> Any:
    """What pyarrow reads: a local path as it is; a URL as a random-access file of fsspec (range requests, so
    a footer or one row group's columns are fetched, never the whole object; `match`: shards.if_match's)."""
    if not is_url(path):
        return path
    from stages.resize.shards import remote_fs

    fs, p = remote_fs(path)
    return fs.open(p, "rb", block_size=URL_BLOCK_BYTES, **match)


@contextmanager
def _server_errors(path: Any) -> Iterator[None]:
    """At a URL, a lost connection is the server's or the network's, not the data's: one line (rerun), never a
    quarantined row; anything else (a corrupt file) goes on to the caller's quarantine."""
    try:
        yield
    except Exception as e:
        if not (is_url(path) and is_transport_error(e)):
            raise
        from stages.resize.shards import remote_source_errors

        with remote_source_errors(str(path)):  # store/remote.py's one line for a lost connection
            raise


_footers: dict[Any, Any] | None = None  # footer key -> pyarrow FileMetaData, within remembered_footers()


@contextmanager
def remembered_footers() -> Iterator[None]:
    """Footers read in this block are reused in it (one resize-bucket run)."""
    global _footers
    outer = _footers
    if _footers is None:
        _footers = {}
    try:
        yield
    finally:
        _footers = outer


def _footer(path: Any) -> Any:
    """The file's metadata (pyarrow FileMetaData), its footer read once within remembered_footers(): a local file
    by its path and stat (a file changed since is read anew), a URL by itself (its footer fetched once a run)."""
    import pyarrow.parquet as pq

    if is_url(path):
        key: Any = str(path)
    else:
        st = os.stat(path)
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if _footers is not None and key in _footers:
        return _footers[key]
    md = pq.read_metadata(_open(path))
    if _footers is not None:
        _footers[key] = md
    return md


def _stem(path: Any) -> str:
    return Path(str(path).rsplit("/", 1)[-1]).stem


def count_rows(root: str | Path) -> int:
    """Rows of every file, from the footers alone."""
    return sum(_footer(f).num_rows for f in parquet_files(root))


@dataclass
class _Layout:
    """The mapped columns of one file, checked against its schema."""

    target: str
    references: list[str]
    references_is_list: bool
    instruction: str
    mask: str | None

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.target, *self.references, self.instruction,
                                   *([self.mask] if self.mask else [])]))


def _is_image_type(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and _is_image_type(t.field("bytes").type)


def _layout(schema: Any, columns: Any, path: Path) -> _Layout:
    import pyarrow as pa

    names = schema.names

    def column(name: str, setting: str) -> Any:
        if name not in names:
            raise UserError(f"parquet source {path} has no column {name!r} (resize.columns.{setting}); its columns: "
                            f"{', '.join(names)}: set resize.columns.{setting} to the right one")
        return schema.field(name).type

    def image(name: str, setting: str, t: Any) -> None:
        if not _is_image_type(t):
            raise UserError(f"parquet source {path}: column {name!r} (resize.columns.{setting}) is {t}, not image "
                            "bytes (binary, or a {bytes, path} struct as HF datasets' Image); fix resize.columns")

    image(columns.target, "target", column(columns.target, "target"))
    refs = list(columns.references)
    ref_types = [column(r, "references") for r in refs]
    is_list = len(refs) == 1 and (pa.types.is_list(ref_types[0]) or pa.types.is_large_list(ref_types[0]))
    for r, t in zip(refs, ref_types):
        image(r, "references", t.value_type if is_list else t)
    t = column(columns.instruction, "instruction")
    t = t.value_type if pa.types.is_dictionary(t) else t  # pandas' `category` captions: text, read as such
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)):
        raise UserError(f"parquet source {path}: column {columns.instruction!r} (resize.columns.instruction) is {t}, "
                        "not text; fix resize.columns.instruction")
    return _Layout(columns.target, refs, is_list, columns.instruction, _file_mask(schema, columns, path))


def _file_mask(schema: Any, columns: Any, path: Path) -> str | None:
    """The file's mask column: the one resize.columns.mask names where the file has it (a file without it has no
    masks; a name no file has is refused by `_check_mask_found`), none for "", and unset (None) the column `mask`
    where the file has image bytes under that name and no other setting maps it."""
    if columns.mask == "":
        return None
    name = columns.mask if columns.mask is not None else MASK_COLUMN
    if name not in schema.names or columns.mask is None and name in (columns.target, *columns.references,
                                                                      columns.instruction):
        return None
    t = schema.field(name).type
    if not _is_image_type(t):
        if columns.mask is None:  # a column `mask` of flags or numbers is not an image: not read as one
            return None
        raise UserError(f"parquet source {path}: column {name!r} (resize.columns.mask) is {t}, not image bytes "
                        "(binary, or a {bytes, path} struct as HF datasets' Image); fix resize.columns.mask")
    return name


def _check_mask_found(layouts: dict, columns: Any) -> None:
    """A mask column set by name that no file holds is a typo: one line naming it (a file without it, among files
    with it, has no masks)."""
    read = [(p, lay) for p, lay in layouts.items() if isinstance(lay, _Layout)]
    if columns.mask and read and not any(lay.mask for _, lay in read):
        path = read[0][0]
        names = _footer(path).schema.to_arrow_schema().names
        raise UserError(f"parquet source {path} has no column {columns.mask!r} (resize.columns.mask), nor has any "
                        f"of its files; its columns: {', '.join(names)}: set resize.columns.mask to the right one, "
                        "or '' for no masks")


def _file_layouts(files: list[Any], columns: Any) -> dict[Any, _Layout | Exception]:
    """Every file's layout from its footer (a footer that could not be read: why, quarantined by the reader)."""
    import pyarrow as pa

    layouts: dict[Any, _Layout | Exception] = {}
    for path in files:
        try:
            with _server_errors(path):
                schema = _footer(path).schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as e:
            layouts[path] = e
            continue
        layouts[path] = _layout(schema, columns, path)
    _check_mask_found(layouts, columns)
    return layouts


def columns_in_force(root: str | Path, columns: Any) -> Any:
    """resize.columns as this source is read, for the version's lineage and the source-parquet note: an unset
    mask (None) becomes `mask` when a file holds that column as image bytes (else stays None, as stores made
    before this rule recorded it: those of a source without such a column stay current; those of one with it are
    rendered anew, their masked samples re-rendered, the rest carried)."""
    if columns.mask is not None:
        return columns
    layouts = _file_layouts(parquet_files(root), columns)
    found = any(isinstance(lay, _Layout) and lay.mask for lay in layouts.values())
    return columns.model_copy(update={"mask": MASK_COLUMN}) if found else columns


def unread_image_columns(root: str | Path, columns: Any) -> dict[str, int]:
    """Columns holding image bytes (or lists of them) that the mapping reads in no way -> files holding them: an
    image the stage never sees (a second control, a mask under another name) is named, not dropped unsaid. A
    binary column whose first values are no pictures (embeddings, say: `_holds_pictures`) is not named."""
    import pyarrow as pa

    files: dict[str, int] = {}
    pictures: dict[str, bool | None] = {}  # column -> whether its first values are pictures (None: none seen yet)
    for path, lay in _file_layouts(parquet_files(root), columns).items():
        if not isinstance(lay, _Layout):
            continue
        schema = _footer(path).schema.to_arrow_schema()
        for f in schema:
            t = f.type.value_type if pa.types.is_list(f.type) or pa.types.is_large_list(f.type) else f.type
            if f.name not in lay.names and _is_image_type(t):
                files[f.name] = files.get(f.name, 0) + 1
                if pictures.get(f.name) is None:
                    pictures[f.name] = _holds_pictures(path, f.name)
    # a column whose first row group held no value anywhere is named as before: it may hold pictures further on
    return {name: n for name, n in files.items() if pictures[name] is not False}


SNIFFED_VALUES = 4  # the first values of an unread binary column whose headers tell pictures from other bytes


def _holds_pictures(path: Any, name: str) -> bool | None:
    """Whether the first non-null values of column `name` (binary, {bytes, path} or a list of them) in the file's
    first row group are pictures (any of the first `SNIFFED_VALUES`, by their headers: features.decode.is_picture;
    nothing decoded); None where it holds none there or cannot be read (the reader says why where it reads)."""
    import pyarrow.parquet as pq

    from features.decode import is_picture

    values: list[bytes] = []
    try:
        with pq.ParquetFile(_open(path), metadata=_footer(path), buffer_size=1 << 20) as pf:
            if not pf.metadata.num_row_groups:
                return None
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[0], columns=[name]):
                for cell in batch.column(0).to_pylist():
                    for v in cell if isinstance(cell, list) else [cell]:
                        data = v.get("bytes") if isinstance(v, dict) else v
                        if data:
                            values.append(data)
                if len(values) >= SNIFFED_VALUES:
                    break
    except Exception:  # noqa: BLE001 - a summary's note: a file that does not read is the reader's to report
        return None
    return any(is_picture(v) for v in values[:SNIFFED_VALUES]) if values else None


def unread_columns_line(unread: dict[str, int], files: int) -> str:
    """The summary's line naming image columns no setting reads, and how to map them."""
    named = ", ".join(f"{c!r}" + (f" ({n} of {files} files)" if n != files else "") for c, n in sorted(unread.items()))
    return (f"parquet: column(s) {named} hold image bytes and are not read: map a control with resize.columns."
            "references (e.g. [control, control_2]), an edit mask with resize.columns.mask; or leave them unread")


class _Problem(Exception):
    def __init__(self, message: str, kind: str = "bad-source") -> None:
        super().__init__(message)
        self.kind = kind


def _image_bytes(cell: Any, what: str, max_bytes: int) -> bytes:
    """The bytes of one image cell (binary, or HF's {bytes, path}); `_Problem` naming the reason otherwise."""
    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if data is None:
        path = cell.get("path") if isinstance(cell, dict) else None
        if path:  # HF datasets may store only a path to a file elsewhere: never read where data points
            raise _Problem(f"{what} has no bytes, only a path ({path!r}): not read; publish the images embedded "
                           "(datasets: Image() feature, push_to_hub / to_parquet embed them)")
        raise _Problem(f"{what} is null")
    if len(data) > max_bytes:
        raise _Problem(f"{what} is {len(data)} bytes, over resize.max_file_bytes ({max_bytes})", "file-too-large")
    return bytes(data)


def _sample(row: dict[str, Any], lay: _Layout, path: Path, no: int, max_bytes: int):
    from stages.resize.sources import SourceSample

    where = f"{path}:{no}"
    s = SourceSample(name=f"{_stem(path)}:{no}", source=where)
    try:
        s.target = _image_bytes(row[lay.target], f"target (column {lay.target!r})", max_bytes)
        s.files.append(f"{where}[{lay.target}]")
        if lay.references_is_list:
            col = lay.references[0]
            cells = [(f"{col}[{i}]", c) for i, c in enumerate(row[col] or [])]
        else:
            cells = [(c, row[c]) for c in lay.references]
            present = [i for i, (_, c) in enumerate(cells) if c is not None]
            if present != list(range(len(present))):
                raise _Problem(f"control columns for this row are not contiguous from {lay.references[0]!r}: "
                               f"found indices {present}")
            cells = cells[:len(present)]
        for i, (name, cell) in enumerate(cells):
            s.controls.append(_image_bytes(cell, f"control {i} (column {name!r})", max_bytes))
            s.files.append(f"{where}[{name}]")
        if lay.mask and row[lay.mask] is not None:
            s.mask = _image_bytes(row[lay.mask], f"mask (column {lay.mask!r})", max_bytes)
            s.files.append(f"{where}[{lay.mask}]")
    except _Problem as e:
        s.problem, s.problem_kind = str(e), e.kind
        return s
    text = row[lay.instruction]
    s.caption = text.encode("utf-8") if isinstance(text, str) else (bytes(text) if text is not None else None)
    return s


def iter_parquet(root: str | Path, columns: Any, max_file_bytes: int, known: Any = None,
                 done: Any = None) -> Iterator[Any]:
    """One `SourceSample` per row of every file, in file then row order. `known` (known_tars.KnownTars of this
    source's files): a local file unchanged since the newest version, every row of it there, is not read (its
    footer aside): its rows are yielded with `known`; each file read whole is recorded in it (hash, rows). `done`
    (resumed_sources.ResumedSources of a resumed version): rows a read error keeps from being read that it holds
    are yielded as written (`_unread_rows`); the rows read are looked up by the stage."""
    from schemas.config import ParquetColumns
    from stages.resize.sources import SourceSample

    columns = columns if columns is not None else ParquetColumns()
    files = parquet_files(root)
    layouts = _file_layouts(files, columns)  # every file's mapping checked from its footer before a row is read
    for path in files:
        lay = layouts[path]
        carried = known.unchanged(str(path)) if known is not None and isinstance(lay, _Layout) else None
        if carried is not None:
            sha, rows = carried
            at_url = is_url(path)  # read as the object judged: known_tars.KnownTars.still, .match
            groups = _RowGroups(path, lay, max_file_bytes, partial(known.still, str(path), sha) if at_url else None,
                                known.match(str(path)) if at_url else None)
            for source, hit in rows:
                no = int(source[len(str(path)) + 1:])
                yield SourceSample(name=f"{_stem(path)}:{no}", source=source, known=hit,
                                   reread=partial(groups.row, no), heads=partial(groups.heads, no))
            groups.confirm()  # a URL's object not put again while its row groups were read by the footer's offsets
            known.note(str(path), sha, len(rows))
            continue
        if known is not None and str(path) in known.pending:  # read for the first time: hashed as it is read
            yield from _hashed_file(path, layouts, max_file_bytes, known, done)
            continue
        before = known.identity(str(path)) if known is not None else None
        # at a URL read as the object its identity names (If-Match; without one, its tag asked after its last row):
        # its blocks are fetched one range after another, and one put again between them was read on into new bytes
        still = partial(known.still, str(path), before) if before is not None and is_url(path) else None
        match = known.match(str(path)) if still is not None else None  # a strong ETag as If-Match: 412 if put again
        yielded, failed = 0, False
        for s in _file_samples(path, layouts, max_file_bytes, done=done, still=still, match=match):
            yielded, failed = yielded + 1, failed or s.problem_kind == "read-error"
            yield s
        if not match:  # no If-Match sent (s3, a weak tag): only asking again says every row was that object's
            _refuse_if_put_again(path, still, "row groups")
        # not changed while read, and read whole (a read error: not noted, so a rerun reads it again)
        if before is not None and not failed and (still is not None or known.identity(str(path), fresh=True) == before):
            known.note(str(path), before, yielded)


def _refuse_if_put_again(path: Any, still: Any, read: str) -> None:
    """A file at a URL read by a footer's offsets as the object judged (`still`: is it still that one, one metadata
    request; None: a local file, nothing to ask): one put again meanwhile stops the run (pages carry no checksum:
    old offsets into new bytes make rows of neither object), picture_heads.refuse_put_again."""
    if still is not None and not still():
        from stages.resize.picture_heads import refuse_put_again

        refuse_put_again(str(path), "parquet file", read)


@contextmanager
def _judged(path: Any, still: Any, read: str) -> Iterator[None]:
    """Reads of a file at a URL as the object judged (`still`): one that fails otherwise than by a lost connection
    (a 412 for its If-Match, bytes that do not read as parquet) stops the run with the put-again line where the
    object is not that one any more, not a corrupt row; else the error goes on as it is."""
    try:
        yield
    except Exception as e:
        if still is not None and not is_transport_error(e):
            _refuse_if_put_again(path, still, read)
        raise


def _hashed_file(path: Path, layouts: dict, max_file_bytes: int, known: Any, done: Any = None) -> Iterator[Any]:
    """A local file's rows, its sha256 taken from the same bytes (hashed_parquet.py): noted as read, and kept for
    the cache, when it was read whole and is unchanged since its read began (first_read.py)."""
    from stages.resize.first_read import file_stamp
    from stages.resize.hashed_parquet import HashedParquet

    started = time.time_ns()  # the file-hash cache judges a whole-second stamp by it (models/file_hashes.RACY_NS)
    before = file_stamp(path)
    try:
        stream = HashedParquet(path)
    except OSError as e:
        yield from _unopened(path, e, done)
        return
    yielded, failed = 0, False
    with stream:
        for s in _file_samples(path, layouts, max_file_bytes, stream, done):
            yielded, failed = yielded + 1, failed or s.problem_kind == "read-error"
            yield s
        try:  # after a read error the digest is no file's: the rest is not read for nothing
            if not failed:
                stream.finish()  # the bytes no batch read (unmapped columns, the footer): the whole file's hash
        except OSError:  # shortened while read, or a read error: not whole, not noted (read again next run)
            pass
    digest = stream.digest()
    if digest is not None and not failed and before is not None and file_stamp(path) == before:
        known.streamed[str(path)] = (digest, os.stat(path), started)
        known.note(str(path), digest, yielded)


class _RowGroups:
    """The rows of a file carried unread that are read after all: for their pictures' header checks (`heads`: a
    lowered resize.max_image_pixels, a transparent colour since revision 4, header_checks.py) or to be judged from
    their bytes (`row`). Each from its row group's mapped columns alone, the last group kept for the rows after it
    (one row group held, the reader's own bound): the rows of a group checked one after another read it once.
    Before, a file holding one row to check was read whole, every row of it judged from its bytes.

    A file at a URL (`still`, `match`: known_tars.KnownTars's) is read by the offsets of the footer read when it was
    judged: its row groups' range reads send the judged object's strong ETag as If-Match over http(s) (a server
    answers 412 for one put again), and its tag is asked once more after its last row (`confirm`), as a carried
    tar's is (a file read the first time: only where no If-Match was sent, `iter_parquet`)."""

    def __init__(self, path: Path, lay: _Layout, max_file_bytes: int, still: Any = None,
                 match: dict[str, Any] | None = None) -> None:
        self._path, self._lay, self._max, self._still, self._match = path, lay, max_file_bytes, still, match or {}
        self._group: tuple[int, int, Any] | None = None  # (first row, end row, its mapped columns)
        self._by_offsets = False  # a row group read by the footer's offsets: `confirm` asks the tag again

    def confirm(self) -> None:
        """After a URL file's last row: where a row group was read by the footer's offsets, one metadata request
        says the object is still the one judged (put again meanwhile: old offsets into new bytes, pages carry no
        checksum, so rows of neither version; the run stops, picture_heads.refuse_put_again)."""
        if self._by_offsets:
            _refuse_if_put_again(self._path, self._still, "row groups by its footer's offsets")

    def heads(self, no: int) -> Any:
        """The row's pictures' first bytes (header_checks.Heads); None for a row that does not read as a sample
        (judged from its bytes instead, which names why)."""
        from stages.resize.header_checks import heads_of

        s = self.row(no)
        return None if s.problem is not None else heads_of(s)

    def row(self, no: int) -> Any:
        from stages.resize.sources import SourceSample, is_read_error

        path = self._path
        try:
            group = self._group if self._group is not None and self._group[0] <= no < self._group[1] else \
                self._read_group(no)
            if group is not None:
                self._group = group
                row = group[2].slice(no - group[0], 1).to_pylist()[0]
                return _sample(row, self._lay, path, no, self._max)
        except (OSError, ValueError) as e:  # pyarrow's errors are OSError / ValueError (ArrowInvalid)
            if is_read_error(path, e):
                return next(_unread_rows(path, no, no + 1, e))
            return SourceSample(name=f"{_stem(path)}:{no}", source=f"{path}:{no}", problem=f"cannot read row {no} "
                                f"of {path} again (it changed while this run read it?): {e}; rerun")
        return SourceSample(name=f"{_stem(path)}:{no}", source=f"{path}:{no}", problem=f"row {no} is no longer in "
                            f"{path} (the file changed while this run read it); rerun")

    def _read_group(self, no: int) -> tuple[int, int, Any] | None:
        self._by_offsets = True
        with _judged(self._path, self._still, "row groups by its footer's offsets"):  # a 412: the one line
            return self._group_of(no)

    def _group_of(self, no: int) -> tuple[int, int, Any] | None:
        import pyarrow.parquet as pq

        with pq.ParquetFile(_open(self._path, **self._match), metadata=_footer(self._path)) as pf:
            first = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if no < first + n:
                    return first, first + n, pf.read_row_group(g, columns=self._lay.names)
                first += n
        return None


def _file_samples(path: Any, layouts: dict, max_file_bytes: int, hashed: Any = None, done: Any = None,
                  still: Any = None, match: dict[str, Any] | None = None) -> Iterator[Any]:
    """Every row of one file, read in batches of its mapped columns; through `hashed` (hashed_parquet.HashedParquet)
    when given, told after each batch which bytes no later batch reads. A file at a URL read as the object judged
    (`still`, `match`: `iter_parquet`'s): its footer read again through those reads (the one remembered may be of
    an object put again before it was judged), a read failing on one put again the put-again line (`_judged`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.resize.sources import SourceSample, is_read_error

    lay = layouts[path]
    if isinstance(lay, Exception):  # its footer could not be read: one row for the file
        yield from _unopened(path, lay, done)
        return
    try:
        # buffered column-chunk reads: a row group's chunk is streamed, not read whole before decoding
        with _server_errors(path), _judged(path, still, "footer"):
            pf = pq.ParquetFile(hashed if hashed is not None else _open(path, **(match or {})), buffer_size=8 << 20,
                                metadata=_footer(path) if still is None else None, pre_buffer=False)
            md = pf.metadata
        starts = _group_starts(md) if hashed is not None and md.num_row_groups else None
    except (pa.ArrowException, OSError) as e:
        yield from _unopened(path, e, done)
        return
    with pf, _server_errors(path):
        no = 0
        try:
            with _judged(path, still, "row groups"):
                for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=lay.names):
                    for row in batch.to_pylist():
                        yield _sample(row, lay, path, no, max_file_bytes)
                        no += 1
                    if starts:  # the next batch starts in the last row group beginning at or before row `no`
                        hashed.release(starts[1][bisect.bisect_right(starts[0], no) - 1])
        except (pa.ArrowException, OSError) as e:
            if is_url(path) and is_transport_error(e):
                raise
            if is_read_error(path, e):  # the disk's, not the data's: this row and every later one not read
                yield from _unread_rows(path, no, md.num_rows, e, done)
                return
            yield SourceSample(name=f"{_stem(path)}:{no}", source=f"{path}:{no}",
                               problem=f"parquet file is truncated or corrupt from row {no} on: {e}")


def _held(path: Any, first: int, end: int, done: Any) -> Iterator[Any]:
    """The rows [first, end) of `path` a resumed version (`done`) holds, yielded as written (`done_key`: kept,
    counted as resumed, their bytes not read); returns their row numbers (sorted)."""
    from stages.resize.resumed_sources import held_rows
    from stages.resize.sources import SourceSample, printable

    held, keys = held_rows(done, f"{printable(str(path))}:", first, end)
    for no, key in zip(held.tolist(), keys):
        yield SourceSample(name=f"{_stem(path)}:{no}", source=f"{path}:{no}", done_key=key)
    return held


def _unopened(path: Any, e: BaseException, done: Any = None) -> Iterator[Any]:
    """One row for a file whose footer (or the file itself) could not be read: its rows are not known. A read
    error's: the rows a resumed version holds (`done`) first, as written (kept, as `_unread_rows` keeps them)."""
    from stages.resize.sources import READ_ERROR_HINT, SourceSample, is_read_error

    if is_read_error(path, e):
        yield from _held(path, 0, 1 << 62, done)
        yield SourceSample(name=_stem(path), source=str(path), problem_kind="read-error", unread=str(path),
                            problem=f"parquet file {path} could not be read (how many rows it holds is not known): "
                            f"{e.strerror or e} (errno {e.errno}); {READ_ERROR_HINT}")  # type: ignore[attr-defined]
    else:
        yield SourceSample(name=_stem(path), source=str(path), problem=f"cannot open parquet file: {e}")


def _unread_rows(path: Any, first: int, end: int, e: OSError, done: Any = None) -> Iterator[Any]:
    """The `read-error` record of rows [first, end) of `path` a read error kept from being read (the file marked
    unread: a rerun reads it again and adds them): one record for the range, however many rows (an early failure in a
    million-row file was a million quarantine rows), named `path:first-last` and counting them (`samples`).
    `done` (a resumed run's version, resumed_sources.py): the rows it holds, written before this run failed
    earlier than the interrupted one, are yielded as written (`done_key`: kept, counted as resumed), and the record
    covers the others only (before, they were counted as unread while the version kept them)."""
    import numpy as np

    from stages.resize.sources import READ_ERROR_HINT, SourceSample

    held = yield from _held(path, first, end, done)
    left, at = end - first - len(held), first
    if left <= 0:
        return
    if len(held):  # the range from the first row not held to the last (rows held inside it are not counted)
        steps = np.arange(len(held))
        before, after = np.flatnonzero(held != first + steps), np.flatnonzero(held[::-1] != end - 1 - steps)
        first, end = first + (int(before[0]) if len(before) else len(held)), \
            end - (int(after[0]) if len(after) else len(held))
    why = f"{e.strerror or e} (errno {e.errno}); {READ_ERROR_HINT}"
    if left == 1:
        yield SourceSample(name=f"{_stem(path)}:{first}", source=f"{path}:{first}", problem_kind="read-error",
                           unread=str(path), problem=f"row {first} of parquet file {path} could not be read: {why}")
        return
    kept = end - first - left
    yield SourceSample(name=f"{_stem(path)}:{first}-{end - 1}", source=f"{path}:{first}-{end - 1}",
                       problem_kind="read-error", unread=str(path), samples=left,
                       problem=f"rows {first} to {end - 1} ({left} rows"
                       f"{f'; {kept} others among them kept from the interrupted run' if kept else ''}) of parquet "
                       f"file {path} not read (the read error at row {at}): {why}")


def _group_starts(md: Any) -> tuple[list[int], list[int]]:
    """The first row and the first byte (its column chunks' lowest page offset) of each row group."""
    rows, firsts, row = [], [], 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        chunks = [rg.column(i) for i in range(rg.num_columns)]
        firsts.append(min(min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset)
                          if c.has_dictionary_page else c.data_page_offset for c in chunks) if chunks else 0)
        rows.append(row)
        row += rg.num_rows
    return rows, firsts
