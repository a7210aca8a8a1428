"""qkgeom: geometry of attention queries and keys.

Participation ratios of queries and keys (weights and tokens), the interaction spectrum of
W_Q W_Kᵀ, attention entropy, and a trainer for char-level GPTs that records them.
"""

__version__ = "0.1.0"

from qkgeom.config import GPTConfig, TrainConfig, from_dict, make_config  # noqa: E402
from qkgeom.data import load_prepared, prepare_data  # noqa: E402
from qkgeom.errors import DivergedError, QKGeomError  # noqa: E402
from qkgeom.model import GPT  # noqa: E402
from qkgeom.probe import probe  # noqa: E402
from qkgeom.train import Callback, RunResult, train  # noqa: E402

__all__ = [
    "GPT", "GPTConfig", "TrainConfig", "make_config", "from_dict", "train", "RunResult",
    "Callback", "probe", "prepare_data", "load_prepared", "QKGeomError", "DivergedError",
    "__version__",
]
