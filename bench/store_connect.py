"""How long torch's TCPStore client takes to connect to a store served as this project's launches serve it
(models/collective/), and why it sometimes takes 5 s: each case vs a baseline measured in the same run.

The store: a master `TCPStore(is_master=True, multi_tenant=True, wait_for_workers=False)` in a Python process of
its own, as torchrun's agent serves it (libuv by default) and rank 0 of a plain env:// launch served it before
(`_before_group_store`), on 127.0.0.1 as the tests' launches name it. Clients connect as `_store_client` does
(`is_master=False, wait_for_workers=False`), from other processes:
  seq     one client process, --n connects one after another (each client kept open, as a rank keeps its own)
  64      8 processes x 8 threads connecting at once (8 nodes x 8 ranks starting together; the constructor
          releases the GIL, so a process's threads do connect concurrently)
  probe   the plain socket connect `_store_client` makes first (socket.create_connection), --n one after another
each under: idle | cpu 2x / 4x (busy-loop processes, 2 and 4 per core) | busy master (Python threads holding
the GIL in the master's process, as rank 0's own work does), for three servers: torch's two backends as torch
listens (`libuv`, the default, as torchrun's agent serves; `legacy`, use_libuv=False), and `project`: rank 0's
store as models/collective/before_group.py `_before_group_store` serves it now (libuv, on an IPv4 listener of its own).
Reported per case: p50 / p99 / max ms, how many connects took 1 s or more ("stalls"), and p50 and max over the
baseline's p50 (the first case: libuv, idle, seq): a stall in units of an ordinary connect.

The cause, measured last: torch formats every socket's peer address with getnameinfo() WITHOUT NI_NUMERICHOST
(torch/csrc/distributed/c10d/socket.cpp: SocketImpl's constructor, for the client's connect and the server's
accept alike), a reverse DNS lookup per connection on each side, the server's on its one store thread. Its client
connects over IPv6 (prefer_ipv6, AI_V4MAPPED), and its server listens dual-stack, so 127.0.0.1 is looked up as
::ffff:127.0.0.1, which /etc/hosts' `127.0.0.1 localhost` does not answer (glibc's files backend matches the
address family as given): the query goes to the DNS server. An answer (NXDOMAIN) comes in well under 1 ms; a
query that gets none costs the resolver's timeout, 5 s (resolv.conf's default), then a second try. The `lookup`
rows time socket.getnameinfo() on both forms of the address. --hosts-entry (root, util-linux `unshare`) then runs
the cases again in a private mount namespace whose /etc/hosts also names `::ffff:127.0.0.1 localhost` (nothing
outside it changes): rows `hosts+ ...`, the lookups answered from the file.

2-core shared machine (other helpers' tests running), torch 2.14.1, --n 48, two runs (docs/architecture.md, "The
store's connect", says what they rule out): p50 0.3-11 ms one at a time under every load, backend and a busy
master, 10-70 ms for 64 at once where none stalled; every connect of 1 s or more took 5.0-5.1 s (1 of 48 one at a time, in most
cases); 64 at once on torch's listeners, run 1: 36/64 (libuv), 37/64 (legacy), 42/64 (legacy, cpu 2x) at 5 s,
run 2: none; --only 64 four times: libuv 40/64 once, project none. lookup 127.0.0.1 0.003 ms; ::ffff:127.0.0.1
0.15-0.46 ms p50, 3 of 192 at 5 s. --hosts-entry: no stall in 336 connects, one-at-a-time p50 0.08 ms.

    python bench/store_connect.py [--n 48] [--only seq,64,probe] [--backends libuv,legacy,project] [--hosts-entry]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)  # long: a stall is measured, never cut short
STALL_SECONDS = 1.0


def _serve(backend: str, busy_threads: int, ports, stop) -> None:
    """The master's process: the store, and (busy master) Python threads holding the GIL meanwhile."""
    if backend == "project":  # rank 0 of a plain env:// launch, through the project's own code
        sys.path.insert(0, REPO)
        from models import collective

        with socket.socket() as free:
            free.bind((HOST, 0))
            port = free.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": HOST, "MASTER_PORT": str(port)})
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        store = collective.before_group._before_group_store(TIMEOUT.total_seconds())
    else:
        import torch.distributed as dist

        store = dist.TCPStore(HOST, 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                              use_libuv=backend == "libuv", timeout=TIMEOUT)
        port = store.port

    def spin() -> None:
        while not stop.is_set():
            sum(i * i for i in range(20_000))  # pure Python: the GIL is held but for the interpreter's switches

    for _ in range(busy_threads):
        threading.Thread(target=spin, daemon=True).start()
    ports.put(port)
    stop.wait()
    del store


def _clients(port: int, threads: int, per_thread: int, start, results, probe: bool) -> None:
    """One client process: `threads` threads, each connecting `per_thread` times one after another, all released
    by `start` together; each connection kept until the process's last one is made."""
    import torch.distributed as dist

    kept, times, lock = [], [], threading.Lock()

    def run() -> None:
        start.wait()
        for _ in range(per_thread):
            began = time.perf_counter()
            if probe:
                client = socket.create_connection((HOST, port), timeout=60)
            else:
                client = dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
            took = time.perf_counter() - began
            with lock:
                times.append(took)
                kept.append(client)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results.put(times)
    for client in kept:
        if probe:
            client.close()


def _case(ctx, backend: str, shape: str, n: int, busy_threads: int) -> list[float]:
    """The connect times of one case, against a master of its own."""
    ports, stop, results, start = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
    master = ctx.Process(target=_serve, args=(backend, busy_threads, ports, stop), daemon=True)
    master.start()
    port = ports.get(timeout=120)
    procs, threads, per_thread = {"seq": (1, 1, n), "probe": (1, 1, n), "64": (8, 8, 1)}[shape]
    clients = [ctx.Process(target=_clients, args=(port, threads, per_thread, start, results, shape == "probe"),
                           daemon=True) for _ in range(procs)]
    for c in clients:
        c.start()
    time.sleep(3.0)  # every client process has imported torch and waits at `start`
    start.set()
    times = [t for _ in clients for t in results.get(timeout=600)]
    for c in clients:
        c.join()
    stop.set()
    master.join(timeout=30)
    return times


class _CpuLoad:
    """`per_core` busy-loop processes per core while the block runs."""

    def __init__(self, per_core: int) -> None:
        self.count = per_core * (os.cpu_count() or 1)

    def __enter__(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _pct(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(name: str, times: list[float], base: float | None) -> float:
    p50, p99, top = _pct(times, 0.5), _pct(times, 0.99), max(times)
    stalls = sum(t >= STALL_SECONDS for t in times)
    ratio = "" if base is None else f"{p50 / base:7.1f}x {top / base:7.0f}x"
    print(f"{name:34s} {len(times):4d} {p50 * 1e3:9.2f} {p99 * 1e3:9.1f} {top * 1e3:9.1f} {stalls:6d}   {ratio}",
          flush=True)
    return p50


def _lookups(n: int) -> dict[str, list[float]]:
    """getnameinfo() of the store's address as torch formats a peer (v4-mapped IPv6) and as plain IPv4."""
    out = {}
    for name, addr in (("lookup 127.0.0.1 (AF_INET)", (HOST, 1, )),
                       ("lookup ::ffff:127.0.0.1 (as torch)", ("::ffff:" + HOST, 1, 0, 0))):
        times = []
        for _ in range(n):
            began = time.perf_counter()
            socket.getnameinfo(addr, socket.NI_NUMERICSERV)
            times.append(time.perf_counter() - began)
        out[name] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=48, help="connects per sequential case, lookups per lookup row")
    ap.add_argument("--only", default="seq,64,probe", help="shapes to run: seq, 64, probe")
    ap.add_argument("--backends", default="libuv,legacy,project")
    ap.add_argument("--loads", default="idle,cpu2x,cpu4x,busy-master")
    ap.add_argument("--hosts-entry", action="store_true", help="then the cases again with ::ffff:127.0.0.1 in "
                    "/etc/hosts (a private mount namespace: root and `unshare`)")
    ap.add_argument("--hosts-loads", default="idle", help="the loads --hosts-entry runs again")
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)  # the namespace's run: its rows' prefix
    ap.add_argument("--base", type=float, default=None, help=argparse.SUPPRESS)  # ... and the first run's baseline
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    shapes, loads = args.only.split(","), args.loads.split(",")
    backends = args.backends.split(",")
    if not args.label:
        print(f"== TCPStore client connect, {os.cpu_count()} cores, --n {args.n}; ratios: p50 and max over the "
              "baseline's p50 (first row)")
        print(f"{'case':34s} {'n':>4s} {'p50 ms':>9s} {'p99 ms':>9s} {'max ms':>9s} {'>=1s':>6s}   {'p50 x':>7s} "
              f"{'max x':>7s}")
    base = args.base
    for load in loads:
        for backend in backends:
            for shape in shapes:
                if shape == "probe" and backend != "libuv":
                    continue  # a plain socket: the backend changes only the accept side, measured once
                name = f"{args.label}{backend} {load} {shape}"
                busy = 2 if load == "busy-master" else 0
                load_ctx = _CpuLoad(int(load[3])) if load.startswith("cpu") else None
                if load_ctx is not None:
                    load_ctx.__enter__()
                try:
                    times = _case(ctx, backend, shape, args.n, busy)
                finally:
                    if load_ctx is not None:
                        load_ctx.__exit__(None, None, None)
                got = _row(name, times, base)
                base = base or got
    for name, times in _lookups(4 * args.n).items():
        _row(args.label + name, times, base)
    if args.hosts_entry:
        _with_hosts_entry(args, base)


def _with_hosts_entry(args: argparse.Namespace, base: float) -> None:
    """This bench again, in a private mount namespace whose /etc/hosts also names ::ffff:127.0.0.1."""
    with tempfile.NamedTemporaryFile("w", suffix=".hosts") as hosts:
        with open("/etc/hosts") as current:
            hosts.write(current.read().rstrip("\n") + "\n::ffff:127.0.0.1 localhost\n")
        hosts.flush()
        os.chmod(hosts.name, 0o644)
        subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && shift && exec "$@"', hosts.name,
                        "--", sys.executable, os.path.abspath(__file__), "--n", str(args.n), "--only", args.only,
                        "--backends", args.backends, "--loads", args.hosts_loads, "--label", "hosts+ ", "--base",
                        repr(base)], check=True)


if __name__ == "__main__":
    main()
