"""Is the endpoint of a store URL an S3 server at all? A web page on the wrong port (MinIO's console, 9001, beside
its S3 API on 9000; a proxy's login page) answers every request, and its HTML read as S3 made every command say
something else that was not so: "no store at URL", "store.json is damaged; push into an empty prefix", "answered:
Internal Server Error; rerun". Asked only once a command has failed or found nothing, with one plain GET of the
bucket (an S3 server answers XML, even to an unsigned request - its AccessDenied error - and names its request
id in an x-amz header whatever it answers)."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from typing import Any

_endpoints: dict[str, tuple[str, str]] = {}  # store URL -> (endpoint URL, bucket), as open_remote opened it


def endpoint_of(fs: Any) -> str | None:
    """Where an s3fs filesystem's requests go: its endpoint (an option, else AWS_ENDPOINT_URL); None: AWS's own."""
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") \
        or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return str(endpoint).rstrip("/") if endpoint else None


def remember(url: str, fs: Any, root: str) -> None:
    """Where the URL's requests go: its s3fs endpoint (an option, else AWS_ENDPOINT_URL); AWS's own: none kept."""
    endpoint = endpoint_of(fs)
    if type(fs).__name__ == "S3FileSystem" and endpoint:
        _endpoints[url.rstrip("/")] = (endpoint, root.split("/", 1)[0])
    else:
        _endpoints.pop(url.rstrip("/"), None)


def not_s3(url: str) -> str | None:
    """The line saying the endpoint of `url` does not speak S3 (naming it and what came back), or None: an S3
    server, AWS itself, no answer at all or a server error (the caller's own line says so), or no endpoint known."""
    if (known := _endpoints.get(url.rstrip("/"))) is None:
        return None
    endpoint, bucket = known
    try:
        with urllib.request.urlopen(f"{endpoint}/{bucket}", timeout=10) as r:
            status, kind, body = r.status, r.headers.get("Content-Type", ""), r.read(4096)
            amz = any(h.lower().startswith("x-amz") for h in r.headers)
    except urllib.error.HTTPError as e:
        status, kind, body = e.code, e.headers.get("Content-Type", ""), e.read(4096)
        amz = any(h.lower().startswith("x-amz") for h in e.headers)
    except (OSError, ValueError):
        return None
    # an S3 server's every answer carries its request id (x-amz-request-id; x-amzn-RequestId), a page of its own too.
    # A 5xx page is a proxy's in front of a server that is down (nginx's 502 before MinIO): the caller's line (rerun)
    html = "html" in kind.lower() or body.lstrip()[:15].lower().startswith((b"<!doctype html", b"<html"))
    if amz or status >= 500 or not html:
        return None
    title = re.search(rb"<title>(.*?)</title>", body, re.IGNORECASE | re.DOTALL)
    page = f"an HTML page titled {title[1].decode(errors='replace').strip()!r}" if title else "an HTML page"
    return (f"the endpoint {endpoint} of {url} does not speak S3: it answered {page} (HTTP {status}, "
            f"{kind or 'no Content-Type'}); point AWS_ENDPOINT_URL (or -o endpoint_url=...) at the S3 API, not a web "
            "console (MinIO: the API port, 9000 by default, not the console's 9001)")
