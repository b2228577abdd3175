"""Problem families: random, realistic OR instances (see :mod:`ordata.families.base`).

Add a family by writing a module with a :class:`~ordata.families.base.Family` subclass and listing
it in :data:`FAMILIES`; the parametrised tests then check every category x representation x API.
"""

from ordata.families.assignment import Assignment
from ordata.families.base import APIS, Family, Spec
from ordata.families.blending import Blending
from ordata.families.diet import Diet
from ordata.families.facility import FacilityLocation
from ordata.families.generic import Generic
from ordata.families.knapsack import Knapsack
from ordata.families.lot_sizing import LotSizing
from ordata.families.network_flow import NetworkFlow
from ordata.families.portfolio import Portfolio
from ordata.families.production import ProductionPlanning
from ordata.families.routing import Routing
from ordata.families.scheduling import Scheduling
from ordata.families.transportation import Transportation

FAMILIES: dict[str, Family] = {f.name: f for f in (
    ProductionPlanning(), Knapsack(), Transportation(), FacilityLocation(), Portfolio(), Diet(), Assignment(),
    LotSizing(), Blending(), Scheduling(), Routing(), NetworkFlow(), Generic(),
)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown problem family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


__all__ = ["APIS", "FAMILIES", "Family", "Spec", "get_family"]
