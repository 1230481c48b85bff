"""The resize settings each complete `images` version's schema records, read once per rerun for the limits that
judge carried rows (pixel_limit.py, frame_limit.py): each version's schema.json is read and checked against its
checksums.json once, not once per limit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store import Store

TABLE = "images"


def recorded_resize(st: Store) -> dict[int, dict[str, Any] | None]:
    """version -> the `resize` settings a complete version's schema.json records ({} where it records none; None
    where it does not read: damaged or failing its checksum, so what it records is unknown). Checked: a flipped
    digit that still parses would name another limit."""
    from schemas import UserError
    from store import format as fmt
    from store.manifest_files import checked_schema

    recorded: dict[int, dict[str, Any] | None] = {}
    for v in st.versions(TABLE):
        vdir = st.version_dir(TABLE, v)
        if not fmt.is_complete(vdir):
            continue
        try:
            resize = checked_schema(vdir).attrs.get("resize")
        except UserError:  # unreadable or damaged: nothing is carried from it (store/reuse.py)
            recorded[v] = None
            continue
        recorded[v] = resize if isinstance(resize, dict) else {}
    return recorded
