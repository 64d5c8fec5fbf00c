"""Tensors of the Open Inference Protocol (KServe v2 / Triton REST), in JSON and binary.

Parses an inference request body (a JSON header, optionally followed by the binary tensor
data of Triton's binary extension, its length given by ``Inference-Header-Content-Length``)
into the images it carries, and renders outputs back, as JSON ``data`` or binary. Every way a
body can lie (bad JSON, nesting deeper than its shape, data that does not fill the shape,
``binary_data_size`` values that do not add up to the binary part, a header length past the
body) is an error with a message, never an exception from deep inside.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, Field, ValidationError

from app.errors import BadRequestError, InvalidInputError, PayloadTooLargeError
from preprocessing import Buffer

# NumPy dtype of each fixed-size datatype this server reads or writes.
NUMERIC: dict[str, np.dtype[Any]] = {"UINT8": np.dtype("<u1"), "FP32": np.dtype("<f4")}
MAX_DIMENSIONS = 8


class MalformedTensorError(InvalidInputError):
    """A tensor whose shape, datatype, data or binary size do not fit together (422)."""


class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(max_length=MAX_DIMENSIONS)
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferenceRequestBody(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[RequestInput] = Field(min_length=1, max_length=16)
    outputs: list[RequestOutput] | None = None


@dataclass(frozen=True)
class Tensor:
    """One input, its elements read: ``bytes`` items for BYTES, an array otherwise."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    items: list[bytes] | None = None
    array: np.ndarray[Any, Any] | None = None


def check_counts(
    name: str, datatype: str, shape: tuple[int, ...], max_images: int, max_bytes: int
) -> None:
    """Refuse a shape that implies more images than ``max_images`` (``MAX_IMAGES_PER_REQUEST``)
    or more bytes than ``max_bytes`` (what one request may carry), before any element of it is
    read: a shape is a claim, and its product can be anything."""
    images = shape[0] if shape else 1
    if images > max_images:
        raise InvalidInputError(
            f"input {name!r}: a request carries 1 to {max_images} images "
            f"(MAX_IMAGES_PER_REQUEST), not {images}"
        )
    dtype = NUMERIC.get(datatype)
    if dtype is not None and math.prod(shape) * dtype.itemsize > max_bytes:
        raise PayloadTooLargeError(
            f"input {name!r}: shape {list(shape)} of {datatype} is more than the "
            f"{max_bytes} bytes a request may carry"
        )


def parse_request(body: Buffer, header_length: str | None) -> tuple[InferenceRequestBody, Buffer]:
    """The JSON header, validated, and the binary part after it (a view of ``body`` when it
    is a memoryview: nothing is copied)."""
    binary: Buffer = b""
    if header_length is None:
        header = body
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise BadRequestError("Inference-Header-Content-Length is not a number") from None
        if not 0 < length <= len(body):
            raise BadRequestError(
                f"Inference-Header-Content-Length ({length}) is not within the body "
                f"({len(body)} bytes)"
            )
        header, binary = body[:length], body[length:]
    try:
        document = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the request is not valid JSON: {exc}") from None
    try:
        return InferenceRequestBody.model_validate(document), binary
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors(include_url=False)[:5]
        )
        raise MalformedTensorError(f"invalid inference request: {problems}") from None


def read_inputs(
    request: InferenceRequestBody, binary: Buffer, max_images: int, max_bytes: int
) -> list[Tensor]:
    """Every input's elements, from its JSON ``data`` or its share of the binary part, each
    shape checked against ``max_images`` and ``max_bytes`` first (``check_counts``)."""
    tensors = []
    offset = 0
    for tensor in request.inputs:
        if any(size < 0 for size in tensor.shape):
            raise MalformedTensorError(f"input {tensor.name!r}: negative dimension in its shape")
        check_counts(tensor.name, tensor.datatype, tuple(tensor.shape), max_images, max_bytes)
        count = math.prod(tensor.shape)
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise MalformedTensorError(
                    f"input {tensor.name!r}: binary_data_size must be a non-negative integer"
                )
            if tensor.data is not None:
                raise MalformedTensorError(
                    f"input {tensor.name!r} has both JSON data and binary_data_size"
                )
            if offset + size > len(binary):
                raise MalformedTensorError(
                    f"input {tensor.name!r}: binary_data_size {size} runs past the binary data "
                    f"({len(binary) - offset} bytes left)"
                )
            raw = binary[offset : offset + size]
            offset += size
            tensors.append(_from_binary(tensor, count, raw))
        elif tensor.data is not None:
            tensors.append(_from_json(tensor, count))
        else:
            raise MalformedTensorError(f"input {tensor.name!r} has neither data nor binary data")
    if offset != len(binary):
        raise MalformedTensorError(
            f"the binary_data_size values add up to {offset} bytes but {len(binary)} follow the "
            f"JSON header"
        )
    return tensors


def _from_binary(tensor: RequestInput, count: int, raw: Buffer) -> Tensor:
    return from_raw(tensor.name, tensor.datatype, tuple(tensor.shape), count, raw)


def from_raw(name: str, datatype: str, shape: tuple[int, ...], count: int, raw: Buffer) -> Tensor:
    """A tensor from its raw little-endian bytes (BYTES: each element a 4-byte length, then
    its bytes), as the binary extension and gRPC's ``raw_input_contents`` carry them."""
    if datatype == "BYTES":
        return Tensor(name, "BYTES", shape, items=_length_prefixed(name, raw, count))
    dtype = NUMERIC.get(datatype)
    if dtype is None:
        raise MalformedTensorError(f"input {name!r}: datatype {datatype} not read")
    if len(raw) != count * dtype.itemsize:
        raise MalformedTensorError(
            f"input {name!r}: {len(raw)} bytes of {datatype} do not make shape "
            f"{list(shape)} ({count * dtype.itemsize} bytes)"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return Tensor(name, datatype, shape, array=array)


def _length_prefixed(name: str, raw: Buffer, count: int) -> list[bytes]:
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(items) == count:  # more elements than the shape says: stop reading them
            raise MalformedTensorError(
                f"input {name!r}: more BYTES elements than its shape's {count}"
            )
        if offset + 4 > len(raw):
            raise MalformedTensorError(f"input {name!r}: a BYTES element's length is cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise MalformedTensorError(f"input {name!r}: a BYTES element runs past its data")
        items.append(bytes(raw[offset : offset + length]))  # its own: the body can go
        offset += length
    if len(items) != count:
        raise MalformedTensorError(
            f"input {name!r}: {len(items)} BYTES elements for a shape of {count}"
        )
    return items


def _flatten(data: list[Any], depth: int) -> list[Any]:
    """Row-major elements of ``data``, nested at most ``depth`` lists deep."""
    flat: list[Any] = []
    for element in data:
        if isinstance(element, list):
            if depth <= 1:
                raise MalformedTensorError("the data is nested deeper than its shape")
            flat.extend(_flatten(element, depth - 1))
        else:
            flat.append(element)
    return flat


def _from_json(tensor: RequestInput, count: int) -> Tensor:
    assert tensor.data is not None
    shape = tuple(tensor.shape)
    flat = _flatten(tensor.data, max(1, len(shape)))
    if len(flat) != count:
        raise MalformedTensorError(
            f"input {tensor.name!r}: {len(flat)} elements for shape {list(shape)} ({count})"
        )
    if tensor.datatype == "BYTES":
        # Images in JSON travel base64-encoded (raw bytes are not valid JSON strings).
        try:
            items = [base64.b64decode(item, validate=True) for item in flat]
        except (TypeError, ValueError, binascii.Error):
            raise MalformedTensorError(
                f"input {tensor.name!r}: BYTES elements in JSON must be base64 strings"
            ) from None
        return Tensor(tensor.name, "BYTES", shape, items=items)
    dtype = NUMERIC.get(tensor.datatype)
    if dtype is None:
        raise MalformedTensorError(f"input {tensor.name!r}: datatype {tensor.datatype} not read")
    if any(isinstance(value, bool) or not isinstance(value, int | float) for value in flat):
        raise MalformedTensorError(f"input {tensor.name!r}: {tensor.datatype} data must be numbers")
    if tensor.datatype == "UINT8" and any(
        not isinstance(value, int) or not 0 <= value <= 255 for value in flat
    ):
        raise MalformedTensorError(f"input {tensor.name!r}: UINT8 data must be integers 0-255")
    array = np.asarray(flat, dtype=dtype).reshape(shape)
    return Tensor(tensor.name, tensor.datatype, shape, array=array)


# -- outputs -------------------------------------------------------------------------------


def bytes_binary(items: list[bytes]) -> bytes:
    """BYTES elements in the binary extension: each a 4-byte little-endian length, then it."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


@dataclass(frozen=True)
class OutputTensor:
    """One output, ready for either transport: FP32, INT64, INT32 and UINT8 as arrays, BYTES
    as strings."""

    name: str
    datatype: str
    shape: list[int]
    values: np.ndarray[Any, Any] | list[str]


def output_entry(tensor: OutputTensor, binary: bool) -> tuple[dict[str, Any], bytes]:
    """One ``$response_output``, and its binary data (empty when it travels as JSON
    ``data``)."""
    entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                             "shape": tensor.shape}  # fmt: skip
    values = tensor.values
    if not binary:
        entry["data"] = values if isinstance(values, list) else values.reshape(-1).tolist()
        return entry, b""
    raw = raw_values(tensor)
    entry["parameters"] = {"binary_data_size": len(raw)}
    return entry, raw


def raw_values(tensor: OutputTensor) -> bytes:
    """An output's values as the binary extension and gRPC's ``raw_output_contents`` carry
    them: little-endian, row-major; BYTES each with its 4-byte length first."""
    if isinstance(tensor.values, list):
        return bytes_binary([value.encode() for value in tensor.values])
    return np.ascontiguousarray(tensor.values, dtype=OUTPUT_DTYPES[tensor.datatype]).tobytes()


OUTPUT_DTYPES: dict[str, np.dtype[Any]] = {
    "FP32": np.dtype("<f4"), "INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"),
    "UINT8": np.dtype("<u1"),
}  # fmt: skip
