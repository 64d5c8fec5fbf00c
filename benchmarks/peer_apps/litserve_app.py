"""LitServe with dynamic batching, as its documentation shows (``LitAPI`` with
``max_batch_size`` and ``batch_timeout``; the image arrives as multipart field ``file``).

Run in the LitServe environment: ``python -m benchmarks.peer_apps.litserve_app``.
"""

# No ``from __future__ import annotations``: LitServe reads the annotation of ``decode_request``
# as the route's parameter type, and it must be the class itself.
from typing import Any

import litserve as ls
import torch
from fastapi import Request

from benchmarks.peer_apps import classifier


class ImageClassifier(ls.LitAPI):  # type: ignore[misc]
    def setup(self, device: str) -> None:
        self.model = classifier.build().to(device)
        self.device = device

    def decode_request(self, request: Request) -> torch.Tensor:
        # LitServe hands over the parsed form for a multipart request.
        form: Any = request
        return classifier.to_tensor(form["file"].file.read())

    def batch(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(inputs)

    def predict(self, batch: torch.Tensor) -> list[dict[str, Any]]:
        return classifier.classify(self.model, batch.to(self.device))

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output


if __name__ == "__main__":
    api = ImageClassifier(
        max_batch_size=classifier.MAX_BATCH_SIZE, batch_timeout=classifier.BATCH_TIMEOUT_S
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=classifier.PORT, generate_client_file=False)
