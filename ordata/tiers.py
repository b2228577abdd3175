"""Difficulty tiers of a generated problem, read off its IR: size, integrality and coupling.

Every curated row carries ``tier`` (``easy`` / ``medium`` / ``hard``) and the three scores it came from, so that
Pass@1 can be reported per tier (``report.json: per_tier``, MLflow ``pass_at_1_tier_<tier>``). The score is a sum:

* **size** -- decision variables: 0 up to :data:`SIZE_STEPS` [0], 1 up to [1], 2 beyond;
* **integrality** -- 0 when every variable is continuous, 1 with integer or binary variables;
* **coupling** -- 1 when some constraint links discrete and continuous variables (a big-M, an opening or an on/off
  decision bounding a flow: what makes a MILP hard to model and to solve), or couples more than
  :data:`DENSE_ROW` variables at once with integer variables present; else 0.

``easy`` is a score of 0-1, ``medium`` 2, ``hard`` 3 or more. A family's ``size`` knob moves the first score, its
categories the second, its formulation the third; docs/data.md lists them per family.
"""

from __future__ import annotations

from ordata.ir import OptModel

TIERS: tuple[str, ...] = ("easy", "medium", "hard")
SIZE_STEPS = (8, 24)  # variables: <= 8 scores 0, <= 24 scores 1, more scores 2
DENSE_ROW = 6  # a constraint over more variables than this couples a discrete model


def difficulty(model: OptModel) -> dict:
    """``{"tier", "size", "integrality", "coupling"}`` of ``model`` (the scores as defined above)."""
    n = len(model.variables)
    size = 0 if n <= SIZE_STEPS[0] else 1 if n <= SIZE_STEPS[1] else 2
    discrete = {v.name for v in model.variables if v.kind != "continuous"}
    integrality = int(bool(discrete))
    coupling = 0
    for con in model.constraints:
        names = con.coeffs.keys()
        k = sum(name in discrete for name in names)
        if 0 < k < len(names) or (discrete and len(names) > DENSE_ROW):
            coupling = 1
            break
    score = size + integrality + coupling
    return {"tier": TIERS[0] if score <= 1 else TIERS[1] if score == 2 else TIERS[2],
            "size": size, "integrality": integrality, "coupling": coupling}
