"""fastattn's exceptions: one hierarchy, one class per status code of the C++ core.

Every class also inherits the builtin a caller would naturally catch, so
``except ValueError`` catches a bad config and ``except NotImplementedError`` a
config cuDNN refuses, without importing fastattn's classes.
"""

__all__ = [
    "FastAttnError",
    "InvalidArgumentError",
    "NotSupportedError",
    "VerificationFailedError",
    "LibraryError",
    "CudaError",
    "CudnnError",
    "CorruptPlanError",
    "InternalError",
    "error_for_code",
]


class FastAttnError(Exception):
    """Base of every error fastattn raises."""

    code = -1


class InvalidArgumentError(FastAttnError, ValueError):
    """A config field, pointer or argument is invalid; the message names it and its value."""

    code = 1


class NotSupportedError(FastAttnError, NotImplementedError):
    """cuDNN refuses this config on this GPU; the message is cuDNN's own reason."""

    code = 2


class VerificationFailedError(NotSupportedError):
    """The plan cuDNN built failed verification (verify=True, `--verify`): it computed
    outputs beyond the tolerance of a float32 reference, or non-finite ones, on the data
    tried. Refused like cuDNN's refusals, and remembered: `verdict` (a
    fastattn.verdict.Verdict) carries the evidence, the message says it. Python only:
    no C++ status returns it (its code is NotSupportedError's)."""

    def __init__(self, message: str, verdict=None):
        super().__init__(message)
        self.verdict = verdict


class LibraryError(FastAttnError, OSError):
    """A library fastattn needs (cuDNN, the CUDA runtime, NVRTC, cuBLASLt, the driver) is
    missing or unusable; the message says which and how to install it."""

    code = 3


class CudaError(FastAttnError, RuntimeError):
    """A CUDA runtime or driver call failed (no device, bad stream, ...)."""

    code = 4


class CudnnError(FastAttnError, RuntimeError):
    """cuDNN failed while running a plan it had accepted."""

    code = 5


class CorruptPlanError(FastAttnError, ValueError):
    """A serialized plan could not be parsed or loaded by this cuDNN."""

    code = 6


class InternalError(FastAttnError, RuntimeError):
    """A bug in fastattn: please report it with the message."""

    code = 7


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotSupportedError,
        LibraryError,
        CudaError,
        CudnnError,
        CorruptPlanError,
        InternalError,
    )
}


def error_for_code(code: int, message: str) -> FastAttnError:
    """The exception for a C++ status; an unknown code is an InternalError."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return InternalError(f"unknown status code {code}: {message}")
    return cls(message)
