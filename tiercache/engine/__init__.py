"""The engine: composes L1 with the lower tiers into one cache (lookup, promotion, write-behind).

It knows tiers only through the tier contract, and nothing of the server that drives it.
"""

from tiercache.engine.engine import TailLookup, TieredEngine
from tiercache.engine.groups import GroupSpec, needed_keys
from tiercache.engine.lookup import LookupResult
from tiercache.engine.promotion import PrefetchTicket, TicketState

__all__ = [
    "GroupSpec",
    "LookupResult",
    "PrefetchTicket",
    "TailLookup",
    "TicketState",
    "TieredEngine",
    "needed_keys",
]
