"""Where the model runs and in which precision."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from preprocessing.device import probe_decoder

logger = logging.getLogger("batchserve")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class DeviceError(RuntimeError):
    """The configured device or precision is not available on this machine."""


def resolve_device(setting: str, worker_index: int = 0) -> torch.device:
    """``auto`` is a CUDA device when there is one (worker i of a host takes GPU i, round
    robin), else the CPU."""
    if setting == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", worker_index % torch.cuda.device_count())
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"BATCHSERVE_DEVICE={setting} but CUDA is not available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"BATCHSERVE_DEVICE={setting} but only {torch.cuda.device_count()} GPU(s) exist"
            )
        return torch.device("cuda", index)
    return device


def cpu_supports_bf16() -> bool:
    """True when oneDNN has native bf16 kernels here (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def precision_candidates(
    setting: str, device: torch.device, native_bf16: bool
) -> tuple[torch.dtype, ...]:
    """The precisions worth serving, most accurate first.

    ``auto``: fp16 on CUDA; on a CPU, fp32 and, where oneDNN reports native bf16 kernels
    (``native_bf16``), bf16
    too: the engine then measures both and keeps bf16 only if it is clearly faster, because the
    flag alone does not say so (some CPUs that report it run bf16 slower than fp32).
    """
    if setting == "auto":
        if device.type == "cuda":
            return (torch.float16,)
        return (torch.float32, torch.bfloat16) if native_bf16 else (torch.float32,)
    dtype = DTYPES[setting]
    if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("BATCHSERVE_PRECISION=bf16 but this GPU has no bf16 support")
    return (dtype,)


def resolve_decode_device(
    setting: str,
    device: torch.device,
    probe: Callable[[torch.device], str | None] = probe_decoder,
) -> bool:
    """Whether JPEGs are decoded on the model's device (nvjpeg) rather than the CPU: with
    ``auto`` on CUDA, when one test decode on the device works (else the CPU, said loudly);
    with ``cuda``, start-up fails when it does not."""
    if setting == "cuda" and device.type != "cuda":
        raise DeviceError("BATCHSERVE_DECODE_DEVICE=cuda needs the model on a CUDA device")
    wanted = device.type == "cuda" if setting == "auto" else setting == "cuda"
    if not wanted:
        return False
    failure = probe(device)
    if failure is None:
        return True
    if setting == "cuda":
        raise DeviceError(f"BATCHSERVE_DECODE_DEVICE=cuda but {device}'s JPEG decoder "
                          f"failed a test image: {failure}")  # fmt: skip
    logger.critical(
        "JPEGs are decoded on the CPU, not on %s: its JPEG decoder failed a test image (%s)",
        device, failure,
    )  # fmt: skip
    return False
