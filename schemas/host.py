"""Which host this process runs on: the running kernel, named by its boot id, not by the host name (`docker
--hostname`, cloned VMs and bare-metal nodes installed from one image give several hosts one name; the pods of one
node often have random ones). The one rule for the model-file hash cache (models/file_hashes.py), the leases
(store/lease.py: whether a lease's pid is this host's to ask) and the encoders' "one cache or several"
(stages/encode/nodes.py). Here because both store/ and models/ may import schemas/ only."""

from __future__ import annotations

import os
import socket
from pathlib import Path

BOOT_ID = "/proc/sys/kernel/random/boot_id"  # Linux: the running kernel's id, new at every boot


def host_id() -> str:
    """The running kernel's boot id, else (no /proc) the host name. The kernel is what shares memory, locks and
    pids: its containers are one host, two nodes never are, whatever names they were given."""
    try:
        return Path(BOOT_ID).read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def pid_namespace_id() -> int | None:
    """The inode of this process's pid namespace (containers of one host number their processes apart); None
    where unreadable (no /proc). For temp names (schemas/temp_files.py) and fetch tags (store/lease.py)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
