"""E3: key-spectrum control during training, runs paired by seed.

``arms`` (arm names, pair groups), ``paired`` (series, paired differences, window means,
effects), ``manipulation`` (the check before any verdict), ``claims`` (E3.1–E3.5, the
mediation table), ``evaluate`` (:func:`e3_analysis`), ``figures`` and ``report``.
"""

from qkgeom.analysis.e3.arms import is_e3, pair_groups, run_arms
from qkgeom.analysis.e3.claims import E3_CLAIMS, evaluate_e3_claims, mediation_table
from qkgeom.analysis.e3.evaluate import e3_analysis
from qkgeom.analysis.e3.manipulation import (
    manipulation_gate,
    manipulation_summary,
    manipulation_units,
)
from qkgeom.analysis.e3.paired import paired_differences

__all__ = ["E3_CLAIMS", "e3_analysis", "evaluate_e3_claims", "is_e3", "manipulation_gate",
           "manipulation_summary", "manipulation_units", "mediation_table", "pair_groups",
           "paired_differences", "run_arms"]
