"""An endpoint that is no S3 server (an HTML page on the wrong port, as MinIO's console on 9001): every store
command says so, naming the endpoint and what came back. Before: "no store at URL", "store.json is damaged; push
the store again into an empty prefix" (a push into a new prefix failed alike) or "answered: Internal Server
Error; rerun" - none of them the way out."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from s3_server import aws_env, html_endpoint
from store import Store
from store_samples import fill


@pytest.mark.parametrize("listing_status", [200, 404])
@pytest.mark.parametrize("command", ["verify", "inspect", "push", "pull", "gc"])
def test_an_endpoint_that_answers_html_is_named_as_not_s3(monkeypatch, store: Store, tmp_path, command: str,
                                                          listing_status: int) -> None:
    fill(store, 2)
    url = "s3://bucket/store"
    args = {"push": [store.root, url], "pull": [url, tmp_path / "pulled"]}.get(command, [url])
    with html_endpoint(listing_status) as endpoint:
        aws_env(monkeypatch, endpoint)
        r = CliRunner().invoke(app, ["store", command, *map(str, args)])
    assert r.exit_code != 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r.output
    assert lines[0].endswith(f"the endpoint {endpoint} of {url} does not speak S3: it answered an HTML page titled "
                             "'MinIO Console' (HTTP 200, text/html); point AWS_ENDPOINT_URL (or -o endpoint_url=...) "
                             "at the S3 API, not a web console (MinIO: the API port, 9000 by default, not the "
                             "console's 9001)"), r.output


def test_a_proxys_error_page_in_front_of_an_s3_server_is_not_named_as_not_s3(monkeypatch, tmp_path) -> None:
    """nginx's "502 Bad Gateway" page (HTML, no x-amz header) before a MinIO that is down: the server is an S3 one,
    and the way out is to start it and rerun, not to point AWS_ENDPOINT_URL elsewhere."""
    url = "s3://bucket/store"
    with html_endpoint(502, 502) as endpoint:
        aws_env(monkeypatch, endpoint)
        r = CliRunner().invoke(app, ["store", "verify", url])
    assert r.exit_code != 0, r.output
    assert "does not speak S3" not in r.output and "502" in r.output, r.output
