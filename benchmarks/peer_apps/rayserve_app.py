"""Ray Serve with ``@serve.batch``, as its documentation shows: one replica given every CPU
(``num_cpus``, which also sets its torch threads), the image as multipart field ``file``.

Run in the Ray Serve environment: ``python -m benchmarks.peer_apps.rayserve_app``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from ray import serve
from starlette.requests import Request

from benchmarks.peer_apps import classifier

CPUS = os.cpu_count() or 1


@serve.deployment(ray_actor_options={"num_cpus": CPUS}, max_ongoing_requests=128)
class ImageClassifier:
    def __init__(self) -> None:
        self.model = classifier.build()

    @serve.batch(  # type: ignore[untyped-decorator]
        max_batch_size=classifier.MAX_BATCH_SIZE,
        batch_wait_timeout_s=classifier.BATCH_TIMEOUT_S,
    )
    async def classify(self, images: list[torch.Tensor]) -> list[dict[str, Any]]:
        return classifier.classify(self.model, torch.stack(images))

    async def __call__(self, request: Request) -> dict[str, Any]:
        form = await request.form()
        upload: Any = form["file"]
        result: dict[str, Any] = await self.classify(classifier.to_tensor(await upload.read()))
        return result


if __name__ == "__main__":
    import ray

    ray.init(num_cpus=CPUS, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": classifier.PORT})
    serve.run(ImageClassifier.bind(), route_prefix="/predict")  # type: ignore[attr-defined]
    print("ready", flush=True)
    while True:
        time.sleep(3600)
