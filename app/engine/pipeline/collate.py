"""Bring a batch's images to the device and normalise them into its slot's input batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import record_function

from app.engine.pipeline.slot import BatchSlot
from app.engine.pipeline.streams import Mark, Streams
from preprocessing import Buffer, ImageHeader, Placement, PreparedImage, fit, normalize_into
from preprocessing.device import decode_jpegs
from preprocessing.transforms import TransformConfig


class NotPreparedError(ValueError):
    """An image that was not prepared for this model (a wrong crop size, no pixels, no bytes)."""


class Collator:
    """Decodes what is still encoded (on the device), stages CPU crops through the slot's
    pinned buffer, and normalises every image into the slot's inputs, each at its place in
    the batch's canvas.

    Runs on the slot's own stream on CUDA (the caller enters it). Every device tensor made here
    is handed to ``slot.hold`` so it lives until the batch's done event; why each is safe:

    - nvjpeg outputs are allocated by torchvision on the current stream (the slot's) and written
      on the decoder's internal stream, which torchvision then makes the current stream wait
      for; held, so their memory cannot go to another batch while the slot's stream reads it;
    - crops (resize on the device) and the staged copy are made and read on the slot's stream;
      held for the same reason;
    - ``slot.inputs`` and ``slot.staged`` belong to the slot: written here, read by the compute
      stream after it waits for the ``collated`` event, and not written again until this slot's
      next batch, which starts only after this batch's done event has completed.
    """

    def __init__(
        self,
        transform: TransformConfig,
        input_shape: tuple[int, int, int],
        device: torch.device,
        streams: Streams,
        on_fallbacks: Callable[[int], None] = lambda count: None,
    ) -> None:
        self.transform = transform
        self.input_shape = input_shape
        self.device = device
        self.streams = streams
        # Told how many images of a batch the CPU decoded in the device decoder's place.
        self.on_fallbacks = on_fallbacks

    def collate(
        self,
        slot: BatchSlot,
        images: Sequence[PreparedImage],
        marks: dict[str, Mark],
        canvas: tuple[int, int],
    ) -> tuple[torch.Tensor, list[int], dict[int, BaseException]]:
        """Fill the slot's inputs for images of ``canvas``; returns them (``[rows, 3, *canvas]``
        in the slot's buffer), per row the index of its image, and the error of each image
        that could not join."""
        errors: dict[int, BaseException] = {}
        on_device: dict[int, torch.Tensor] = {}
        on_host: dict[int, torch.Tensor] = {}
        normalized: dict[int, torch.Tensor] = {}
        encoded: list[tuple[int, Buffer, ImageHeader]] = []
        for index, image in enumerate(images):
            where = image.placement
            if where.canvas != canvas:
                errors[index] = NotPreparedError("the image was not prepared for this batch")
            elif image.pixels is not None and tuple(image.pixels.shape) == (3, *where.content):
                on_host[index] = image.pixels
            elif image.normalized is not None and tuple(image.normalized.shape) == (3, *canvas):
                normalized[index] = image.normalized
            elif image.pixels is None and image.data is not None:
                encoded.append((index, image.data, image.header))
            else:
                errors[index] = NotPreparedError("the image was not prepared for this model")

        if encoded:
            with record_function("batchserve.device_decode"):
                decoded = decode_jpegs([(data, header) for _, data, header in encoded], self.device)
                if decoded.fallbacks:
                    self.on_fallbacks(decoded.fallbacks)
                pictures: dict[int, torch.Tensor] = {}
                for (index, _, _), result in zip(encoded, decoded.results, strict=True):
                    if isinstance(result, BaseException):
                        errors[index] = result
                    else:
                        pictures[index] = result
                        slot.hold(result)
                placements = {index: images[index].placement for index in pictures}
                for index, crop in self._fitted(pictures, placements).items():
                    slot.hold(crop)
                    (on_host if crop.device.type == "cpu" else on_device)[index] = crop
            marks["decoded"] = self.streams.mark()

        marks["staging"] = self.streams.mark()
        if on_host and self.device.type != "cpu":
            with record_function("batchserve.h2d"):
                on_device.update(self._staged(slot, on_host))
        else:
            on_device.update(on_host)
        marks["staged"] = self.streams.mark()

        rows = sorted(on_device)
        inputs = slot.inputs(len(rows) + len(normalized), canvas)
        with record_function("batchserve.collate"):
            if rows:
                normalize_into([on_device[index] for index in rows], inputs, self.transform,
                               [images[index].placement for index in rows])  # fmt: skip
            if normalized:
                # Sent ready: copied as they are, in the rows after the ones just normalised.
                ready = sorted(normalized)
                block = torch.stack([normalized[index] for index in ready]).to(self.device)
                inputs[len(rows) : len(rows) + len(ready)].copy_(block)
                slot.hold(block)
                rows += ready
        return inputs, rows, errors

    def _staged(self, slot: BatchSlot, on_host: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """CPU images copied to the device: uint8 crops of one shape through the slot's pinned
        buffer, in one copy; others (an image's own content size, float pixels) one by one."""
        order = sorted(on_host)
        if all(on_host[index].shape == slot.staged.shape[1:] and on_host[index].dtype ==
               torch.uint8 for index in order):  # fmt: skip
            staged = slot.staged[: len(order)]
            torch.stack([on_host[index] for index in order], out=staged)
            arrived = staged.to(self.device, non_blocking=True)
            slot.hold(arrived)
            return dict(zip(order, arrived, strict=True))
        moved = {index: on_host[index].to(self.device) for index in order}
        slot.hold(*moved.values())
        return moved

    def _fitted(
        self, pictures: dict[int, torch.Tensor], placements: dict[int, Placement]
    ) -> dict[int, torch.Tensor]:
        """Each decoded picture fitted to the input. Pictures of one size on one device are
        resized (and cropped) as one batch: a few kernels for all of them, not a few per image
        launched one by one under the GIL (photos from one camera share a size, and so a
        placement)."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for index, picture in pictures.items():
            key = (picture.device, *picture.shape, placements[index].content)
            groups.setdefault(key, []).append(index)
        fitted: dict[int, torch.Tensor] = {}
        for indices in groups.values():
            where = placements[indices[0]]
            if len(indices) == 1:
                fitted[indices[0]] = fit(pictures[indices[0]], self.transform, where)
                continue
            stacked = torch.stack([pictures[index] for index in indices])
            fitted.update(zip(indices, fit(stacked, self.transform, where), strict=True))
        return fitted
