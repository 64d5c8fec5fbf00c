"""LitServe with dynamic batching, as its documentation shows (``LitAPI`` with
``max_batch_size`` and ``batch_timeout``; the image arrives as multipart field ``file``), for
a classifier, a detector or a segmenter (``tasks``).

Run in the LitServe environment: ``python -m benchmarks.peer_apps.litserve_app``.
"""

# No ``from __future__ import annotations``: LitServe reads the annotation of ``decode_request``
# as the route's parameter type, and it must be the class itself.
from typing import Any

import litserve as ls
import torch
from fastapi import Request

from benchmarks.peer_apps import classifier, tasks


class VisionAPI(ls.LitAPI):  # type: ignore[misc]
    def setup(self, device: str) -> None:
        self.model = tasks.build().to(device)
        self.device = device

    def decode_request(self, request: Request) -> tuple[torch.Tensor, tuple[int, int]]:
        # LitServe hands over the parsed form for a multipart request.
        form: Any = request
        return tasks.decode(form["file"].file.read())

    def batch(
        self, inputs: list[tuple[torch.Tensor, tuple[int, int]]]
    ) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        return inputs  # images of different sizes: each task's model takes them as a list

    def predict(self, batch: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[dict[str, Any]]:
        return tasks.predict(self.model, batch, self.device)

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output


if __name__ == "__main__":
    api = VisionAPI(
        max_batch_size=classifier.MAX_BATCH_SIZE, batch_timeout=classifier.BATCH_TIMEOUT_S
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=classifier.PORT, generate_client_file=False)
