"""Errors for images that cannot be used. Messages are safe to show to clients."""

from __future__ import annotations


class PreprocessingError(Exception):
    """Base class of the errors raised for an unusable image."""


class InvalidImageError(PreprocessingError):
    """The bytes are not a decodable image (empty, truncated, corrupt, not an image)."""


class UnsupportedFormatError(PreprocessingError):
    """A recognised image format that this server does not decode (TIFF, HEIC, ...)."""


class ImageTooLargeError(PreprocessingError):
    """The image declares more pixels, or a more extreme shape, than the limits allow."""
