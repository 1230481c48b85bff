"""A fault after exactly n transfers, when transfers run several at a time (store/remote.each_at_once).

`AfterN(n, real, then, after)` wraps Remote.upload or Remote.download: the first n calls to start run `real`;
the (n+1)-th waits until those n have finished, runs `then()` (a server stopping, a marker file for a killer),
and runs `after(*args)`, as does every later call once `then()` has run (raise, call the real function against
the stopped server, stall). So exactly n objects are transferred whatever the threads' timing: a sequential
"stop after 3 objects" counter would let every thread that started before the third finished through."""

from __future__ import annotations

import threading
from typing import Any, Callable


class AfterN:
    def __init__(self, n: int, real: Callable[..., Any], then: Callable[[], None] = lambda: None,
                 after: Callable[..., Any] | None = None) -> None:
        self.n, self.real, self.then = n, real, then
        self.after = after if after is not None else real
        self._lock = threading.Lock()
        self._started = 0
        self._finished = threading.Semaphore(0)
        self._faulted = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            i, self._started = self._started, self._started + 1
        if i < self.n:
            try:
                return self.real(*args, **kwargs)
            finally:
                self._finished.release()
        if i == self.n:
            for _ in range(self.n):
                self._finished.acquire()
            self.then()
            self._faulted.set()
        else:
            self._faulted.wait()
        return self.after(*args, **kwargs)
