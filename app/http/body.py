"""Read the image out of a request without ever buffering more than the limits.

Two limits apply while the body streams in: ``MAX_IMAGE_BYTES`` for this request (413), and
the admission ticket's share of ``MAX_QUEUE_BYTES`` for all requests together (503), which
``reserve`` is told about after every chunk. Multipart bodies are parsed in memory, so the
same two limits bound them: nothing is spooled to disk.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from app.errors import (
    BadRequestError,
    InvalidParameterError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)

# Room for the multipart boundaries and part headers around a file of the maximum size.
_MULTIPART_OVERHEAD = 64 * 1024
_RAW_TYPES = ("application/octet-stream",)


Reserve = Callable[[int], None]


def _no_reservation(total: int) -> None:
    pass


async def read_image(
    request: Request, max_bytes: int, reserve: Reserve = _no_reservation
) -> bytearray:
    """The encoded image: a raw ``image/*`` (or octet-stream) body, or multipart field ``file``.

    ``reserve(total)`` is called with the bytes read so far after each chunk, and may raise to
    stop reading.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type.startswith("image/") or media_type in _RAW_TYPES:
        return await read_raw(request, max_bytes, reserve)
    if media_type == "multipart/form-data":
        return await _read_multipart(request, max_bytes, reserve)
    shown = media_type or "none"
    raise UnsupportedMediaTypeError(
        f"Content-Type {shown} is not accepted: send the image as image/jpeg, image/png, "
        f"image/webp, or as multipart/form-data with a field named 'file'"
    )


def declared_length(request: Request) -> int:
    """The ``Content-Length`` (0 when absent, e.g. for a chunked body)."""
    declared = request.headers.get("content-length")
    if declared is None:
        return 0
    try:
        length = int(declared)
    except ValueError:
        raise BadRequestError("Content-Length is not a number") from None
    if length < 0:
        raise BadRequestError("Content-Length is negative")
    return length


def _check_declared_length(request: Request, limit: int, max_bytes: int) -> None:
    if declared_length(request) > limit:
        raise _too_large(max_bytes)


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the image is larger than {max_bytes} bytes")


async def _limited_stream(
    request: Request, limit: int, max_bytes: int, reserve: Reserve
) -> AsyncGenerator[bytes]:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(max_bytes)  # stop reading: the rest is never buffered
        reserve(received)
        yield chunk


async def read_raw(
    request: Request, max_bytes: int, reserve: Reserve = _no_reservation
) -> bytearray:
    """The whole body, whatever its content type, within ``max_bytes`` (413 beyond)."""
    _check_declared_length(request, max_bytes, max_bytes)
    body = bytearray()
    async for chunk in _limited_stream(request, max_bytes, max_bytes, reserve):
        body += chunk
    return body


async def _read_multipart(request: Request, max_bytes: int, reserve: Reserve) -> bytearray:
    limit = max_bytes + _MULTIPART_OVERHEAD
    _check_declared_length(request, limit, max_bytes)
    parser = MultiPartParser(
        request.headers,
        _limited_stream(request, limit, max_bytes, reserve),
        max_files=1,
        max_fields=16,
        max_part_size=_MULTIPART_OVERHEAD,
    )
    # Keep the file part in memory (it is at most ``limit`` bytes, already counted by
    # ``reserve``) rather than spooling what passes Starlette's 1 MB default to disk.
    parser.spool_max_size = limit
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise InvalidParameterError(f"invalid multipart body: {exc.message}") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidParameterError("the multipart body has no file field named 'file'")
        data = bytearray(await upload.read())
    finally:
        await form.close()
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data
