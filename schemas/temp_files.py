"""The names of atomic writes' temp files and folders (`.<name>.tmp-<pid>`), and whose writer is gone.

A rule of names shared by the store's writers (store/format.py `atomic_dir`, `atomic_write_bytes`) and the
model-side ones that may import nothing but schemas (models/lora_export.py): one rule for "a killed writer's
leftover, safe to remove", so no writer removes what a live one is still writing."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path


def temp_of(final: Path) -> Path:
    """This process's temp name for `final`: beside it (the rename stays on one file system), hidden, pid-named."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def writer_alive(name: str) -> bool:
    """Is the writer of the temp file / folder `name` (`.<name>.tmp-<pid>`) a live process of this host? A name
    without a pid counts as gone (its writer is not known); a pid not ours to signal as alive."""
    tail = name.rsplit(".tmp-", 1)[-1]
    if not tail.isdigit():
        return False
    try:
        os.kill(int(tail), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_dead_temps(final: Path, own: Path | None = None) -> None:
    """Remove the temp files and folders of `final` whose writer is gone: a killed writer's, which nothing else
    ever removes (a LoRA export's hundreds of MB beside the user's file). Never `own`, never a live writer's."""
    for left in Path(final).parent.glob(f".{glob.escape(Path(final).name)}.tmp-*"):
        if left == own or writer_alive(left.name):
            continue
        if left.is_dir() and not left.is_symlink():
            shutil.rmtree(left, ignore_errors=True)
        else:
            left.unlink(missing_ok=True)
