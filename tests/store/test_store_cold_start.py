"""The store's commands that read no tensor start without the model stack, torch included: each cold process (a
user's `pipeline store inspect`, every subprocess of the suite) paid torch's import (~1.6 s idle, several seconds
on a loaded machine) for nothing. What they import is checked, not how long it takes (bench/cold_start.py)."""

from __future__ import annotations

from cli_probe import run_each
from store import Store
from store_samples import fill


def test_store_commands_import_no_model_stack(tmp_path):
    store = tmp_path / "store"
    fill(Store(store, create=True), 6)  # tensors (bf16, float32) and files: verify checks every tensor's size
    s = str(store)
    commands = [["store", "inspect", s], ["store", "verify", s], ["store", "gc", s, "--dry-run"],
                ["store", "repair", s, "--dry-run"]]
    added, proc = run_each(commands)
    assert "verified" in proc.stdout, proc.stdout[-2000:]  # verify read every shard (not an early refusal)
    assert added == {"store inspect": [0, []], "store verify": [0, []], "store gc": [0, []],
                     "store repair": [0, []]}, proc.stderr[-3000:]


def test_a_store_command_on_a_wrong_path_says_so_without_the_model_stack(tmp_path):
    """A typo'd store path ended in its one line only after importing torch (4-10 s and ~700 MB on a login node
    instead of about a second): every command's error line went through models.collective (a launched rank
    publishes it to the others), which imported torch at its top."""
    nowhere = str(tmp_path / "nowhere")
    commands = [["store", "inspect", nowhere], ["store", "verify", nowhere], ["store", "gc", nowhere],
                ["store", "repair", nowhere, "--dry-run"], ["migrate", "v1-to-v2", nowhere],
                ["store", "push", nowhere, "s3://bucket/prefix"], ["store", "pull", f"file://{nowhere}", nowhere + "-2"],
                ["compare", nowhere, nowhere + "-2", "--out", str(tmp_path / "cmp")]]
    added, proc = run_each(commands)
    stderr = proc.stderr
    assert added == {" ".join(c[:2]): [1, []] for c in commands}, stderr[-3000:]
    assert stderr.count(f"error: no store at {nowhere} (no store.json)") == 6, stderr  # inspect ... push
    assert f"error: no store at file://{nowhere}" in stderr and f"error: {nowhere} does not exist; pass a report folder" in stderr, stderr
