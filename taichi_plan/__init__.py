"""taichi-plan: an offline memory planner for PyTorch training.

Record a training step once (``record``), solve a rematerialization + partition plan
under a memory budget (``solve``), judge it in a simulator (``simulate``) and look at it
(``inspect``). Planning modules never import torch; ``record`` imports it lazily.
"""

from .errors import TaichiError
from .trace import Trace, read_trace, write_trace

__version__ = "0.1.0"

__all__ = ["Trace", "TaichiError", "read_trace", "write_trace", "__version__"]
