"""Problem families: random, realistic OR instances (see :mod:`ordata.families.base`).

Add a family by writing a module with a :class:`~ordata.families.base.Family` subclass and listing
it in :data:`FAMILIES`; the parametrised tests then check every category x representation x API.
"""

from ordata.families.aircraft_landing import AircraftLanding
from ordata.families.assignment import Assignment
from ordata.families.base import APIS, Family, Spec
from ordata.families.bin_packing import BinPacking
from ordata.families.blending import Blending
from ordata.families.cutting_stock import CuttingStock
from ordata.families.diet import Diet
from ordata.families.economic_dispatch import EconomicDispatch
from ordata.families.facility import FacilityLocation
from ordata.families.flow_shop import FlowShop
from ordata.families.generic import Generic
from ordata.families.graph_colouring import GraphColouring
from ordata.families.job_shop import JobShop
from ordata.families.knapsack import Knapsack
from ordata.families.lot_sizing import LotSizing
from ordata.families.network_design import NetworkDesign
from ordata.families.network_flow import NetworkFlow
from ordata.families.nurse_rostering import NurseRostering
from ordata.families.p_median import PMedian
from ordata.families.portfolio import Portfolio
from ordata.families.production import ProductionPlanning
from ordata.families.revenue_management import RevenueManagement
from ordata.families.routing import Routing
from ordata.families.scheduling import Scheduling
from ordata.families.set_cover import SetCover
from ordata.families.transportation import Transportation
from ordata.families.unit_commitment import UnitCommitment

FAMILIES: dict[str, Family] = {f.name: f for f in (
    ProductionPlanning(), Knapsack(), Transportation(), FacilityLocation(), Portfolio(), Diet(), Assignment(),
    LotSizing(), Blending(), Scheduling(), Routing(), NetworkFlow(), Generic(),
    # the OptMATH-style breadth (docs/data.md)
    BinPacking(), CuttingStock(), SetCover(), PMedian(), GraphColouring(), NurseRostering(), JobShop(), FlowShop(),
    AircraftLanding(), UnitCommitment(), NetworkDesign(), RevenueManagement(), EconomicDispatch(),
)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown problem family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


__all__ = ["APIS", "FAMILIES", "Family", "Spec", "get_family"]
