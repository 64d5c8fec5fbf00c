"""Settings: environment variables, .env, validation messages, derived values."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.cpus import available_cpus, cgroup_cpu_quota
from app.main import create_app
from app.settings import SettingsError, load_settings


def test_environment_variables_with_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_MODEL", "resnet18")
    monkeypatch.setenv("BATCHSERVE_MAX_BATCH_SIZE", "16")
    monkeypatch.setenv("BATCHSERVE_PREFERRED_BATCH_SIZES", "4, 8")
    monkeypatch.setenv("BATCHSERVE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("BATCHSERVE_API_KEY", "s3cret-s3cret-s3cret")
    settings = load_settings()
    assert settings.model == "resnet18"
    assert settings.max_batch_size == 16
    assert settings.preferred_batch_sizes == (4, 8)
    assert settings.log_level == "debug"
    assert settings.api_key is not None
    assert "s3cret" not in repr(settings)


def test_shared_canvases_are_read_as_height_by_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_CANVAS_BUCKETS", "320x480, 480X320")
    assert load_settings().canvas_buckets == ((320, 480), (480, 320))
    monkeypatch.setenv("BATCHSERVE_CANVAS_BUCKETS", "320 by 480")
    with pytest.raises(SettingsError, match="HEIGHTxWIDTH"):
        load_settings()
    monkeypatch.setenv("BATCHSERVE_CANVAS_BUCKETS", "4x480")
    with pytest.raises(SettingsError, match="between 8 and 8192"):
        load_settings()


@pytest.mark.parametrize("key", ["", "short", "fifteen-bytes.."])
def test_an_empty_or_short_api_key_stops_start_up(
    monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    monkeypatch.setenv("BATCHSERVE_API_KEY", key)
    with pytest.raises(SettingsError) as raised:
        load_settings()
    (line,) = [line for line in str(raised.value).splitlines() if "API_KEY" in line]
    assert line.strip().startswith("BATCHSERVE_API_KEY: must be at least 16 bytes")
    assert not key or key not in line  # the key itself is never repeated


def test_dotenv_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("BATCHSERVE_MODEL=mobilenet_v3_small\nBATCHSERVE_TOP_K=3\n")
    settings = load_settings()
    assert (settings.model, settings.top_k) == ("mobilenet_v3_small", 3)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"BATCHSERVE_MAX_BATCH_SIZE": "0"}, "BATCHSERVE_MAX_BATCH_SIZE: Input should be greater"),
        ({"BATCHSERVE_MAX_BATCH_SIZE": "many"}, "BATCHSERVE_MAX_BATCH_SIZE: Input should be a"),
        ({"BATCHSERVE_PRECISION": "int4"}, "BATCHSERVE_PRECISION: Input should be 'auto'"),
        ({"BATCHSERVE_DEVICE": "tpu"}, "BATCHSERVE_DEVICE: must be auto, cpu, cuda or cuda:N"),
        ({"BATCHSERVE_PREFERRED_BATCH_SIZES": "8,x"}, "comma-separated list of integers"),
        (
            {"BATCHSERVE_PREFERRED_BATCH_SIZES": "8,64"},
            "PREFERRED_BATCH_SIZES: 64 is not between 1 and MAX_BATCH_SIZE (32)",
        ),
        (
            {"BATCHSERVE_IMAGE_SIZE": "300", "BATCHSERVE_RESIZE_SIZE": "256"},
            "IMAGE_SIZE (300) cannot exceed RESIZE_SIZE (256)",
        ),
        ({"BATCHSERVE_LABELS": "/nonexistent/labels.txt"}, "no labels file at"),
        (
            {"BATCHSERVE_MAX_REQUEST_TIMEOUT_MS": "1000"},
            "MAX_REQUEST_TIMEOUT_MS (1000.0) cannot be below REQUEST_TIMEOUT_MS (30000.0)",
        ),
        ({"BATCHSERVE_GRPC_PORT": "70000"}, "BATCHSERVE_GRPC_PORT: Input should be less"),
        (
            {"BATCHSERVE_MAX_QUEUE_SIZE": "16", "BATCHSERVE_MAX_IMAGES_PER_REQUEST": "32"},
            "MAX_IMAGES_PER_REQUEST (32) cannot exceed MAX_QUEUE_SIZE (16)",
        ),
    ],
)
def test_invalid_settings_are_explained(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as raised:
        load_settings()
    assert expected in str(raised.value)


def test_create_app_exits_with_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_MAX_QUEUE_SIZE", "0")
    with pytest.raises(SystemExit, match="BATCHSERVE_MAX_QUEUE_SIZE"):
        create_app()


def test_window_defaults() -> None:
    assert load_settings().queue_delay_s == pytest.approx(0.002)
    assert load_settings(latency_slo_ms=200).queue_delay_s == pytest.approx(0.030)
    assert load_settings(latency_slo_ms=200, max_queue_delay_ms=1).queue_delay_s == 0.001
    config = (
        load_settings(max_batch_size=16, preferred_batch_sizes="8").own_model().batch_config("cpu")
    )
    assert (config.max_batch_size, config.preferred_batch_sizes) == (16, (8,))


def test_batches_in_flight_default_per_device() -> None:
    # Two on a CPU too: the second one only gets ready ahead (serial execution, set by the
    # version once it knows the backend runs one forward pass at a time).
    assert load_settings().own_model().batch_config("cpu").max_inflight_batches == 2
    assert load_settings().own_model().batch_config("cuda").max_inflight_batches == 2
    assert (
        load_settings(max_inflight_batches=3).own_model().batch_config("cpu").max_inflight_batches
        == 3
    )


def test_queue_bytes_must_hold_the_largest_image() -> None:
    with pytest.raises(SettingsError, match="MAX_QUEUE_BYTES"):
        load_settings(max_image_bytes=4 * 1024 * 1024, max_queue_bytes=1024 * 1024)


def test_every_setting_is_documented() -> None:
    """.env.example lists exactly the settings that exist, and each has a description (its
    field's docstring) in the settings reference the documentation is built from."""
    import re
    from pathlib import Path

    from app.settings import Settings
    from app.settings_reference import reference, undocumented

    root = Path(__file__).resolve().parent.parent
    fields = set(Settings.model_fields)
    example = set(re.findall(r"BATCHSERVE_([A-Z0-9_]+)=", (root / ".env.example").read_text()))
    assert {name.lower() for name in example} == fields
    assert undocumented() == []
    rows = re.findall(r"^\| `BATCHSERVE_([A-Z0-9_]+)` \|", reference(), re.MULTILINE)
    assert [name.lower() for name in rows] == list(Settings.model_fields)
    assert "<!-- settings-reference -->" in (root / "docs" / "settings.md").read_text()


def test_cpu_budget_follows_the_affinity_mask_and_the_container_quota(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == mask  # no cgroup files: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert available_cpus(tmp_path) == mask
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert cgroup_cpu_quota(tmp_path) == 0.5
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")  # cgroup v1, 1.5 CPUs
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert available_cpus(tmp_path) == min(mask, 2)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_thread_budget_defaults_and_overrides() -> None:
    assert load_settings().intra_op_threads == available_cpus()
    assert load_settings().decode_threads == available_cpus()
    assert load_settings(torch_threads=3, decode_workers=1).intra_op_threads == 3
    assert load_settings(torch_threads=3, decode_workers=1).decode_threads == 1
