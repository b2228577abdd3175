"""T-Rex kernels: one op per module, each with a torch reference implementation (see registry)."""

from kernels.registry import backends, get, register  # noqa: F401
from kernels.rms_norm import rms_norm  # noqa: F401
