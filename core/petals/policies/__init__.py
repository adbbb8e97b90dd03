"""The swarm's policies as pure functions: placement (which blocks a server hosts, when it moves) and
routing (which servers a client's request crosses).

Each one is a function of a swarm state (arrays built from the records servers announce), a clock
value and a random generator passed in: no networking and no wall clock inside. The live server
(``petals.server.server``), the live client (``petals.client.routing``) and the simulator
(``petals.simulate``) call the very same objects, so what ``petals simulate`` measures is what runs.

Two sets exist: ``ours`` (the product's default) and ``petals22``, Petals 2.2's rules written from its
documented behaviour, kept as the baseline the simulator compares against.
"""

from petals.policies.placement import (
    PLACEMENTS,
    MoveDecision,
    OursPlacement,
    Petals22Placement,
    Placement,
    SwarmView,
    shared_groups,
)
from petals.policies.routing import ROUTINGS, OursRouting, Petals22Routing, RouteCandidates, Routing

__all__ = [
    "PLACEMENTS",
    "ROUTINGS",
    "MoveDecision",
    "OursPlacement",
    "OursRouting",
    "Petals22Placement",
    "Petals22Routing",
    "Placement",
    "RouteCandidates",
    "Routing",
    "SwarmView",
    "shared_groups",
]
