"""`pipeline store inspect`: what a store holds (tables, versions, samples, buckets, bytes, lineage)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from schemas.resize_sizes import sizes_in_force
from store import format as fmt
from store import quarantine
from store.arrow_columns import size_counts
from store.integrity import DamagedData
from store.manifest_files import checked_manifest, checked_schema
from store.store import Store


def describe(root: Path) -> dict[str, Any]:
    st = Store(root, create=False)
    current = st.tables()
    out: dict[str, Any] = {"store": str(root), "format": fmt.STORE_FORMAT, "format_version": fmt.STORE_FORMAT_VERSION,
                           "tables": {}}
    names = sorted(set(current) | {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")})
    for table in names:
        versions = [_describe_version(st.version_dir(table, v), v) for v in st.versions(table)]
        out["tables"][table] = {"current": current.get(table), "versions": versions}
    q = quarantine.read(root)
    by_reason = quarantine.samples_by_reason(q)  # samples: a row may stand for several (quarantine.SAMPLES)
    out["quarantine"] = {"rows": q.num_rows, "samples": sum(by_reason.values()), "by_reason": by_reason}
    return out


def _describe_version(vdir: Path, v: int) -> dict[str, Any]:
    d: dict[str, Any] = {"version": v, "complete": fmt.is_complete(vdir)}
    if (vdir / fmt.SCHEMA_JSON).is_file() or d["complete"]:
        try:  # checked, as the manifest: a flipped bit would show another lineage
            schema = checked_schema(vdir, record=False)
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
        m = checked_manifest(vdir, list(COUNTED))  # the counted columns alone: nested tensor/file lists left unread
    except DamagedData as e:  # inspect describes a damaged store too: the damage, named, instead of its numbers
        d["damaged"] = str(e)
        return d
    shards = m.select(["shard", "shard_nbytes"]).group_by("shard").aggregate([("shard_nbytes", "max")])
    d.update(samples=m.num_rows, shards=shards.num_rows, bytes=int(pc.sum(shards.column(1)).as_py() or 0))
    if "split" in m.column_names:
        counts = pc.value_counts(m.column("split").combine_chunks())  # in order of first appearance, as a Counter
        d["splits"] = dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))
    d["buckets"] = _buckets(m)
    if "control_sizes" in m.column_names:  # images tables: the controls' VAE views too, not only targets
        d["control_buckets"] = _size_counts(pc.list_flatten(m.column("control_sizes").combine_chunks()), 2)
    return d


# the columns inspect counts (those a version has): 1M rows as Python objects, every column read, took ~1 min
COUNTED = ("shard", "shard_nbytes", "split", "bucket", "img_shapes", "height", "width", "control_sizes")


def _size_counts(sizes: pa.Array, width: int, scale: int = 1) -> dict[str, int]:
    """"HxW" -> count, in size order (`arrow_columns.size_counts`)."""
    return {f"{h}x{w}": n for (h, w), n in size_counts(sizes, width, scale).items()}


def _buckets(m: pa.Table) -> dict[str, int]:
    """Target sizes in pixels, "HxW" -> count: the `bucket` column, else img_shapes (x16), else v1 height/width."""
    cols = m.column_names
    if "bucket" in cols:
        return _size_counts(m.column("bucket").combine_chunks(), 2)
    if "img_shapes" in cols:  # the target's [1, h, w] in patches of 16 px
        return _size_counts(pc.list_element(m.column("img_shapes").combine_chunks(), 0), 3, scale=16)
    if "height" in cols and "width" in cols:
        sizes = list(zip(m.column("height").to_pylist(), m.column("width").to_pylist()))
        return {f"{h}x{w}": n for (h, w), n in sorted(Counter(sizes).items())}
    return {}


def render(info: dict[str, Any]) -> str:
    lines = [f"store {info['store']} ({info['format']} v{info['format_version']})"]
    if not info["tables"]:
        lines.append("  no tables")
    for table, t in info["tables"].items():
        lines.append(f"  {table}: current v{t['current']}")
        for v in t["versions"]:
            mark = "*" if v["version"] == t["current"] else " "
            if not v["complete"]:
                lines.append(f"   {mark} v{v['version']}: incomplete ({v.get('committed_shards', 0)} shards committed)")
                continue
            if "damaged" in v:
                lines.append(f"   {mark} v{v['version']}: damaged: {v['damaged']}")
                continue
            lines.append(f"   {mark} v{v['version']}: schema v{v['schema_version']}, {v['samples']} samples, "
                         f"{v['shards']} shards, {v['bytes'] / 1e6:.1f} MB"
                         + (f", splits {v['splits']}" if "splits" in v else ""))
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
    lines.append(f"  quarantine: {q['rows']} rows" + (f" ({samples} samples)" if samples != q["rows"] else "")
                 + (f" {q['by_reason']}" if q["rows"] else ""))
    return "\n".join(lines)
