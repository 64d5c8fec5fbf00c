"""Export the model for the inference runtimes: ONNX with a dynamic batch axis, OpenVINO IR.

Known traps, and what guards against each:

- the dynamo ONNX exporter fixes the batch dimension when the example batch has one row
  (pytorch/pytorch#157621): the example has two rows and the batch axis is declared dynamic;
- it has produced silently wrong ResNets in some releases (pytorch/pytorch#169178, #166797):
  every artefact is compared with eager PyTorch at start-up before it serves (``check.py``);
- OpenVINO's ``save_model`` compresses weights to fp16 by default: turned off, so that an fp32
  IR is an fp32 model.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.engine.errors import MissingExtraError, StartupError

logger = logging.getLogger("batchserve")

OPSET = 18
ONNX_FILE = "model.onnx"
OPENVINO_FILE = "model.xml"
INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def onnx_exporter() -> str:
    """The exporter and its version, part of every ONNX artefact's key."""
    return f"onnx-torch{torch.__version__.split('+')[0]}-opset{OPSET}"


def openvino_exporter() -> str:
    ov = import_openvino()
    return f"openvino{ov.get_version().split('-')[0]}-from-{onnx_exporter()}"


def export_onnx(
    module: nn.Module,
    input_shape: tuple[int, int, int],
    path: Path,
    outputs: tuple[str, ...] = (OUTPUT_NAME,),
    any_canvas: int | None = None,
) -> None:
    """Write ``module`` (fp32, on the CPU) to ``path`` with a dynamic batch axis, its outputs
    named ``outputs`` (one, the logits, but for a detector's graph); with ``any_canvas``, a
    dynamic height and width too, multiples of it (a model whose input follows each image's
    size)."""
    example = torch.randn((2, *input_shape), generator=torch.Generator().manual_seed(0))
    axes: dict[int, Any] = {0: torch.export.Dim("batch", min=1, max=4096)}
    if any_canvas is not None:
        axes.update(canvas_axes(any_canvas))
    export_graph(module, (example,), path, (INPUT_NAME,), outputs, (axes,))


def canvas_axes(divisible: int) -> dict[int, Any]:
    """A dynamic height and width for the exporter: multiples of ``divisible`` (any size, for
    1), from a few pixels to 8192."""
    axes: dict[int, Any] = {}
    for axis, name in ((2, "height"), (3, "width")):
        if divisible > 1:
            axes[axis] = divisible * torch.export.Dim(f"{name}_blocks", min=1,
                                                      max=8192 // divisible)  # fmt: skip
        else:
            axes[axis] = torch.export.Dim(name, min=8, max=8192)
    return axes


def export_graph(
    module: nn.Module,
    example: tuple[torch.Tensor, ...],
    path: Path,
    inputs: Sequence[str],
    outputs: Sequence[str],
    dynamic_shapes: tuple[Any, ...],
) -> None:
    """Write ``module`` (fp32, on the CPU) to ``path``: its inputs, shaped as ``example`` but
    for the axes ``dynamic_shapes`` names, and its outputs, named."""
    import_onnx()
    module = module.eval().to(device="cpu", dtype=torch.float32)
    # The exporter prints its progress and logs every optimisation pass: keep both out of the
    # server's output.
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        _quiet("onnxscript", "onnx_ir", "torch.onnx"),
    ):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                module,
                example,
                dynamo=True,
                input_names=list(inputs),
                output_names=list(outputs),
                dynamic_shapes=dynamic_shapes,
                opset_version=OPSET,
                optimize=True,
                verbose=False,
            )
        except Exception as exc:  # the exporter's many errors all mean one thing here
            root = _root_cause(exc)
            reason = f"{type(root).__name__}: {_first_line(root)}"
            raise StartupError(
                f"its graph does not export to ONNX ({reason}): a runtime cannot serve it "
                f"(BACKEND=torch does)"
            ) from exc
    if program is None:
        raise RuntimeError("the ONNX exporter returned no program")
    program.save(str(path))
    _require_dynamic_axes(path, inputs[0], dynamic_shapes[0])


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error: the exporter wraps the one that names the operator it lacks."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _first_line(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # the exporter colours its messages
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "no message"


def _require_dynamic_axes(path: Path, name: str, wanted: dict[int, Any]) -> None:
    """A graph whose batch axis, or height and width, the exporter fixed (it fell back to
    tracing code it cannot export whole: RT-DETR's anchors, Deformable DETR's sampling
    offsets) serves no other batch or size: refused here, with one line, rather than failing
    on the first batch of another size."""
    if not wanted:
        return
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    (first,) = [each for each in graph.input if each.name == name]
    dims = first.type.tensor_type.shape.dim
    fixed = [axis for axis in sorted(wanted) if not dims[axis].dim_param]
    if not fixed:
        return
    what = "a fixed " + " x ".join(("batch", "channels", "height", "width")[axis]
                                   for axis in fixed)  # fmt: skip
    what += " of " + "x".join(str(dims[axis].dim_value) for axis in fixed)
    raise StartupError(
        f"its graph exports to ONNX only with {what}: a runtime cannot serve it "
        f"(BACKEND=torch does)"
    )


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


def convert_to_openvino(onnx_path: Path, xml_path: Path) -> None:
    """ONNX (fp32, or INT8 with QDQ nodes, which OpenVINO runs as INT8) to OpenVINO IR."""
    ov = import_openvino()
    model = ov.convert_model(str(onnx_path))
    ov.save_model(model, str(xml_path), compress_to_fp16=False)


def import_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("ONNX export", "onnx", exc) from None


def import_openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise MissingExtraError("BACKEND=openvino", "openvino", exc) from None
    return openvino
