"""Decisions every rank takes together: a step that can fail on one rank (a checkpoint write on a full disk, a
damaged input, a threshold) is run inside `together(...)`, and afterwards every rank knows whether any rank
failed; if one did, every rank raises the same one-line `UserError` (the lowest failing rank's message), so all
ranks exit within seconds with the same line instead of one rank dying and the others waiting at the next
barrier until the collective timeout (torchtune all-reduces its decisions the same way).

Only integers and UTF-8 bytes travel (two small collectives: an all-reduce of the failing rank, a broadcast of
its message); no pickled objects. With one process nothing is exchanged and the error passes through as it is.

Work during which the other ranks may sit in a collective this rank will never join cannot be agreed on in
place: DDP all-reduces the gradients inside the last backward, so a rank that runs out of memory in its forward
or backward leaves the others waiting there (NCCL: until the collective timeout). Such work runs in
`fails_alone(...)`: an error is written, as its one line, to the launcher's key-value store (the TCPStore at
MASTER_ADDR:MASTER_PORT that torchrun / accelerate set up, through a connection of our own), and every other
rank's watch thread (`watch_failures`), which polls that key, prints the same line and ends its process with
status 1 at once, even from inside a collective. Such a rank ends like a killed process: what it wrote is
resumable (shards, checkpoints are committed by rename), its read lease names a dead process (gc ignores it)
and its file locks go with the process. The failing rank itself unwinds normally and prints the line.

What the process group is made of (its backend: NCCL on GPUs, gloo on CPUs) cannot be agreed on through the
group itself: `gather_before_group` exchanges every rank's text through the same store before any group exists
(models/launch_devices.py decides the device from it). Its first exchange starts the watch thread: a rank that
fails alone before the group (the CLI publishes an error no handler made a line of: `rank_error_line`) stops
the ranks waiting for it at their next exchange, instead of after BEFORE_GROUP_SECONDS (30 minutes); one that
fails before its own first exchange publishes too, where the store is surely up (`_publish_unwatched`).

The modules: `agree` (the agreements through the process group), `errors` (`RankFailed`, an error every rank knows),
`store_client` (the launch's store, every connect and call bounded), `reconnect` (a long use of it that outlives a
hiccup), `canary` (its host gone), `watch` (the watch thread), `publish` and `interrupt` (a failure or a Ctrl-C told
to every rank), `report` (a rank's own lines), `counting` (ranks counting themselves in the store), `exit` (a
process's exit), `alone` (`fails_alone`, `main_alone`), `arrive` (`arrive_together`), `frozen` (a peer frozen in a
training step), `before_group` (exchanges before any process group), `state` (what they share per run) and `timing`
(every bound).

torch is imported in the functions that exchange tensors or reach the launcher's store, not at import: one
process never calls them, and every command's error line comes through here (pipeline/commands/common.py
`user_errors`): `store inspect` of a wrong path paid torch's import (seconds, ~650 MB) for its one line.
"""

from models.collective.agree import (MESSAGE_BYTES, all_max, all_sum, differing_ranks, gather_texts, ranks_differ,
                                     share_failure, spread, together)
from models.collective.alone import fails_alone, main_alone, out_of_memory
from models.collective.arrive import arrive_together
from models.collective.before_group import gather_before_group, together_before_group
from models.collective.canary import forget_store_hosts, store_host_gone
from models.collective.errors import RankFailed, agreed
from models.collective.exit import close_at_exit
from models.collective.interrupt import publish_interrupt
from models.collective.publish import (ending_line, failure_line, lost_peer_line, peer_failure, peer_line,
                                       publish_failure, publish_uncaught, rank_error_line)
from models.collective.report import report_once
from models.collective.store_client import StoreSilent
from models.collective.watch import new_run, watch_failures

__all__ = ["MESSAGE_BYTES", "RankFailed", "StoreSilent", "agreed", "all_max", "all_sum", "arrive_together",
           "close_at_exit", "differing_ranks", "ending_line", "fails_alone", "failure_line", "forget_store_hosts",
           "gather_before_group", "gather_texts", "lost_peer_line", "main_alone", "new_run", "out_of_memory",
           "peer_failure", "peer_line", "publish_failure", "publish_interrupt", "publish_uncaught", "rank_error_line",
           "ranks_differ", "report_once", "share_failure", "spread", "store_host_gone", "together",
           "together_before_group", "watch_failures"]
