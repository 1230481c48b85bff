"""One garbage collection at the exit instead of three over the whole heap.

The model stack (torch with torch._inductor, which bitsandbytes' import-time `torch.compile` pulls in, diffusers,
transformers, peft) leaves ~550k objects tracked by the cyclic garbage collector. CPython's finalization
(Py_FinalizeEx, after atexit) runs a full collection, then two more inside `finalize_modules` (after emptying
sys.modules, and once more after clearing the modules' dicts): each walks the whole heap, ~1.1 s of CPU in all on
the project's machine, 1.6-3 s of wall after a model command's last line (bench/exit_time.py).

An atexit callback registered by `pipeline.cli.main` before any command runs (so after all the command's own) runs
that first collection itself - the garbage left at the exit is collected and its finalizers run, as before - then
`gc.freeze()`s what survives: the finalization's collections skip frozen objects, so they cost nothing. Module
teardown still clears every module's dict, which frees the objects those dicts hold by reference counting; only a
cycle that becomes unreachable during that teardown is no longer collected - memory the process's end returns
anyway, and finalizers the language does not promise at exit ("It is not guaranteed that __del__() methods are
called for objects that still exist when the interpreter exits", the data model). No work is skipped: every atexit
callback the command registers (lease releases, the process group's close in models/collective/) runs before this
one, those registered earlier (logging's shutdown) after it, and the standard streams are flushed after it, as
always.
"""

from __future__ import annotations

import atexit
import gc


def collect_once_at_exit() -> None:
    """Register `_collect_then_freeze` to run after every atexit callback registered later (atexit runs them last
    in, first out): call it first thing in the process's entry point."""
    atexit.register(_collect_then_freeze)


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()
