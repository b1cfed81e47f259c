"""A router subscriber in a process of its own, for tests that kill it mid-stream.

Test-only launcher (``tests/connector/test_kv_feed.py``)::

    python -m tests.connector.feed_follower_run ENDPOINT REPLAY_ENDPOINT

Prints ``ready`` once it has its snapshot; then follows the live feed, and for each ``dump`` line on
stdin prints one JSON line: every ``[medium, block hash]`` it holds and how it got there.
"""

from __future__ import annotations

import json
import select
import sys

from tiercache.testing.feed_follower import FeedFollower


def main() -> None:
    follower = FeedFollower(sys.argv[1], sys.argv[2])
    follower.start()
    print("ready", flush=True)
    while True:
        follower.pump(0.02)
        if not select.select([sys.stdin], [], [], 0)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        fold = follower.fold
        print(
            json.dumps(
                {
                    "pairs": sorted([m, h if isinstance(h, int) else h.hex()] for m, h in fold.as_pairs()),
                    "next_seq": fold.next_seq,
                    "snapshots": fold.snapshots,
                    "replays": fold.replays,
                    "skipped": fold.skipped,
                    "applied": fold.applied,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
