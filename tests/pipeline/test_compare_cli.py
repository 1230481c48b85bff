"""`pipeline compare` mistakes: an --out that holds something else, and one run passed twice."""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline.cli import app


def test_an_out_holding_a_report_or_a_store_is_refused_and_left_as_it_was(tmp_path):
    """`--out REPORT` replaced the evaluate report's index.html with the comparison page (and `--out STORE` put
    pages into a store) without a word."""
    report = tmp_path / "report"
    (report / "losses.zarr").mkdir(parents=True)
    (report / "index.html").write_text("the evaluate report")
    (report / "metrics.json").write_text("{}")
    r = CliRunner().invoke(app, ["compare", "a", "b", "--out", str(report)])
    assert r.exit_code == 1, r.output
    assert r.output == (f"error: --out {report} holds other files (losses.zarr, metrics.json): compare writes "
                        "index.html and curves.csv there; pass a new or empty folder, or the folder of an earlier "
                        "compare\n")
    assert (report / "index.html").read_text() == "the evaluate report"
    assert sorted(p.name for p in report.iterdir()) == ["index.html", "losses.zarr", "metrics.json"]


def test_the_same_report_given_twice_is_refused(tmp_path):
    """`compare R R/losses.zarr` (one folder and its loss group) drew one run against itself, under one label
    twice."""
    group = tmp_path / "run" / "losses.zarr"
    group.mkdir(parents=True)
    (group / "zarr.json").write_text("{}")
    r = CliRunner().invoke(app, ["compare", str(group.parent), str(group), "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 1, r.output
    assert r.output == f"error: {group.parent} and {group} are the same report: pass each run once\n"
    assert not (tmp_path / "cmp").exists()


def test_the_same_folder_given_twice_is_a_usage_mistake(tmp_path, monkeypatch):
    """`compare R R` (or `R ./R/`) is judged on the paths alone: exit 2 before any report is looked up (it was 1,
    after the lookup of both loss groups; R need not even exist)."""
    monkeypatch.chdir(tmp_path)
    for args, said in ((["run", "run"], "run is given twice: pass each run once"),
                       (["run", "./run/", "other"], "./run/ and run are the same report: pass each run once")):
        r = CliRunner().invoke(app, ["compare", *args, "--out", "cmp"])
        assert r.exit_code == 2 and r.output == f"error: INPUTS: {said}\n", r.output
    assert not (tmp_path / "cmp").exists()
