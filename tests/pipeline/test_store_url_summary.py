"""A stage run on a store URL works on a local cached copy; its up-to-date line names `pipeline store verify STORE`
as the way to check the bytes. STORE there is the URL the user passed, not the cache folder's hashed name."""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo_data import make_demo_data

AREA = ["--set", "resize.area=4096", "--set", "resize.control_vl_area=4096"]


def test_up_to_date_lines_name_the_store_url_not_its_cache(tiny_plus_model, tmp_path):
    make_demo_data(tmp_path / "data", n=3, fmt="folder", max_controls=1, seed=2)
    url, cache = (tmp_path / "remote").as_uri(), str(tmp_path / "cache")
    resize = ["run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", url, "--cache-dir", cache, *AREA]
    vae = ["run", "encode-vae", "--store", url, "--model", tiny_plus_model, "--cache-dir", cache, "--device", "cpu"]
    for args in (resize, vae):
        assert CliRunner().invoke(app, args).exit_code == 0
        again = CliRunner().invoke(app, args)
        assert again.exit_code == 0, again.output
        assert "is up to date" in again.stdout and f"`pipeline store verify {url}` checks them" in again.stdout
        assert cache not in again.stdout
