"""Exceptions carrying algenta status codes.

Every refusal carries ``.status`` (the numeric code) and ``.status_name``. Refusals of caller
input are ``ValueError`` subclasses; a missing capability of the build or host (no GPU kernels,
no device) and a failed device call are ``RuntimeError`` subclasses.
"""

from __future__ import annotations


class AlgentaError(Exception):
    """Base of every status-carrying algenta error."""

    family = "algenta"

    def __init__(self, message: str, status: int):
        super().__init__(f"[{status} {_name(self.family, status)}] {message}")
        self.status = int(status)
        self.status_name = _name(self.family, status)
        self.reason = message


class LossError(AlgentaError, ValueError):
    """A lossk refusal of caller input (status 581-588)."""

    family = "lossk"


class LossUnavailableError(AlgentaError, RuntimeError):
    """lossk's CUDA backend cannot run here: none in this build (589), no usable device (590),
    or a device call failed (591)."""

    family = "lossk"


class ResidentError(AlgentaError, ValueError):
    """A residentk refusal of caller input (601-603, 606, 607, 609)."""

    family = "residentk"


class ResidentUnavailableError(AlgentaError, RuntimeError):
    """This build or host cannot run a resident session (604, 605) or a device call failed (608)."""

    family = "residentk"


class ResidentWarning(UserWarning):
    """Something a resident session did on its own that the caller should know about (a
    checkpoint's head kept apart from a tied embedding table, as transformers keeps it)."""


_RESIDENT_RUNTIME = {604, 605, 608}
_LOSS_RUNTIME = {589, 590, 591}


def _name(family: str, status: int) -> str:
    from . import _core

    if family == "lossk":
        return _core.lossk.loss_status_name(int(status))
    fn = getattr(_core.residentk, "residentk_status_name", None)
    return fn(int(status)) if fn else str(status)


def from_status(family: str, status: int, message: str) -> AlgentaError:
    """The exception for a (family, status) pair; used by the C++ bindings."""
    if family == "lossk":
        if int(status) in _LOSS_RUNTIME:
            return LossUnavailableError(message, status)
        return LossError(message, status)
    if int(status) in _RESIDENT_RUNTIME:
        return ResidentUnavailableError(message, status)
    return ResidentError(message, status)
