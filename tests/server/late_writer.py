"""A writer process that stalls in the middle of its store, for the arena-integrity tests.

Test-only::

    python -m tests.server.late_writer ENDPOINT KEY_HEX NBYTES FILL [--overflow N]

It reserves one slot for the key through the real client (``Store.reserve``), prints
``reserved OFFSET``, starts its copy, prints ``copying`` and then waits for a line on its standard
input before it writes: a writer stalled past the moment the client's time rule checked its window
(a stop signal, swap, a long GIL hold would do the same). Given the line, it writes ``NBYTES`` bytes of
``FILL`` into the slot (and ``--overflow`` more bytes past its end: a writer with a length bug),
commits with the digest of what it meant to write and prints ``committed N`` or ``refused CODE``.
"""

from __future__ import annotations

import argparse
import sys

from tiercache.client.client import Client
from tiercache.client.transfer import Store
from tiercache.errors import ServerError, TierCacheError
from tiercache.keys.digest import digest
from tiercache.keys.object_key import ObjectKey


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("key_hex")
    ap.add_argument("nbytes", type=int)
    ap.add_argument("fill", type=int)
    ap.add_argument("--overflow", type=int, default=0)
    args = ap.parse_args(argv)
    key = ObjectKey.from_bytes(bytes.fromhex(args.key_hex))
    data = bytes([args.fill]) * args.nbytes
    with Client(args.endpoint, timeout=30, client_name="late-writer") as client:
        store = Store.reserve(client, [(key, args.nbytes)])
        offset = store.slot(0).offset
        print(f"reserved {offset}", flush=True)

        def write(i: int, target: memoryview) -> int:
            print("copying", flush=True)
            sys.stdin.readline()  # stalled: the copy goes on whenever the test says
            target[:] = data
            if args.overflow:
                store.arena.view(offset + args.nbytes, args.overflow)[:] = bytes([args.fill]) * args.overflow
            return digest(data)

        digests = store.fill(write)
        assert digests is not None
        try:
            print(f"committed {store.commit(digests)}", flush=True)
        except ServerError as exc:
            print(f"refused {exc.code}", flush=True)
        except TierCacheError as exc:
            print(f"refused {type(exc).__name__}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
