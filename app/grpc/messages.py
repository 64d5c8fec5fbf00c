"""A ``ModelInferRequest`` read into the serving core's inputs, off the event loop.

Every count is checked against the limits before an element is read: the images a shape
implies against ``MAX_IMAGES_PER_REQUEST``, and the bytes it implies against what one message
may hold. Arrays are made by NumPy straight from the message's buffers: a raw input is viewed
where it lies, and typed ``contents`` are taken from the field's packed encoding (the
message's serialised form, made in C), never element by element as Python numbers, which
would hold the GIL, and with it the event loop, for seconds on a large tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from app.protocol.model_io import RequestedOutput, one_input, requested_outputs
from app.protocol.tensors import (
    MAX_DIMENSIONS,
    NUMERIC,
    MalformedTensorError,
    Tensor,
    check_counts,
    from_raw,
)
from app.serving.inference import Inputs

# Each typed ``contents`` field a datatype's elements are read from, and its field number.
_CONTENTS = {"BYTES": ("bytes_contents", 8), "UINT8": ("uint_contents", 4),
             "FP32": ("fp32_contents", 6)}  # fmt: skip


def read_request(
    request: Any,
    max_images: int,
    max_bytes: int,
    classes: int,
    task: str = "classify",
    instances: tuple[str, ...] = (),
) -> tuple[Inputs, list[RequestedOutput]]:
    """The request's one input and the outputs it asks for (``MalformedTensorError`` and
    friends when it does not fit). Its raw contents are released from the message."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise MalformedTensorError(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs"
        )
    tensors = []
    for index, tensor in enumerate(request.inputs):
        shape = tuple(tensor.shape)
        if len(shape) > MAX_DIMENSIONS or any(size < 0 for size in shape):
            raise MalformedTensorError(f"input {tensor.name!r}: a shape of at most "
                                       f"{MAX_DIMENSIONS} non-negative dimensions")  # fmt: skip
        check_counts(tensor.name, tensor.datatype, shape, max_images, max_bytes)
        count = math.prod(shape)
        if raw:
            tensors.append(from_raw(tensor.name, tensor.datatype, shape, count, raw[index]))
        else:
            tensors.append(_from_contents(tensor, shape, count))
    # The message's own copy of the tensors is not needed again (the arrays and images made
    # above hold what they need).
    request.ClearField("raw_input_contents")
    del raw
    return one_input(tensors), _outputs(request, classes, task, instances)


def _from_contents(tensor: Any, shape: tuple[int, ...], count: int) -> Tensor:
    found = _CONTENTS.get(tensor.datatype)
    if found is None:
        raise MalformedTensorError(f"input {tensor.name!r}: datatype {tensor.datatype} not read")
    field, number = found
    container = getattr(tensor.contents, field)
    if len(container) != count:  # a length, not a pass over the elements
        raise MalformedTensorError(
            f"input {tensor.name!r}: {len(container)} elements for shape {list(shape)} ({count})"
        )
    if tensor.datatype == "BYTES":
        return Tensor(tensor.name, "BYTES", shape, items=list(container))
    packed = packed_field(tensor.contents.SerializeToString(), number)
    if tensor.datatype == "FP32":
        array = np.frombuffer(packed, dtype=NUMERIC["FP32"])
    else:
        array = uint8_varints(tensor.name, packed, count)
    return Tensor(tensor.name, tensor.datatype, shape, array=array.reshape(shape))


def packed_field(message: bytes, number: int) -> bytes:
    """The payload of field ``number`` in a serialised ``InferTensorContents``. Every field
    of that message is length-delimited once serialised (repeated numbers are packed), so each
    is a tag, a length and its bytes."""
    view = memoryview(message)
    offset, chunks = 0, []
    while offset < len(view):
        tag, offset = _varint(view, offset)
        length, offset = _varint(view, offset)
        if tag & 7 != 2 or offset + length > len(view):
            raise MalformedTensorError("the tensor's contents are not a packed field")
        if tag >> 3 == number:
            chunks.append(view[offset : offset + length])
        offset += length
    return b"".join(chunks)


def _varint(view: memoryview, offset: int) -> tuple[int, int]:
    value = shift = 0
    while offset < len(view) and shift < 64:
        byte = view[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, offset
        shift += 7
    raise MalformedTensorError("the tensor's contents are cut short")


def uint8_varints(name: str, packed: bytes, count: int) -> np.ndarray[Any, Any]:
    """Packed varints that must each be 0-255, decoded by NumPy: a value under 128 is one
    byte, one up to 16383 two bytes, anything longer is too large."""
    data = np.frombuffer(packed, dtype=np.uint8)
    if len(data) == count:  # every value under 128: one byte each
        return data
    ends = np.flatnonzero(data < 0x80)
    if count == 0 or len(ends) != count or ends[-1] != len(data) - 1:
        raise MalformedTensorError(f"input {name!r}: UINT8 data must be integers 0-255")
    starts = np.empty_like(ends)
    starts[0], starts[1:] = 0, ends[:-1] + 1
    if np.any(ends - starts > 1):
        raise MalformedTensorError(f"input {name!r}: UINT8 data must be integers 0-255")
    low = (data[starts] & 0x7F).astype(np.uint16)
    high = np.where(ends > starts, data[ends].astype(np.uint16) << 7, 0)
    values = low | high
    if values.max(initial=0) > 255:
        raise MalformedTensorError(f"input {name!r}: UINT8 data must be integers 0-255")
    return values.astype(np.uint8)


def _parameter(parameter: Any) -> Any:
    """An ``InferParameter``'s value, whichever of its fields is set."""
    field = parameter.WhichOneof("parameter_choice")
    return None if field is None else getattr(parameter, field)


def parameter(parameters: Any, name: str) -> Any:
    """The value of parameter ``name`` of a message's ``parameters`` map (None: absent)."""
    return _parameter(parameters[name]) if name in parameters else None


def _outputs(
    request: Any, classes: int, task: str, instances: tuple[str, ...]
) -> list[RequestedOutput]:
    asked = [(output.name, parameter(output.parameters, "classification") or None, True)
             for output in request.outputs]  # fmt: skip
    return requested_outputs(task, asked, classes, instances=instances)
