"""Key-spectrum control (SPEC §4, E3): reshape W_K's singular spectrum to a target PR.

:func:`reshape_spectrum` / :func:`apply_target` are the pure maths;
:class:`KeySpectrumControl` applies it to a model after each optimiser step or as a
``torch.nn.utils.parametrize`` parametrisation; :class:`KeyControlCallback` plugs it into
the trainer.

``KeyControlCallback`` loads on first use, so ``import qkgeom.control`` does not import the
trainer (and the trainer can import this package without an import cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr
from qkgeom.control.keyspectrum import (
    HOWS,
    MODES,
    SCOPES,
    KeySpectrumControl,
    KeySpectrumParametrization,
    find_key_sites,
    target_schedule,
)
from qkgeom.control.spectrum import (
    SpectrumFit,
    apply_target,
    fit_spectrum,
    reshape_spectrum,
    spectral_reshape,
)

if TYPE_CHECKING:
    from qkgeom.control.callback import KeyControlCallback

__all__ = [
    "HOWS",
    "MODES",
    "SCOPES",
    "KeyControlCallback",
    "KeySpectrumControl",
    "KeySpectrumParametrization",
    "SpectrumFit",
    "apply_target",
    "find_key_sites",
    "fit_spectrum",
    "reshape_spectrum",
    "spectral_reshape",
    "target_schedule",
]


__getattr__ = lazy_getattr(__name__, {"KeyControlCallback": "qkgeom.control.callback"},
                           globals())
