"""lossk: exact, chunked cross-entropy fused with the output projection.

``contract`` holds the status codes, ceilings and budget checks; ``cross_entropy`` the loss,
its gradients and the peak-memory report.
"""

from . import contract, cross_entropy  # noqa: F401
