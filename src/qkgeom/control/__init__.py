"""Key-spectrum control (experiment E3): reshape W_K's singular spectrum to a target PR.

:func:`reshape_spectrum` / :func:`apply_target` are the pure maths (:mod:`.spectrum`);
:class:`KeySpectrumControl` applies it to any model :mod:`qkgeom.arch` supports after each
optimiser step or as a ``torch.nn.utils.parametrize`` parametrisation (:mod:`.keyspectrum`);
:class:`KeyControlCallback` plugs it into the trainer (:mod:`.callback`).
"""

from __future__ import annotations

from qkgeom.control.callback import KeyControlCallback
from qkgeom.control.keyspectrum import (
    HOWS,
    MODES,
    SCOPES,
    KeySpectrumControl,
    KeySpectrumParametrization,
    target_schedule,
)
from qkgeom.control.spectrum import (
    SpectrumFit,
    apply_target,
    fit_spectrum,
    reshape_spectrum,
    spectral_reshape,
)

__all__ = [
    "HOWS",
    "MODES",
    "SCOPES",
    "KeyControlCallback",
    "KeySpectrumControl",
    "KeySpectrumParametrization",
    "SpectrumFit",
    "apply_target",
    "fit_spectrum",
    "reshape_spectrum",
    "spectral_reshape",
    "target_schedule",
]
