"""`store repair URL` over a damaged `store.json` at the URL: rebuilt from the versions there, as `store repair`
rebuilds a local store's (store/repair.py `_current_versions`: each table -> its newest intact complete version),
before the rest of the repair, which opens the store through it.

A version at the URL is complete once its manifest object is there (push uploads it last) and not marked damaged
(`<table>/v<N>.damaged.json`, a repair's retirement); it is intact when its checksums.json reads and its schema.json
and manifest.parquet match it (fetched into a temporary folder and judged by repair's own check). One listing of
the prefix; the new record replaces the damaged bytes by compare-and-swap, so a record another command wrote
meanwhile is left as it is."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from store import format as fmt
from store import remote_endpoint
from store.checksum import SealError, seal, unseal
from store.remote import Remote, open_remote, remote_errors
from store.remote_sync import _MANIFEST_RE, marker_rel

_VERSION_FILES = (fmt.CHECKSUMS, fmt.SCHEMA_JSON, fmt.MANIFEST)


def rebuild_damaged_record(url: str, dry_run: bool = False, echo: Callable[[str], None] = print,
                           storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the URL's store.json was damaged (and, unless `dry_run`, is rebuilt now). Intact or absent: False,
    nothing read but it. UserError where no table version is there to rebuild it from."""
    url = url.rstrip("/")
    remote = open_remote(url, storage_options)
    with remote_errors(url, "repair"):
        try:
            old = remote.read(fmt.STORE_JSON, small=True)
        except FileNotFoundError:
            return False
        if (why := _damage(old, url)) is None:
            return False
        current = _current_at(remote)
        if not current:
            raise UserError(f"{url} is not a store: its {fmt.STORE_JSON} {why}, and it holds no table versions to "
                            "rebuild it from; pass the URL a store was pushed to")
        echo(f"{fmt.STORE_JSON}: {why} -> rebuilt naming "
             + ", ".join(f"{t} v{v}" for t, v in sorted(current.items())) + " (newest intact versions)")
        if dry_run:
            return True
        rec = fmt.new_store_record()
        rec["tables"] = {t: {"current": v} for t, v in current.items()}
        new = seal({**rec, "format_version": fmt.STORE_FORMAT_VERSION})
        remote.swap(fmt.STORE_JSON, lambda now: new if now == old else None)  # changed meanwhile: theirs stays
    echo(f"{fmt.STORE_JSON} rebuilt")
    return True


def _damage(data: bytes, url: str) -> str | None:
    """Why store.json's bytes do not read as a store record (its seal, its fields); None when they do. A newer
    release's intact record: `WrittenByNewer`, as everywhere."""
    try:
        rec = unseal(data)
    except SealError as e:
        if (line := remote_endpoint.not_s3(url)) is not None:  # a web page read as its bytes: no store to rebuild
            raise UserError(line) from None
        return f"is damaged ({e})"
    try:
        fmt.check_store_record(rec, f"{url}/{fmt.STORE_JSON}")
    except WrittenByNewer:  # not damage: a newer release's record, never rewritten in this format
        raise
    except UserError as e:
        return f"does not read ({e})"
    return None


def _current_at(remote: Remote) -> dict[str, int]:
    """{table: its newest intact complete version at the URL (else its newest complete one)}."""
    listing = remote.listing()
    done: dict[str, list[int]] = {}
    for rel in listing:
        if (m := _MANIFEST_RE.fullmatch(rel)) and marker_rel(m[1], int(m[2])) not in listing:
            done.setdefault(m[1], []).append(int(m[2]))
    with tempfile.TemporaryDirectory(prefix="store-json-rebuild-") as tmp:
        return {t: next((v for v in sorted(vs, reverse=True) if _intact_at(remote, t, v, Path(tmp))), max(vs))
                for t, vs in sorted(done.items())}


def _intact_at(remote: Remote, table: str, version: int, tmp: Path) -> bool:
    """Do the version's checksums.json, schema.json and manifest.parquet at the URL read and match?"""
    from store.repair import _intact_version

    vdir = tmp / table / f"v{version}"
    vdir.mkdir(parents=True)
    try:
        for name in _VERSION_FILES:
            remote.download(f"{table}/v{version}/{name}", vdir / name, _NoBar())
    except FileNotFoundError:
        return False
    return _intact_version(vdir)


class _NoBar:
    def update(self, n: int) -> None:
        pass

