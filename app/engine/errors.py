"""Errors that stop the server from starting, each with one line that says what to do."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The configured model, backend or artefact cannot serve; the message says why."""


class MissingExtraError(StartupError):
    """A backend or tool needs an optional dependency that is not installed."""

    def __init__(self, what: str, extra: str, cause: ImportError) -> None:
        super().__init__(
            f"{what} needs the '{extra}' extra: pip install 'batchserve[{extra}]' ({cause})"
        )
        self.extra = extra


class CheckFailedError(StartupError):
    """The backend's answers differ from eager PyTorch's beyond the tolerance."""


class UngatedModelError(StartupError):
    """An INT8 model without a passing accuracy report."""
