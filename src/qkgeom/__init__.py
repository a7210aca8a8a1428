"""qkgeom: geometry of attention queries and keys.

The participation ratios of queries and keys, the interaction spectrum of W_Q W_Kᵀ and
attention entropy (:func:`measure`, for our GPT and supported Hugging Face models), a
trainer that records them (:func:`train`), key-spectrum control, checkpoint families, a
monitor for your own training and the paper's experiments (docs/api.md). The names load on
first use, so ``import qkgeom.analysis`` does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr
from qkgeom.version import __version__

_EXPORTS = {
    "GPTConfig": "qkgeom.config", "TrainConfig": "qkgeom.config",
    "KeyControlConfig": "qkgeom.config", "make_config": "qkgeom.config",
    "from_dict": "qkgeom.config",
    "prepare_data": "qkgeom.data", "load_prepared": "qkgeom.data",
    "QKGeomError": "qkgeom.errors", "DivergedError": "qkgeom.errors",
    "GPT": "qkgeom.model", "measure": "qkgeom.geometry", "Measurement": "qkgeom.geometry",
    "adapter_for": "qkgeom.arch",
    "train": "qkgeom.launch", "RunResult": "qkgeom.training", "Callback": "qkgeom.training",
    "load_config": "qkgeom.runs",
    "KeySpectrumControl": "qkgeom.control",
    "analyze_model": "qkgeom.checkpoints", "analyze_checkpoints": "qkgeom.checkpoints",
    "export_run": "qkgeom.checkpoints",
    "write_report": "qkgeom.analysis", "claims_table": "qkgeom.analysis",
    "GeometryMonitor": "qkgeom.monitor",
}

__all__ = [
    "GPT", "Callback", "DivergedError", "GPTConfig", "GeometryMonitor", "KeyControlConfig",
    "KeySpectrumControl", "Measurement", "QKGeomError", "RunResult", "TrainConfig",
    "__version__", "adapter_for", "analyze_checkpoints", "analyze_model", "claims_table",
    "export_run", "from_dict", "load_config", "load_prepared", "make_config", "measure",
    "prepare_data", "train", "write_report",
]

if TYPE_CHECKING:
    from qkgeom.analysis import claims_table, write_report
    from qkgeom.arch import adapter_for
    from qkgeom.checkpoints import analyze_checkpoints, analyze_model, export_run
    from qkgeom.config import GPTConfig, KeyControlConfig, TrainConfig, from_dict, make_config
    from qkgeom.control import KeySpectrumControl
    from qkgeom.data import load_prepared, prepare_data
    from qkgeom.errors import DivergedError, QKGeomError
    from qkgeom.geometry import Measurement, measure
    from qkgeom.launch import train
    from qkgeom.model import GPT
    from qkgeom.monitor import GeometryMonitor
    from qkgeom.runs import load_config
    from qkgeom.training import Callback, RunResult


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
