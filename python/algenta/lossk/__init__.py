"""lossk: exact, chunked cross-entropy fused with the output projection.

``contract`` holds the status codes, ceilings and budget checks; ``cross_entropy`` the loss,
its gradients and the peak-memory report; ``distillation`` a student head against a teacher's.
"""

from . import contract, cross_entropy, distillation  # noqa: F401
