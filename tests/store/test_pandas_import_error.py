"""pyarrow imports pandas lazily, inside its first conversion of a Python value (`split_rows`' `pc.equal(column,
"train")` at a training's start), and pyarrow.compute reports any error of that import as "TypeError: Got unexpected
argument type <class 'str'> for compute function". A Ctrl-C landing in the import (pandas' Cython modules make a
SystemError of the KeyboardInterrupt) ended `run train` on "stopped by SIGINT (TypeError while stopping)" (seen in
test_signals). The store's code answers pyarrow's check "no pandas" now (store/format.py), so a store read imports no
pandas at all: nothing for a Ctrl-C to land in (and none of its 0.4-0.6 s per command). Here a pandas whose import
fails as the interrupted one did stands in for the Ctrl-C (no signal, no timing), in a process of its own (pyarrow
keeps its first try for the process life)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the column read from a file, as a manifest's: no conversion of a Python value before split_rows' own
READ = """
import sys
import pyarrow.parquet as pq
try:
    from store.reader_manifest import split_rows
    split_rows(pq.ParquetFile(sys.argv[1]).read().column("split"), "train", "t")  # read_table converts one
    print("NO ERROR", "pandas" in sys.modules)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"""


def test_an_interrupted_pandas_import_is_not_a_type_error_of_a_store_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest = tmp_path / "manifest.parquet"
    pq.write_table(pa.table({"split": ["train", "val", "train"]}), manifest)
    fake = tmp_path / "fake" / "pandas"
    fake.mkdir(parents=True)
    # what the interrupted import raised (its KeyboardInterrupt lost inside pandas' Cython module init)
    (fake / "__init__.py").write_text("raise SystemError(\"<class 'pandas._libs.tslibs.fields.__pyx_defaults'> "
                                      "returned a result with an exception set\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), _repo_and_suite_path()])}
    out = subprocess.run([sys.executable, "-c", READ, str(manifest)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    # not "TypeError: Got unexpected argument" (nor, from 7c770f76, the store's own import of pandas failing)
    assert line == "NO ERROR False", line


def _repo_and_suite_path() -> str:
    """The repo, then the suite's own PYTHONPATH: a stack that installs crc32c & co with `pip --target` (the GPU
    machine's, bench/gpu/rehearse) has them there alone; the repo alone failed there on `import crc32c`."""
    return os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])


def test_pyarrows_own_pandas_calls_still_import_it(tmp_path):
    """What the store tells pyarrow ("no pandas" at its first check) leaves a caller's `to_pandas` working."""
    script = ("import pyarrow as pa, store.format\n"
              "frame = pa.table({'a': [1, 2]}).to_pandas()\n"
              "print(type(frame).__name__, list(frame['a']))\n")
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": _repo_and_suite_path()},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == "DataFrame [1, 2]", out.stdout


def test_another_threads_pandas_import_meanwhile_is_unaffected(tmp_path, monkeypatch):
    """The "no pandas" finder is on sys.meta_path while store.format makes pyarrow's first check: it answers the
    importing thread alone. A thread importing pandas in that instant gets it (here a stand-in `pandas` on the
    path; pyarrow's conversion is a stand-in too, which imports in another thread right then). Before: that
    thread's import failed with ImportError."""
    import importlib
    import threading

    from store import format as fmt

    (tmp_path / "pandas.py").write_text("STAND_IN = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: dict[str, object] = {}

    def conversion(values):  # what pyarrow's first check does, while another thread imports pandas
        try:
            importlib.import_module("pandas")
            seen["own"] = "imported"
        except ImportError:
            seen["own"] = "ImportError"

        def other() -> None:
            try:
                seen["other"] = importlib.import_module("pandas").STAND_IN
            except ImportError as e:
                seen["other"] = f"ImportError: {e}"

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()

    real = sys.modules.pop("pandas", None)
    try:
        monkeypatch.setattr(fmt.pa, "array", conversion)
        fmt._arrow_without_pandas()
    finally:
        sys.modules.pop("pandas", None)
        if real is not None:
            sys.modules["pandas"] = real
    assert seen == {"own": "ImportError", "other": True}, seen
    assert not any(isinstance(f, fmt._NoPandas) for f in sys.meta_path)
