"""qkgeom: geometry of attention queries and keys.

Participation ratios of queries and keys (weights and tokens), the interaction spectrum of
W_Q W_Kᵀ, attention entropy, and a trainer for char-level GPTs that records them.

The names below load on first use, so ``import qkgeom.analysis`` (pandas only) does not pay
for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "GPTConfig": "qkgeom.config", "TrainConfig": "qkgeom.config",
    "make_config": "qkgeom.config", "from_dict": "qkgeom.config",
    "prepare_data": "qkgeom.data", "load_prepared": "qkgeom.data",
    "QKGeomError": "qkgeom.errors", "DivergedError": "qkgeom.errors",
    "GPT": "qkgeom.model", "probe": "qkgeom.geometry.probe",
    "train": "qkgeom.training", "RunResult": "qkgeom.training", "Callback": "qkgeom.training",
    "analyze_model": "qkgeom.pretrained", "analyze_checkpoints": "qkgeom.pretrained",
    "write_e4_report": "qkgeom.pretrained", "export_run": "qkgeom.pretrained",
    "GeometryMonitor": "qkgeom.monitor",
}

__all__ = [
    "GPT", "GPTConfig", "TrainConfig", "make_config", "from_dict", "train", "RunResult",
    "Callback", "probe", "prepare_data", "load_prepared", "QKGeomError", "DivergedError",
    "analyze_model", "analyze_checkpoints", "write_e4_report", "export_run", "__version__",
    "GeometryMonitor",
]

if TYPE_CHECKING:
    from qkgeom.config import GPTConfig, TrainConfig, from_dict, make_config
    from qkgeom.data import load_prepared, prepare_data
    from qkgeom.errors import DivergedError, QKGeomError
    from qkgeom.geometry.probe import probe
    from qkgeom.model import GPT
    from qkgeom.monitor import GeometryMonitor
    from qkgeom.pretrained import analyze_checkpoints, analyze_model, export_run, write_e4_report
    from qkgeom.training import Callback, RunResult, train


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
