"""residentk: would a resident GPU decode session hold this model shape, and what would it cost.

``contract`` holds the status codes (600-619), ceilings, shape/context checks, resident sizing and
the split-K / prefill-tile policies, all host arithmetic; ``probe`` adds the two device facts
(were CUDA kernels compiled in, is a usable device present); ``presets`` the Qwen3 family shapes
that ``algenta plan`` sizes.
"""

from . import contract, presets, probe  # noqa: F401
from .probe import ResidentProbe  # noqa: F401
from .session import ResidentSession  # noqa: F401,E402
