"""`store repair URL` and `migrate v1-to-v2 URL`: the local command on a working copy, then push's commit.

The working copy is `<cache dir>/.work/<hash of the URL>/` (beside the readers' cache, not in it: a dot folder
holds no store.json, so cache eviction never touches it, and a reader never sees a version repair is still
writing). It holds each table's current version whole - what repair scans and recomputes from, and what migrate
rewrites - pulled with every object checked; for repair, an object that fails its check is kept as it is
(`damaged_ok`), for repair's scan to find. Every other complete remote version is there as a lazily cached copy
(its metadata only, store/remote_shards.py): new version numbers are then chosen above every one the remote has,
and push skips such copies. Where that open fails (an older version's metadata damaged), every version is pulled
whole, as before: at terabytes the difference is the non-current versions' shards never crossing the network. The local command then runs there with all its guarantees (writer
locks, manifest-last commit, verify before set-aside), and `publish` pushes the result back with push's protocol:
write-once objects, each version's manifest last, store.json by compare-and-swap. So a killed repair/migrate
leaves nothing visible on the remote; a rerun pulls nothing new and resumes in the working copy; two of them
racing for the same new version number cannot both commit (the manifest is a conditional PUT).

What repair records locally (`v<N>.damaged.json`, the damaged folder set aside) is mirrored on the remote after
the new version is current: the marker object `<table>/v<N>.damaged.json` (pull and verify skip a marked
version), then the old version's manifest is deleted - unless a live lease object names it (a reader still on
it): then it stays until `store gc URL` finds it unheld. The working copy is removed once published.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any, Callable

from schemas.errors import UserError
from store import format as fmt
from store import remote_lease
from store.remote import open_remote, remote_errors

WORK_DIR = ".work"


def work_copy(url: str, cache_dir: str | Path | None, damaged_ok: bool = False,
              storage_options: dict[str, Any] | None = None) -> Path:
    from store.remote_cache import default_cache_dir, recount
    from store.remote_shards import open_lazily
    from store.remote_sync import pull

    url = url.rstrip("/")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = cache / WORK_DIR / hashlib.sha256(url.encode()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    tables = _remote_tables(url, storage_options)
    pull(url, root, storage_options, tables=tables, damaged_ok=damaged_ok)
    if tables is not None:
        try:
            # not a version a killed repair replaced here already (it awaits its retirement on the remote)
            open_lazily(url, root, storage_options, None, skip=lambda t, v: fmt.damaged_marker(root, t, v).exists(),
                        damaged_ok=damaged_ok)
        except UserError:  # (DamagedData too) an older version's metadata damaged (or its manifest pulled damaged)
            pull(url, root, storage_options, damaged_ok=damaged_ok)
    recount(cache)  # whole versions just landed in the cache folder: its limited readers count them from now
    (root / "source-url.txt").write_text(url + "\n")
    return root


def _remote_tables(url: str, storage_options: dict[str, Any] | None) -> list[str] | None:
    """The tables the remote's store.json names; None without one (pull then says so)."""
    from store.remote_sync import _parse_record

    remote = open_remote(url, storage_options)
    with remote_errors(url, "open"):
        try:
            return sorted(_parse_record(remote.read(fmt.STORE_JSON), url)["tables"])
        except FileNotFoundError:
            return None


def replaced_here(root: Path) -> list[tuple[str, int]]:
    """The versions repair replaced in the working copy, this run or a killed earlier one: marked damaged and set
    aside (no longer a version there); the remote has yet to retire them."""
    out = []
    for marker in sorted(root.glob("*/v*.damaged.json")):
        table, v = marker.parent.name, int(marker.name.split(".")[0][1:])
        if not fmt.is_complete(fmt.version_dir(root, table, v)):
            out.append((table, v))
    return out


def publish(url: str, root: Path, replaced: list[tuple[str, int]], echo: Callable[[str], None] = print,
            storage_options: dict[str, Any] | None = None, damaged: bool = True) -> None:
    """Push the working copy's new versions, made current only where the remote's current versions are still
    the `replaced` ones (store.json's compare-and-swap); then, for repair (`damaged`), retire the replaced ones."""
    from store.remote_sync import marker_rel, push

    url = url.rstrip("/")
    echo(str(push(root, url, storage_options, replacing=dict(replaced), set_aside_quarantine=damaged)))
    if not damaged:
        shutil.rmtree(root, ignore_errors=True)
        return
    remote = open_remote(url, storage_options)
    with remote_errors(url, "repair"):
        for table, v in replaced:
            fmt.crash_point("repair_before_retire")
            marker = fmt.damaged_marker(root, table, v)
            if marker.is_file():
                remote.write(marker_rel(table, v), marker.read_bytes())
            listing = remote.listing_times(remote_lease.LEASES_DIR)  # the leases only, not the whole prefix
            readers = [f.describe() for f in remote_lease.leases(remote, listing)
                       if f.live and (table, v) in set(f.versions())]
            if readers:
                echo(f"{url}: the damaged {table} v{v} is still read by {'; '.join(readers)}: left in place (not "
                     f"current, marked damaged); `pipeline store gc {url}` removes it once no reader holds it")
                continue
            remote.delete([f"{table}/v{v}/{fmt.MANIFEST}"])  # the version stops existing; gc takes the rest
            echo(f"{url}: the damaged {table} v{v} was retired (marked damaged, its manifest deleted; "
                 f"`pipeline store gc {url}` removes its other objects)")
    shutil.rmtree(root, ignore_errors=True)
