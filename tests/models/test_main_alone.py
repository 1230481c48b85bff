"""`models.collective.main_alone` where WORLD_SIZE and MASTER_* are set but no launcher's store answers (a platform
such as Kubeflow's PyTorchJob sets them for every pod of a job): one line saying what to do, not a traceback."""

from __future__ import annotations

import socket

import pytest

from models import collective
from schemas.errors import UserError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_no_store_answering_is_one_line_naming_what_to_do(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_closed_port()))
    monkeypatch.setenv("RANK", "0")
    # the client's retries against a closed port for its whole timeout (10 s) are not what is tested, the line
    # after they fail is: 1 s of them
    real = collective.store_client._store_client
    monkeypatch.setattr(collective.alone, "_store_client", lambda timeout=10.0: real(1.0))
    ran = []
    with pytest.raises(UserError, match="none answers at 127.0.0.1:.*unset WORLD_SIZE"):
        collective.main_alone(2, "resize-bucket", lambda: ran.append(1))
    assert ran == []  # nothing ran: the other ranks could not have waited for it
