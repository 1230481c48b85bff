"""Two different stores pushed into one prefix at once: the push that meets the other's objects of the same version
is refused naming the push in flight, and is told to use an empty prefix. Before, it called them the leftovers of a
killed push and advised `store gc` an hour later then another push - which, the other push having completed the
version meanwhile, was refused again ("the stores grew apart")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.errors import UserError
from store.remote_push import push


def test_a_push_meeting_another_push_in_flight_names_it(s3_env, edit_store: Path, plus_store: Path) -> None:
    url, client, bucket = s3_env.url("both"), s3_env.client(), s3_env.bucket
    push(plus_store, url)
    # the state a push of plus_store still in flight leaves: images v1's objects without its manifest (written
    # last), and its live push lease (another host's, refreshed just now)
    client.delete_object(Bucket=bucket, Key="both/images/v1/manifest.parquet")
    client.delete_object(Bucket=bucket, Key="both/store.json")
    lease = {"host": "node-7", "boot_id": "another-boot", "pid": 4242, "what": "pipeline store push", "kind": "push",
             "versions": {"images": [1]}}
    client.put_object(Bucket=bucket, Key="both/.leases/node-7-4242-0000.json", Body=json.dumps(lease).encode())

    with pytest.raises(UserError) as refused:
        push(edit_store, url)
    message = str(refused.value)
    assert message.startswith(f"images v1 at {url} is being pushed right now, with other contents than "
                              f"{edit_store}'s, by pipeline store push (pid 4242 on node-7, refreshed "), message
    assert message.endswith(f"push {edit_store} into an empty prefix instead"), message

    # no push in flight (a killed one's leftovers): the advice stays gc, then push again
    client.delete_object(Bucket=bucket, Key="both/.leases/node-7-4242-0000.json")
    with pytest.raises(UserError, match="a push that was killed before its manifest"):
        push(edit_store, url)
