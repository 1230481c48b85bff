"""Where a webdataset source's tar shards are and how each is opened: local paths, `http(s)://`, `s3://`, and
brace lists (`shard-{000..099}.tar`, `a.tar::b.tar`), all through the `webdataset` library.

- The shard list is webdataset's own expansion (`shardlists.expand_urls`: braces, `::` lists, `WDS_` variables);
  a local folder is its `*.tar` files sorted by name; an `s3://bucket/prefix` that names no `.tar` is the `*.tar`
  objects under it.
- A shard is opened with webdataset's `gopen` (a local file; `http(s)` through curl), except `s3://`, which gopen
  has no handler for (its `pipe:aws s3 cp` would need the AWS CLI and a shell): that is fsspec/s3fs, configured by
  the standard AWS environment (`AWS_ENDPOINT_URL` for an S3-compatible server), as the store's URLs are.
- The members are still parsed by webdataset_source.py from that stream, not by webdataset's `tar_file_iterator`:
  that one reads every member whole (an oversized member could not be refused unread), skips links silently and
  keeps no record of duplicates, which would lose the quarantine rules every format shares.
- Identity for the listing hash (content.py): a local shard by its bytes' sha256 (as every local file); a URL by
  its size and the server's content tag (ETag, else Content-MD5, else Last-Modified), from one HEAD request per
  shard; a server that sends none of these is read once and hashed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import IO, Any, NamedTuple

from tqdm import tqdm

from schemas.errors import UserError
from store.remote import is_url

_REMOTE_TAGS = ("ETag", "Content-MD5", "Last-Modified")


def is_shard_list(source: str | Path) -> bool:
    """A URL or a brace / `::` list: a webdataset source whatever the file system says."""
    s = str(source)
    return is_url(s) or "::" in s or ("{" in s and "}" in s and not Path(s).exists())


def shard_urls(source: str | Path) -> list[str]:
    """Every shard of a webdataset source, in reading order; UserError when a named local shard is missing."""
    from webdataset.shardlists import expand_urls

    s = str(source)
    if not is_shard_list(s):
        p = Path(s)
        return [str(p)] if p.is_file() else [str(t) for t in sorted(p.glob("*.tar"))]
    urls = expand_urls(s)
    out: list[str] = []
    for url in urls:
        if url.startswith("s3://") and not url.endswith(".tar"):  # a prefix: the tars under it
            out += _s3_tars(url)
        elif not is_url(url) and not Path(url).is_file():
            raise UserError(f"source shard {url} (of {s}) does not exist; fix the brace list or the path")
        else:
            out.append(url)
    if not out:
        raise UserError(f"source {s} names no .tar shard")
    return out


def remote_source_files(source: str) -> list[str]:
    """The files of a source given as a URL or shard list: its parquet files (a parquet source at a URL), else
    its tar shards."""
    from stages.resize.parquet_source import is_parquet_url, remote_parquet_files

    return remote_parquet_files(source) if is_parquet_url(source) else shard_urls(source)


def _s3_tars(prefix: str) -> list[str]:
    fs, root = remote_fs(prefix)
    with remote_source_errors(prefix):
        found = sorted(fs.glob(root.rstrip("/") + "/*.tar"))
    return [f"s3://{name}" for name in found]


def open_shard(url: str) -> IO[bytes]:
    """A readable binary stream of one shard (close it when done)."""
    if url.startswith(("s3://", "s3a://")):
        fs, path = remote_fs(url)
        with remote_source_errors(url):
            return fs.open(path, "rb", block_size=8 << 20)
    from webdataset.gopen import gopen

    if url.startswith(("http://", "https://")) and shutil.which("curl") is None:
        raise UserError(f"source shard {url}: http(s) shards are streamed with curl (webdataset's gopen), which is "
                        "not installed; install curl (e.g. apt-get install curl)")
    return gopen(url, "rb")


class RemoteTag(NamedTuple):
    """A shard's size and content tag as its server's metadata says (one request)."""

    size: Any
    name: str | None  # the first of ETag, Content-MD5, Last-Modified the server sends, as its client spells it; None
    value: str | None

    @property
    def text(self) -> str | None:
        """`name=value`, as the listing hash (`remote_identity`) and a URL's identity (known_tars.py) record it."""
        return None if self.name is None else f"{self.name}={self.value}"

    @property
    def strong_etag(self) -> str | None:
        """The ETag when it is a strong one (not W/"..."; If-Match compares strongly: a weak one refuses every
        range read), else None (no ETag: another tag, or none)."""
        etag = self.value if self.name is not None and self.name.lower() == "etag" else None
        return etag if etag and not etag.startswith("W/") else None


def remote_tag(url: str) -> RemoteTag:
    """The size and content tag of a shard at a URL, from the server's metadata: one request. The client's errors
    as one UserError line naming the URL."""
    fs, path = remote_fs(url)
    with remote_source_errors(url):
        info = fs.info(path)
    return tag_of(info)


def tag_of(info: dict[str, Any]) -> RemoteTag:
    """The size and content tag in fsspec's `fs.info` answer for a file at a URL."""
    name = next((k for k in (*_REMOTE_TAGS, *(k.lower() for k in _REMOTE_TAGS)) if info.get(k)), None)
    return RemoteTag(info.get("size"), name, None if name is None else str(info[name]))


def remote_identity(url: str) -> str:
    """`size tag` of a shard at a URL, from the server's metadata; the sha256 of its bytes when it has no tag."""
    asked = remote_tag(url)
    size, tag = asked.size, asked.text
    if tag is None:  # nothing says whether it changed: its bytes do
        h = hashlib.sha256()
        with open_shard(url) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        tag = f"sha256={h.hexdigest()}"
    return f"{size} {tag}"


def if_match(url: str, etag: str | None) -> dict[str, Any]:
    """The keywords of fsspec's http reads that make a server refuse (412) a range of another object than the one
    whose ETag is `etag`: its offsets never read into bytes put again. s3fs's cat_file and cat_ranges take none
    (nothing; its S3File, through which pyarrow reads a parquet file, sends the ETag it was opened with)."""
    return {"headers": {"If-Match": etag}} if etag and url.split("://", 1)[0] in ("http", "https") else {}


def remote_listing(urls: list[str]) -> list[str]:
    """One identity line per shard URL (for the listing hash), with a progress bar: one request each."""
    return [f"{u}\0{remote_identity(u)}" for u in tqdm(urls, desc="source listing (shard metadata)", unit="shard",
                                                          leave=False)]


def remote_fs(url: str) -> tuple[Any, str]:
    """The file system of `url` and the path on it; its listing cache dropped (objects may have changed)."""
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise UserError(f"{url}: a source at a URL needs fsspec: pip install 'qwen-edit-lora-pipeline[s3]'") from None
    protocol = url.split("://", 1)[0]
    try:
        fs = _filesystem(protocol, tuple(os.environ.get(k) for k in _AWS_ENV))
    except ImportError as e:
        raise UserError(f"{url}: this scheme needs a package that is not installed ({e}); for s3:// and "
                        "http(s):// install the s3 extra: pip install 'qwen-edit-lora-pipeline[s3]'") from None
    except ValueError as e:
        raise UserError(f"{url}: not a source URL this program can open ({e}); use a path, http(s):// or s3://") from None
    fs.invalidate_cache()
    return fs, type(fs)._strip_protocol(url)


_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_DEFAULT_REGION")


@functools.lru_cache(maxsize=4)
def _filesystem(protocol: str, env: tuple[str | None, ...]) -> Any:
    """One instance per scheme and AWS environment (`env` is the cache key): a new one costs a session set-up
    (~0.3 s) per request, and fsspec's own instance cache would not see a changed environment."""
    import fsspec

    return fsspec.filesystem(protocol, skip_instance_cache=True)


def remote_source_errors(url: str):
    """The libraries' errors about a source URL as one UserError line naming it (store/remote.py's, worded for a
    source: a missing object is the user's URL to fix)."""
    from store.remote import remote_errors

    return remote_errors(url, "source shard" if not url.endswith(".parquet") else "parquet source", missing="fix the URL")
