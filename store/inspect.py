"""`pipeline store inspect`: what a store holds (tables, versions, samples, buckets, bytes, lineage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping

from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from schemas.resize_sizes import sizes_in_force
from schemas.units import count_text, size_text
from store import format as fmt
from store import integrity, quarantine, version_counts
from store.integrity import DamagedData
from store.manifest_files import checked_manifest, checked_schema, mapped_checked
from store.store import Store


def describe(root: Path, manifests_at_url: Collection[Path] = (),
             damaged_at_url: Mapping[Path, str] | None = None) -> dict[str, Any]:
    """`manifests_at_url`: version folders of a URL's metadata copy whose manifest was not fetched
    (store/remote_view.py: their counts are recorded, the manifest's listed size matched the sealed record);
    `damaged_at_url`: those whose metadata at the URL is damaged, with the line naming it."""
    damaged_at_url = damaged_at_url or {}
    st = Store(root, create=False)
    current = st.tables()
    out: dict[str, Any] = {"store": str(root), "format": fmt.STORE_FORMAT, "format_version": fmt.STORE_FORMAT_VERSION,
                           "tables": {}}
    names = sorted(set(current) | {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")})
    for table in names:
        vdirs = {v: st.version_dir(table, v) for v in st.versions(table)}
        versions = [{"version": v, "complete": True, "damaged": damaged_at_url[vdir]} if vdir in damaged_at_url
                    else _describe_version(vdir, v, vdir in manifests_at_url) for v, vdir in vdirs.items()]
        out["tables"][table] = {"current": current.get(table), "versions": versions}
    q = quarantine.read(root)
    by_reason = quarantine.samples_by_reason(q)  # samples: a row may stand for several (quarantine.SAMPLES)
    out["quarantine"] = {"rows": q.num_rows, "samples": sum(by_reason.values()), "by_reason": by_reason}
    return out


def _describe_version(vdir: Path, v: int, manifest_at_url: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"version": v, "complete": manifest_at_url or fmt.is_complete(vdir)}
    record = None  # checksums.json, read once (megabytes at 1M samples): the schema's check, then the counts
    if (vdir / fmt.SCHEMA_JSON).is_file() or d["complete"]:
        try:  # checked, as the manifest: a flipped bit would show another lineage
            record = integrity.read_version_record(vdir)
            schema = checked_schema(vdir, record=False, sums=None if record is None else record["files"])
            d.update(schema_version=schema.schema_version, lineage=schema.lineage.to_dict(), attrs=schema.attrs)
        except WrittenByNewer:
            raise
        except UserError as e:  # named, as a damaged manifest is: one version's damage does not stop the report
            if d["complete"]:
                d["damaged"] = str(e)
                return d
    if not d["complete"]:
        committed = list(vdir.glob("shard-r*-*.index.parquet"))
        d["committed_shards"] = len(committed)
        return d
    try:
        d.update(_counts(vdir, record, manifest_at_url))
    except DamagedData as e:  # inspect describes a damaged store too: the damage, named, instead of its numbers
        d["damaged"] = str(e)
    return d


def _counts(vdir: Path, record: dict[str, Any] | None, manifest_at_url: bool = False) -> dict[str, Any]:
    """Samples, shards, bytes, splits and buckets: as recorded in the version's sealed checksums.json when it was
    committed (a few numbers), else counted from its manifest's columns (versions committed before the record;
    format 1). Either way the manifest's bytes are checked, so a damaged one is named as before (a read of the
    file, never its columns decoded: bench/inspect_counts.py) - except a URL's, left there (`manifest_at_url`: its
    listed size checked, its bytes `store verify`'s). `record`: its checksums.json (None: format 1)."""
    if record is not None and (recorded := version_counts.shown(record.get("counts"))) is not None:
        if not manifest_at_url:
            mapped_checked(vdir, fmt.MANIFEST, record["files"])
        return recorded
    m = checked_manifest(vdir, list(version_counts.COUNTED))  # the counted columns alone: nested lists left unread
    return version_counts.shown(version_counts.counted(m)) or {}


def render(info: dict[str, Any]) -> str:
    lines = [f"store {info['store']} ({info['format']} v{info['format_version']})"]
    if not info["tables"]:
        lines.append("  no tables")
    for table, t in info["tables"].items():
        lines.append(f"  {table}: current v{t['current']}")
        for v in t["versions"]:
            mark = "*" if v["version"] == t["current"] else " "
            if not v["complete"]:
                shards = count_text(v.get("committed_shards", 0), "shard")
                lines.append(f"   {mark} v{v['version']}: incomplete ({shards} committed)")
                continue
            if "damaged" in v:
                lines.append(f"   {mark} v{v['version']}: damaged: {v['damaged']}")
                continue
            lines.append(f"   {mark} v{v['version']}: schema v{v['schema_version']}, "
                         f"{count_text(v['samples'], 'sample')}, {count_text(v['shards'], 'shard')}, "
                         f"{size_text(v['bytes'])}"
                         + (f", splits {_in_order(v['splits'])}" if "splits" in v else ""))
            if v["buckets"]:
                lines.append("       buckets: " + ", ".join(f"{b} ({n})" for b, n in v["buckets"].items()))
            if v.get("control_buckets"):
                lines.append("       control buckets (VAE view): "
                             + ", ".join(f"{b} ({n})" for b, n in v["control_buckets"].items()))
            resize = (v.get("attrs") or {}).get("resize")
            if isinstance(resize, dict) and {"target_area", "control_vae_area", "control_vl_area"} <= resize.keys():
                lines.append(f"       {sizes_in_force(resize)}")
            lin = v["lineage"]
            lines.append(f"       lineage: stage {lin['stage']}, config {lin['config_hash']}, "
                         f"model {lin['model_fingerprint'][:12] or '-'}, upstream {lin['upstream'] or '-'}, "
                         f"code {lin['code_version'] or '-'}")
    q = info["quarantine"]
    samples = q.get("samples", q["rows"])
    lines.append(f"  quarantine: {count_text(q['rows'], 'row')}"
                 + (f" ({count_text(samples, 'sample')})" if samples != q["rows"] else "")
                 + (f" {q['by_reason']} (each file's reason and detail: {info['store'].rstrip('/')}/"
                    f"{fmt.QUARANTINE})" if q["rows"] else ""))
    return "\n".join(lines)


def _in_order(splits: dict[str, int]) -> dict[str, int]:
    """train, then val, then any other: the manifest's order of first appearance put val first in one store and
    train first in the next."""
    order = {"train": 0, "val": 1}
    return dict(sorted(splits.items(), key=lambda kv: (order.get(kv[0], 2), kv[0])))
