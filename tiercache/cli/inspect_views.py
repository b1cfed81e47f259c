"""What ``tiercache inspect`` prints: its ``rich`` tables and lines, apart from parsing and sources.

Each view takes the data a source returned (the same dicts ``--json`` prints, see
:mod:`tiercache.cli.sources`) and either returns a renderable (the summary, which ``--watch`` redraws)
or prints to stdout (keys, fingerprints, explain). Nothing here reaches a server or storage, so the
command module (:mod:`tiercache.cli.inspect`) decides what to show and this module only how.
"""

from __future__ import annotations

from typing import Any

from tiercache.cli.output import console as stdout_console
from tiercache.cli.output import format_bytes
from tiercache.cli.sources import hit_rate
from tiercache.config.values import TIER_ORDER
from tiercache.server.tenants import held_bytes, missed_chunks

__all__ = ["print_explain", "print_fingerprints", "print_keys", "summary_view", "tenant_view"]


def _size(n: Any) -> str:
    return "-" if n is None else format_bytes(n)


# -- summary ---------------------------------------------------------------------------------------
_LIVE_COLUMNS = ("hit rate", "hits", "misses", "evictions", "verify failures", "errors", "skipped")


def summary_view(data: dict[str, Any]) -> Any:
    """The per-tier table of a summary, then its engine and server lines (live) or a note (offline)."""
    from rich.console import Group

    live = data["source"] == "server"
    parts: list[Any] = [_tier_table(data, live)]
    if live:
        parts += _live_lines(data)
    else:
        parts.append("offline: stored data only; hit rates, evictions and errors live in a server's memory")
    return Group(*parts)


def _tier_table(data: dict[str, Any], live: bool) -> Any:
    from rich.table import Table

    table = Table(title=f"tiercache: {data['where']}", title_justify="left")
    for col in ("tier", "used", "budget", "use", "objects"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    if live:
        for col in _LIVE_COLUMNS:
            table.add_column(col, justify="right")
    else:
        table.add_column("fingerprints", justify="right")
    for name, t in data["tiers"].items():
        table.add_row(*_tier_row(name, t, live))
    return table


def _tier_row(name: str, t: dict[str, Any], live: bool) -> list[str]:
    budget = t.get("bytes_budget")
    use = f"{100 * t['bytes_used'] / budget:.1f}%" if budget else "-"
    row = [name, _size(t["bytes_used"]), _size(budget), use, str(t["objects"])]
    if not live:
        # Offline there are no counters: only what the stored data itself tells.
        return [*row, str(t.get("fingerprints", 0))]
    rate = t.get("hit_rate")
    ev = t.get("evictions") or {}
    return [
        *row,
        "-" if rate is None else f"{100 * rate:.1f}%",
        str(t.get("hits", 0)),
        str(t.get("misses", 0)),
        ", ".join(f"{r} {n}" for r, n in sorted(ev.items())) or "0",
        str(t.get("verify_failures", 0)),
        str(t.get("errors", 0)),
        str(t.get("skipped", 0)),
    ]


def _live_lines(data: dict[str, Any]) -> list[str]:
    """The lines under a live server's table; each optional line is there only when its counters are
    (an older server lacks them) or, for tails, when some engine uses them."""
    e = data.get("engine", {})
    srv = data.get("server", {})
    lines = [
        f"engine: lookups {e.get('lookups', 0)}, stores {e.get('stores', 0)} "
        f"(dropped {e.get('stores_dropped', 0)}), queue drops l2 {e.get('l2_queue_drops', 0)} / "
        f"l3 {e.get('l3_queue_drops', 0)}, queue depth l2 {e.get('l2_queue_depth', 0)} / "
        f"l3 {e.get('l3_queue_depth', 0)}, write failures {e.get('write_failures', 0)}, "
        f"promotions {e.get('promotions', 0)}"
    ]
    if "writeback_lost_queue_full" in e:
        lines.append(_writeback_lost_line(e))
    if "l3_admitted" in e and "s3" in data["tiers"]:
        lines.append(_l3_admission_line(e))
    if e.get("tail_lookups", 0) or e.get("tails_superseded", 0):
        lines.append(
            f"tails: lookups {e.get('tail_lookups', 0)}, blocks found {e.get('tail_blocks_hit', 0)}, "
            f"superseded {e.get('tails_superseded', 0)}, block index {e.get('tail_index_blocks', 0)} blocks"
        )
    lines.append(
        f"server: clients {srv.get('clients', 0)}, requests {srv.get('requests', 0)}, "
        f"errors {srv.get('errors', 0)}, in flight {srv.get('in_flight', 0)}"
    )
    lines.append(_trust_line(srv))
    if "zmq_connections_closed" in srv:  # a unix:// server
        lines.append(_unix_line(srv))
    if "integrity_failures_l1_read" in e:
        lines.append(_integrity_line(e, data["tiers"].get("l1", {})))
    return lines


_WRITEBACK_LOST = {
    "queue_full": "S3 queue full",
    "write_failed": "S3 write failed",
    "shutdown": "at shutdown",
}


def _trust_line(server: dict[str, Any]) -> str:
    """Leases released after they expired (those loads were recomputed) and requests refused for
    not proving their session: both stay at zero on a healthy node."""
    lost, unsigned = int(server.get("leases_lost", 0)), int(server.get("refused_unsigned", 0))
    line = f"leases lost: {lost} (copies outlived their lease; the loads were recomputed)"
    if lost:
        line += "; raise --l1-lease-ttl-s above the slowest copy (docs/caveats.md)"
    line += f", requests refused unsigned: {unsigned}"
    failed, held = int(server.get("hellos_failed", 0)), int(server.get("hellos_held", 0))
    return line + f", failed hellos: {failed} (+{held} held unchecked; a wrong --auth-secret, or guesses)"


def _unix_line(server: dict[str, Any]) -> str:
    """Connections a ``unix://`` server closed at once: from another user's process, and from
    clients that speak ZeroMQ (given ``ipc://`` for this socket); both stay at zero on a healthy node."""
    zmq_peers = int(server.get("zmq_connections_closed", 0))
    line = (
        f"unix socket: connections closed from another user {int(server.get('connections_refused', 0))}, "
        f"for speaking ZeroMQ {zmq_peers}"
    )
    if zmq_peers:
        line += " (clients given ipc:// for this unix:// socket: point them at unix://, the server's log names them)"
    return line


_INTEGRITY_PATHS = {
    "l1_read": "client loads",
    "server_read": "server gets",
    "promotion": "promotions",
    "write_through": "write-through",
}


def _integrity_line(engine: dict[str, Any], l1: dict[str, Any]) -> str:
    """Copies out of L1 that failed their object's digest (by where caught; each was a miss), and
    the slots of abandoned reservations kept out of use: the first stays at zero on a healthy node."""
    failed = {path: int(engine.get(f"integrity_failures_{path}", 0)) for path in _INTEGRITY_PATHS}
    line = f"integrity failures: {sum(failed.values())} (" + ", ".join(
        f"{label} {failed[path]}" for path, label in _INTEGRITY_PATHS.items()
    )
    line += (
        f"); quarantined slots: {int(l1.get('quarantined', 0))} "
        f"({_size(l1.get('quarantine_bytes', 0))} now; their writers came back late: "
        f"{int(l1.get('quarantine_writer_done', 0))})"
    )
    if sum(failed.values()):
        line += "; a client wrote into slots not its own: see the server log (docs/caveats.md)"
    return line


def _writeback_lost_line(engine: dict[str, Any]) -> str:
    """Chunks lost on write-back: evicted from disk, never written to S3, in no tier now."""
    lost = {reason: int(engine.get(f"writeback_lost_{reason}", 0)) for reason in _WRITEBACK_LOST}
    shown = [f"{_WRITEBACK_LOST[r]} {n}" for r, n in lost.items() if n or r != "shutdown"]
    line = f"lost on write-back: {sum(lost.values())} chunks in no tier ({', '.join(shown)})"
    if lost["queue_full"]:
        line += "; raise --write-queue-depth (docs/caveats.md)"
    return line


def _l3_admission_line(engine: dict[str, Any]) -> str:
    """What the S3 admission rule decided: chunks handed to S3, kept from it (by why), undecided."""
    unread, untracked = int(engine.get("l3_refused_unread", 0)), int(engine.get("l3_refused_untracked", 0))
    return (
        f"S3 admission: admitted {int(engine.get('l3_admitted', 0))}, refused {unread + untracked} "
        f"(unread {unread}, untracked {untracked}), waiting {int(engine.get('l3_admission_waiting', 0))}"
    )


_TIER_RANK = {name: i for i, name in enumerate(TIER_ORDER)}


def tenant_view(tenants: dict[str, Any]) -> Any:
    """A table per tenant (``--by-tenant``): bytes against quota per tier, evictions, lookups, hit rate."""
    from rich.table import Table

    tiers = sorted(
        {t for r in tenants.values() for t in r.get("tiers", {})},
        key=lambda t: _TIER_RANK.get(t, len(_TIER_RANK)),
    )
    table = Table(title="per tenant", title_justify="left")
    table.add_column("tenant")
    for tier in tiers:
        for col in ("used", "quota", "objects", "evictions"):
            table.add_column(f"{tier} {col}", justify="right")
    for col in ("lookups", "chunk hit rate"):
        table.add_column(col, justify="right")
    ranked = sorted(tenants.items(), key=lambda kv: (-held_bytes(kv[1]), kv[0]))
    for label, record in ranked:
        table.add_row(*_tenant_row(label, record, tiers))
    return table


def _tenant_row(label: str, record: dict[str, Any], tiers: list[str]) -> list[str]:
    row = [label]
    for tier in tiers:
        t = record.get("tiers", {}).get(tier)
        if t is None:
            row += ["-"] * 4
            continue
        quota = t.get("quota_bytes")
        row += [
            _size(t.get("bytes", 0)),
            "-" if quota is None else _size(quota),
            str(t.get("objects", 0)),
            str(t.get("evictions", 0)),
        ]
    rate = hit_rate(int(record.get("hit_chunks", 0)), missed_chunks(record))
    return [*row, str(record.get("lookups", 0)), "-" if rate is None else f"{100 * rate:.1f}%"]


# -- keys ------------------------------------------------------------------------------------------
def print_keys(page: list[dict[str, Any]], next_cursor: bytes, where: str) -> None:
    """One page of keys as a table, then the cursor of the next page (or that this was the last)."""
    from rich.table import Table

    table = Table(title=f"keys: {where}", title_justify="left")
    for col in ("fingerprint", "group", "prefix hash", "tiers"):
        table.add_column(col, no_wrap=True)
    for item in page:
        fp, group, h = item["key"].split("/")
        table.add_row(fp, group[1:], h, ",".join(item["tiers"]))
    console = stdout_console()
    console.print(table)
    if next_cursor:
        console.print(f"more: --cursor {next_cursor.hex()}")
    else:
        console.print(f"{len(page)} key(s); last page")


# -- fingerprints ----------------------------------------------------------------------------------
_FIELDS = (
    ("model", "model_id"),
    ("revision", "model_revision"),
    ("kv dtype", "kv_dtype"),
    ("quantization", "kv_quantization"),
    ("backend", "attention_backend"),
    ("kv layout", "kv_layout"),
    ("kernel block", "kernel_block_size"),
    ("manager block", "manager_block_size"),
    ("page bytes", "page_bytes"),
    ("page bytes unpadded", "page_bytes_unpadded"),
    ("group kind", "group_kind"),
    ("sliding window", "sliding_window"),
    ("chunk size", "chunk_size"),
    ("layers", "num_layers"),
    ("state shapes", "state_shapes"),
    ("state dtypes", "state_dtypes"),
    ("TP size/rank", ("tp_size", "tp_rank")),
    ("PP size/rank", ("pp_size", "pp_rank")),
    ("DCP size/rank", ("dcp_size", "dcp_rank")),
    ("extra", "extra"),
    ("format", "format_version"),
)


def _field(m: dict[str, Any] | None, name: Any) -> str:
    if m is None:
        return "?"
    if isinstance(name, tuple):
        return "/".join(str(m.get(n)) for n in name)
    value = m.get(name)
    if value in (None, [], (), {}):
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def print_fingerprints(rows: list[dict[str, Any]], where: str) -> None:
    """Every fingerprint's manifest side by side, fields that differ between them in bold."""
    console = stdout_console()
    if not rows:
        console.print(f"no fingerprints: {where} holds no objects or manifests")
        return
    from rich.table import Table

    table = Table(title=f"fingerprints: {where}", title_justify="left")
    table.add_column("field")
    for r in rows:
        table.add_column(r["fingerprint"], overflow="fold")
    objects = [
        f"{r['objects']} ({', '.join(f'g{g}: {n}' for g, n in r['groups'].items()) or 'none'})" for r in rows
    ]
    table.add_row("objects", *objects)
    for label, name in _FIELDS:
        values = [_field(r["manifest"], name) for r in rows]
        differs = len(set(values)) > 1
        table.add_row(f"[bold]{label}[/]" if differs else label, *values)
    console.print(table)
    if any(r["manifest"] is None for r in rows):
        console.print("?: no manifest stored for that fingerprint")
    if len(rows) > 1:
        console.print("bold fields differ between layouts: engines with different values never share chunks")


# -- explain ---------------------------------------------------------------------------------------
def _status_text(e: dict[str, Any]) -> str:
    s = e["status"]
    if s == "never_stored":
        return "[dim]never stored[/]"
    if s == "evicted":
        age = "" if e.get("age_s") is None else f", {e['age_s']:.1f} s ago"
        return f"[yellow]evicted from {e['tier']} ({e['reason']}{age})[/]"
    if s == "other_fingerprint":
        return f"[magenta]under other fingerprint {e['other_fingerprint']}[/]"
    return f"[green]{s}[/]"


def print_explain(report: dict[str, Any], where: str) -> None:
    """An explain report (:func:`~tiercache.cli.sources.explain_report`): a chunk × group table of
    where each chunk lives or why not, the column legend and the restorable prefix."""
    from rich.table import Table

    console = stdout_console()
    chunk = report["chunk_size"]
    if not report["chunks"]:
        console.print(
            f"{report['tokens']} token(s) make no full chunk of {chunk}: nothing is ever stored for them"
        )
        return
    table = Table(title=f"explain: {where}", title_justify="left")
    table.add_column("chunk", justify="right")
    table.add_column("tokens", justify="right")
    cols = [(g["fingerprint"], g["object_group"]) for g in report["groups"]]
    for fp, g in cols:
        table.add_column(f"{fp[:12]}…/g{g}")
    cells: dict[tuple[int, str, int], str] = {
        (e["chunk"], e["fingerprint"], e["object_group"]): _status_text(e) for e in report["entries"]
    }
    for i in range(report["chunks"]):
        row = [str(i), f"{i * chunk}-{(i + 1) * chunk - 1}"]
        row += [cells.get((i, fp, g), "?") for fp, g in cols]
        table.add_row(*row)
    console.print(table)
    for fp, g in cols:
        console.print(f"  {fp[:12]}…/g{g} = {fp} group {g}")
    p = report["prefix_chunks"]
    console.print(
        f"restorable prefix: {p} of {report['chunks']} chunk(s) ({p * chunk} of {report['tokens']} tokens) "
        "held for every group"
    )
