"""The paper's Table 1 ordering from the simulator (the benchmark's protocol, 3 seeds). Slow."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.sim.config import SimConfig
from gyre.sim.durations import NL2REPO_122B
from gyre.sim.variants import PAPER_ORDER, evaluate, ordering, run_variants


@pytest.mark.slow
def test_table1_ordering_matches_the_paper():
    base = SimConfig(steps=12, seed=0)
    hours = {}
    for name, (_, cfg, _) in run_variants(base, NL2REPO_122B).items():
        hours[name] = float(np.mean([r.total_h for r in evaluate(cfg, NL2REPO_122B, [0, 1, 2], name)]))
    assert ordering(hours) == PAPER_ORDER, hours
    assert hours["A0"] / hours["E0"] > 1.3 and hours["C0"] / hours["E0"] > 1.3
