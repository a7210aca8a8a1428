"""Key-spectrum control (experiment E3): reshape W_K's singular spectrum to a target PR.

:func:`reshape_spectrum` / :func:`apply_target` are the pure maths (:mod:`.spectrum`);
:class:`KeySpectrumControl` applies it to any model :mod:`qkgeom.arch` supports after each
optimiser step or as a ``torch.nn.utils.parametrize`` parametrisation (:mod:`.keyspectrum`),
keeping ‖W_K‖_F or the mean squared key norm on the layer's inputs (:mod:`.moments`);
:class:`KeyControlCallback` plugs it into the trainer (:mod:`.callback`) and records the
per-step key PR a paired run's cap refers to (:mod:`.trajectory`).
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

__all__ = [
    "HOWS",
    "MODES",
    "SCALES",
    "SCOPES",
    "InputMoments",
    "KeyControlCallback",
    "KeySpectrumControl",
    "KeySpectrumParametrization",
    "SpectrumFit",
    "apply_target",
    "dose_at",
    "fit_spectrum",
    "read_key_pr",
    "reference_table",
    "reshape_spectrum",
    "spectral_reshape",
]
