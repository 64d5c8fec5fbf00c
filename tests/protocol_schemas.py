"""JSON Schemas of the Open Inference Protocol's REST responses, written from the protocol's
OpenAPI document (kserve/open-inference-protocol, ``specification/protocol/
open_inference_rest.yaml`` at revision 18d5991e9e45d291f53103cc79e13ecc6212ffae) and its prose
(``inference_rest.md``), plus Triton's binary tensor data extension, under which an output
sent as binary carries ``parameters.binary_data_size`` instead of ``data``."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_STRING: Schema = {"type": "string"}
_SHAPE: Schema = {"type": "array", "items": {"type": "integer"}}
_PARAMETERS: Schema = {"type": "object"}
_TENSOR_DATA: Schema = {
    "type": "array",
    "items": {"anyOf": [{"$ref": "#/$defs/tensor_data"}, {"type": "number"},
                        {"type": "string"}, {"type": "boolean"}]},
}  # fmt: skip

METADATA_TENSOR: Schema = {
    "type": "object",
    "properties": {"name": _STRING, "datatype": _STRING, "shape": _SHAPE},
    "required": ["name", "datatype", "shape"],
}

SERVER_METADATA: Schema = {
    "type": "object",
    "properties": {"name": _STRING, "version": _STRING,
                   "extensions": {"type": "array", "items": _STRING}},
    "required": ["name", "version", "extensions"],
}  # fmt: skip

MODEL_METADATA: Schema = {
    "type": "object",
    "properties": {
        "name": _STRING,
        "versions": {"type": "array", "items": _STRING},
        "platform": _STRING,
        "inputs": {"type": "array", "items": METADATA_TENSOR},
        "outputs": {"type": "array", "items": METADATA_TENSOR},
    },
    "required": ["name", "platform"],
}

SERVER_LIVE: Schema = {
    "type": "object", "properties": {"live": {"type": "boolean"}}, "required": ["live"],
}  # fmt: skip
SERVER_READY: Schema = {
    "type": "object", "properties": {"ready": {"type": "boolean"}}, "required": ["ready"],
}  # fmt: skip
MODEL_READY: Schema = {
    "type": "object",
    "properties": {"name": _STRING, "ready": {"type": "boolean"}},
    "required": ["name", "ready"],
}

ERROR: Schema = {
    "type": "object", "properties": {"error": _STRING}, "required": ["error"],
}  # fmt: skip

_RESPONSE_OUTPUT: Schema = {
    "type": "object",
    "properties": {"name": _STRING, "shape": _SHAPE, "datatype": _STRING,
                   "parameters": _PARAMETERS, "data": {"$ref": "#/$defs/tensor_data"}},
    # The spec requires "data"; the binary extension replaces it with binary_data_size.
    "required": ["name", "shape", "datatype"],
    "anyOf": [
        {"required": ["data"]},
        {"required": ["parameters"],
         "properties": {"parameters": {"required": ["binary_data_size"]}}},
    ],
}  # fmt: skip

INFERENCE_RESPONSE: Schema = {
    "$defs": {"tensor_data": _TENSOR_DATA},
    "type": "object",
    "properties": {
        "model_name": _STRING,
        "model_version": _STRING,
        "id": _STRING,
        "parameters": _PARAMETERS,
        "outputs": {"type": "array", "items": _RESPONSE_OUTPUT},
    },
    "required": ["model_name", "outputs"],
}
