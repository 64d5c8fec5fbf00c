"""A real ImageNet model (efficientnet-lite0) served on every backend and precision: a cat
stays a cat, espresso stays espresso, in fp32 on PyTorch, ONNX Runtime and OpenVINO (the same
top class), and in INT8 on both runtimes once the accuracy gate passed (among the top three:
INT8 may swap near-equal classes such as tabby and Egyptian cat)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_settings, serve
from tests.real_model import EXPECTED, FACTORY, photos, write_labels

JPEG = {"content-type": "image/jpeg"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Labels, a folder of the photos (for calibration), and one artefact folder for all."""
    root = tmp_path_factory.mktemp("real")
    folder = root / "photos"
    folder.mkdir()
    for name, data in photos().items():
        (folder / f"{name}.jpg").write_bytes(data)
    return {"labels": write_labels(root / "labels.txt"), "photos": folder,
            "artifacts": root / "artifacts"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "precision"),
    [("torch", "fp32"), ("onnxruntime", "fp32"), ("openvino", "fp32"),
     ("onnxruntime", "int8"), ("openvino", "int8")],
)  # fmt: skip
async def test_the_photos_keep_their_names(
    shared: dict[str, Path], backend: str, precision: str
) -> None:
    settings = make_settings(
        model=FACTORY, weights="auto", labels=shared["labels"], backend=backend,
        precision=precision, artifacts_dir=shared["artifacts"],
        calibration_dir=shared["photos"] if precision == "int8" else None,
    )  # fmt: skip
    async with serve(settings) as (_, client):
        for name, label in EXPECTED.items():
            response = await client.post("/predict?top_k=3", content=photos()[name], headers=JPEG)
            assert response.status_code == 200, response.text
            top = [entry["label"] for entry in response.json()["predictions"]]
            if precision == "fp32":
                assert top[0] == label, (name, top)
            else:  # INT8 may reorder near-equal classes (tabby, Egyptian cat), not lose them
                assert label in top, (name, top)
        (model,) = (await client.get("/v1/models")).json()["models"]
    assert (model["backend"]["name"], model["precision"]) == (backend, precision)
    if backend != "torch":
        assert model["check"]["passed"]
