"""Key-spectrum control (experiment E3): reshape W_K's spectrum to a target PR.

The maths (:mod:`.spectrum`), the control of any model :mod:`qkgeom.arch` supports
(:mod:`.keyspectrum`) with its input covariance (:mod:`.moments`), the trainer callback
(:mod:`.callback`) and the recorded per-step key PR (:mod:`.trajectory`).
"""

from __future__ import annotations

from qkgeom.control.callback import KeyControlCallback
from qkgeom.control.keyspectrum import (
    HOWS,
    MODES,
    SCALES,
    SCOPES,
    KeySpectrumControl,
    KeySpectrumParametrization,
    dose_at,
)
from qkgeom.control.moments import InputMoments
from qkgeom.control.spectrum import (
    SpectrumFit,
    apply_target,
    fit_spectrum,
    reshape_spectrum,
    spectral_reshape,
)
from qkgeom.control.trajectory import read_key_pr, reference_table

__all__ = ["HOWS", "MODES", "SCALES", "SCOPES", "InputMoments", "KeyControlCallback",
           "KeySpectrumControl", "KeySpectrumParametrization", "SpectrumFit", "apply_target",
           "dose_at", "fit_spectrum", "read_key_pr", "reference_table", "reshape_spectrum",
           "spectral_reshape"]
