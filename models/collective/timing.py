"""Every bound and period of the collective's waits, in seconds. Read through this module where used
(`timing.POLL_SECONDS`), so one assignment here (a test's shorter bound, a rank script's) holds for every module."""

POLL_SECONDS = 0.5  # how often a watch thread asks the store whether a rank failed alone
HEARTBEAT_SECONDS = 2.0  # how often a watch thread counts its rank alive in the store (`arrive_together`)
HOST_WAIT_SECONDS = 10.0  # how long a rank that ends on a published failure waits for every rank to have read it
CLOSE_SECONDS = 60.0  # how long an exiting rank waits for its process group to close (a peer stuck mid-collective)

STORE_RETRY_SECONDS = 30.0  # how long a store that stopped answering is tried again: well under LOST_SECONDS
PROBE_SECONDS = 2.0  # how long one try waits for the store's port to accept a connection
# How long torch's client may take to connect once the port answered a probe: milliseconds, but 5 s where one of
# its reverse DNS lookups went unanswered (the resolver's timeout: torch names each connection's peer, in the
# client's connect and on the store's one thread; a probe's handshake is the kernel's, at once): a 2 s try timed
# out in CI, printing c10d's error and stack at a rank's start (docs/architecture.md, bench/store_connect.py). One
# C++ call that no signal ends, hence bounded: a store that accepted the probe and then went away costs this once.
CONNECT_SECONDS = 10.0
# How long a rank that failed before its first exchange tries to reach the store. Not 5 s: a connect took over 5 s
# once in CI (an unanswered reverse DNS lookup in torch's connect: CONNECT_SECONDS), nothing was published, and the
# ranks waiting for this one waited BEFORE_GROUP_SECONDS (30 minutes). A store that is not up (a plain env://
# launch whose rank 0 never came) delays this exit that long.
UNWATCHED_STORE_SECONDS = 30.0

LOST_SECONDS = 120.0  # a rank waited for whose watch thread has counted no sign of life for this long is gone
LIVENESS_SECONDS = 5.0  # how often a waiting rank looks at the signs of life of the ranks not arrived
WAIT_NOTICE_SECONDS = 600.0  # how often a long wait says who it waits for (`_wait_notice`)
# How long a rank waits for the others' texts before the process group exists: as long as torch's own
# rendezvous would wait for them (its default process-group timeout), so no launch that would have formed a
# group is refused for its ranks starting far apart (a node still pulling its image).
BEFORE_GROUP_SECONDS = 1800.0
