"""Format sniffing, header checks, decoding of every mode, and equivalence with torchvision."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.models import ResNet50_Weights
from torchvision.transforms.v2 import functional as F

from preprocessing import (
    ImageFormat,
    ImageLimits,
    ImageTooLargeError,
    InvalidImageError,
    TransformConfig,
    UnsupportedFormatError,
    decode_cpu,
    normalize_into,
    prepare,
    read_header,
    sniff,
)
from preprocessing.transforms import Interpolation, resize_crop
from tests import images


def decode(data: bytes) -> torch.Tensor:
    return decode_cpu(data, read_header(data))


# -- sniffing and headers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (images.jpeg(), ImageFormat.JPEG),
        (images.png(), ImageFormat.PNG),
        (images.webp(), ImageFormat.WEBP),
        (images.encode(images.photo(), "GIF"), ImageFormat.GIF),
        (images.encode(images.photo(), "BMP"), ImageFormat.BMP),
    ],
)
def test_sniff_recognises_formats_from_bytes(data: bytes, expected: ImageFormat) -> None:
    assert sniff(data) is expected


def test_sniff_refuses_non_images_and_names_unsupported_formats() -> None:
    with pytest.raises(InvalidImageError, match="empty"):
        sniff(b"")
    with pytest.raises(InvalidImageError, match="not a recognised image"):
        sniff(b"hello, this is text and not an image at all")
    with pytest.raises(InvalidImageError):
        sniff(b"PK\x03\x04" + b"\x00" * 40)  # a zip file
    with pytest.raises(UnsupportedFormatError, match="TIFF"):
        sniff(images.encode(images.photo(), "TIFF"))


def test_header_gives_size_and_orientation_without_decoding() -> None:
    header = read_header(images.with_exif_orientation(images.photo(300, 200), 6))
    assert (header.format, header.width, header.height, header.orientation) == (
        ImageFormat.JPEG, 300, 200, 6,
    )  # fmt: skip


@pytest.mark.parametrize("bomb", [images.png_bomb, images.jpeg_bomb])
def test_decompression_bombs_are_refused_from_the_header(bomb: object) -> None:
    data = bomb()  # type: ignore[operator]
    assert len(data) < 5000
    started = time.perf_counter()
    # Past Pillow's own bound (about 179 million pixels), refused as it opens the header.
    with pytest.raises(ImageTooLargeError, match="declares too many pixels"):
        prepare(data, TransformConfig())
    assert time.perf_counter() - started < 1.0  # refused before any decoding


def test_pixels_over_the_limit_are_refused_before_anything_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A PNG without an early eXIf chunk: reading its orientation must not decode it (Pillow's
    ``getexif`` would, to look for one after its pixels), nor anything else before the pixel
    limit has refused it; past Pillow's own bound it is refused as it opens."""
    from PIL import PngImagePlugin

    decoded: list[tuple[int, int]] = []
    load = PngImagePlugin.PngImageFile.load

    def counted(image: PngImagePlugin.PngImageFile) -> object:
        decoded.append(image.size)
        return load(image)

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", counted)
    within_pillows_bound = images.blank_png(10_000, 10_000)  # 100 million pixels
    with pytest.raises(ImageTooLargeError, match="10000x10000"):
        prepare(within_pillows_bound, TransformConfig())
    assert decoded == []
    past_it = images.blank_png(20_000, 20_000)
    assert len(past_it) < 400_000
    with pytest.raises(ImageTooLargeError, match="declares too many pixels"):
        prepare(past_it, TransformConfig())
    assert decoded == []
    prepare(images.blank_png(300, 200), TransformConfig())  # within the limits: decoded
    assert set(decoded) == {(300, 200)}


def test_pixel_limit_and_extreme_aspect_ratios() -> None:
    limits = ImageLimits(max_pixels=10_000, resize_size=64)
    limits.check(100, 100)
    with pytest.raises(ImageTooLargeError):
        limits.check(101, 100)
    with pytest.raises(ImageTooLargeError, match="aspect ratio"):
        limits.check(1, 5000)  # few pixels, but 64 x 320000 once resized
    with pytest.raises(ImageTooLargeError, match="aspect ratio"):
        read_header(images.png(Image.new("RGB", (2000, 1))), limits)


# -- decoding ------------------------------------------------------------------------------


MODES_BY_FORMAT = {
    "PNG": ["L", "P", "RGBA", "LA", "1", "I;16", "RGB"],
    "JPEG": ["L", "RGB", "CMYK", "1"],
    "WEBP": ["RGB", "RGBA", "L", "P"],
    "GIF": ["L", "P", "RGB", "1"],
    "BMP": ["L", "P", "RGB", "1", "RGBA"],
}


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [(fmt, mode) for fmt, modes in MODES_BY_FORMAT.items() for mode in modes],
)
def test_every_mode_becomes_three_channel_uint8(fmt: str, mode: str) -> None:
    source = images.photo(40, 30, seed=3).convert(mode if mode != "I;16" else "L")
    if mode == "I;16":
        source = Image.fromarray(np.asarray(source, dtype=np.uint16) * 257)
    data = images.encode(source, fmt)
    pixels = decode(data)
    assert pixels.dtype == torch.uint8
    assert tuple(pixels.shape) == (3, 30, 40)


def test_sixteen_bit_images_are_scaled_not_clipped() -> None:
    ramp = (np.arange(64 * 16, dtype=np.uint32).reshape(16, 64) * 64).astype(np.uint16)
    pixels = decode(images.png(Image.fromarray(ramp)))
    expected = np.round(ramp / 257).astype(np.int64)
    assert np.abs(pixels[0].numpy().astype(np.int64) - expected).max() <= 1
    assert pixels.float().mean() < 200  # a clipping conversion makes nearly all of it 255


def test_cmyk_jpeg_matches_pillow() -> None:
    cmyk = images.photo(48, 32).convert("CMYK")
    pixels = decode(images.jpeg(cmyk))
    reference = np.asarray(Image.open(__import__("io").BytesIO(images.jpeg(cmyk))).convert("RGB"))
    assert np.abs(pixels.permute(1, 2, 0).numpy().astype(int) - reference).mean() < 2


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation_is_applied(fmt: str) -> None:
    # A 60x40 image with a bright left edge; orientation 6 means "rotate 90 degrees clockwise".
    source = Image.new("RGB", (60, 40), (0, 0, 0))
    source.paste((255, 255, 255), (0, 0, 10, 40))
    pixels = decode(images.with_exif_orientation(source, 6, fmt))
    assert tuple(pixels.shape) == (3, 60, 40)  # upright: taller than wide
    assert pixels[:, :5, :].float().mean() > 200  # the bright edge is now on top
    assert pixels[:, -5:, :].float().mean() < 50


@pytest.mark.parametrize(
    "data",
    [
        images.jpeg()[:2000],  # truncated JPEG
        images.jpeg()[:-200],
        images.png()[:300],  # truncated PNG
        images.png()[:40] + b"\x00" * 200 + images.png()[240:],  # corrupt PNG data (bad CRC)
        images.webp()[:100],
        images.encode(images.photo(), "GIF")[:200],
    ],
    ids=["jpeg-half", "jpeg-tail", "png-short", "png-crc", "webp-short", "gif-short"],
)
def test_truncated_and_corrupt_files_raise_invalid_image(data: bytes) -> None:
    with pytest.raises(InvalidImageError) as raised:
        prepare(data, TransformConfig())
    assert "/" not in str(raised.value)  # no decoder source paths leak into messages


# -- transforms ----------------------------------------------------------------------------


def test_prepare_resizes_and_crops_to_the_model_input() -> None:
    prepared = prepare(images.jpeg(images.photo(500, 375)), TransformConfig(160, 182))
    assert prepared.pixels is not None
    assert tuple(prepared.pixels.shape) == (3, 160, 160)
    assert prepared.pixels.dtype == torch.uint8
    assert prepared.decode_s > 0


def test_jpeg_bytes_are_kept_for_a_device_decoder() -> None:
    data = images.jpeg()
    prepared = prepare(data, TransformConfig(), device_decodes_jpeg=True)
    assert prepared.pixels is None
    assert prepared.data == data
    png = prepare(images.png(), TransformConfig(), device_decodes_jpeg=True)
    assert png.pixels is not None  # only JPEG goes to the device decoder


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (1024, 200), (230, 230), (90, 120)])
def test_matches_torchvision_weights_transforms(size: tuple[int, int]) -> None:
    weights = ResNet50_Weights.IMAGENET1K_V2
    preset = weights.transforms()
    config = TransformConfig(
        crop_size=preset.crop_size[0],
        resize_size=preset.resize_size[0],
        mean=tuple(preset.mean),
        std=tuple(preset.std),
    )
    data = images.jpeg(images.photo(*size, seed=size[0]), quality=95)
    prepared = prepare(data, config)
    assert prepared.pixels is not None
    ours = torch.empty(1, 3, config.crop_size, config.crop_size)
    normalize_into([prepared.pixels], ours, config)

    decoded = decode(data)
    # The same decoded tensor through torchvision's own transform (its v1 resize, in float
    # and rounded): the same numbers.
    reference_tensor = preset(decoded).unsqueeze(0)
    assert torch.equal(ours, reference_tensor)
    # From a PIL image (Pillow's resize): the same picture within a small tolerance.
    reference_pil = preset(F.to_pil_image(decoded)).unsqueeze(0)
    difference = (ours - reference_pil).abs()
    assert difference.mean() < 0.02
    assert difference.max() < 0.35


@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest"])
@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_the_transform_is_torchvisions_own(mode: str, layout: str) -> None:
    """Resize, crop and normalisation give torchvision's exact numbers (the tensor transforms
    its weights' ``transforms()`` call, which the server does not import), for planar and
    interleaved (decoded HWC) images."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as v1

    config = TransformConfig(interpolation=Interpolation(mode))
    generator = torch.Generator().manual_seed(7)
    for height, width in [(375, 500), (500, 375), (256, 300), (1024, 200), (301, 257)]:
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
        image = pixels.permute(2, 0, 1) if layout == "hwc" else pixels.permute(2, 0, 1).clone()
        ours = resize_crop(image, config)
        theirs = v1.center_crop(
            v1.resize(image, [256], InterpolationMode(mode), antialias=True), [224, 224]
        )
        assert torch.equal(ours, theirs), (mode, layout, height, width)
        batch = torch.empty(1, 3, 224, 224)
        normalize_into([ours], batch, config)
        expected = v1.normalize(v1.convert_image_dtype(theirs, torch.float32), config.mean,
                                config.std)  # fmt: skip
        assert torch.equal(batch[0], expected)


def test_normalize_into_fills_a_channels_last_bf16_buffer_in_place() -> None:
    config = TransformConfig(32, 36)
    crops = [torch.full((3, 32, 32), value, dtype=torch.uint8) for value in (0, 255)]
    out = torch.empty(4, 3, 32, 32, dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last
    )
    pointer = out.data_ptr()
    filled = normalize_into(crops, out, config)
    assert filled.shape[0] == 2
    assert out.data_ptr() == pointer
    assert out.is_contiguous(memory_format=torch.channels_last)
    expected_black = -config.mean[0] / config.std[0]
    assert float(out[0, 0, 0, 0]) == pytest.approx(expected_black, rel=1e-2)
    expected_white = (1 - config.mean[2]) / config.std[2]
    assert float(out[1, 2, 5, 5]) == pytest.approx(expected_white, rel=1e-2)


def test_transform_config_is_validated() -> None:
    with pytest.raises(ValueError, match="crop"):
        TransformConfig(crop_size=300, resize_size=256)


def test_large_jpegs_are_decoded_scaled_in_the_dct_and_come_out_alike() -> None:
    """At least four times the resize target on its short side, a JPEG is decoded at 1/2, 1/4
    or 1/8 of its size (never below twice the target); the crop the model sees barely moves."""
    config = TransformConfig()  # resize 256, crop 224
    photo = images.photo(2048, 1536, seed=3)
    data = images.jpeg(photo, quality=92)
    full = decode(data)
    scaled = decode_cpu(data, read_header(data), config.resize_size)
    assert full.shape == (3, 1536, 2048)
    assert scaled.shape == (3, 768, 1024)  # 1/2: 1/4 would fall below 512
    crop = prepare(data, config).pixels
    assert crop is not None
    reference = F.center_crop(F.resize(full, [256], antialias=True), [224, 224])
    assert (crop.float() - reference.float()).abs().mean() < 1.5  # of 255 levels
    # Smaller than four times the target: decoded whole, exactly as before.
    small = images.jpeg(images.photo(1000, 800, seed=3))
    assert torch.equal(decode_cpu(small, read_header(small), 256), decode(small))
    # The EXIF orientation is applied on the scaled path too.
    rotated = images.with_exif_orientation(photo, 6)
    assert decode_cpu(rotated, read_header(rotated), 256).shape == (3, 1024, 768)


def test_shared_canvases_pad_each_image_into_the_smallest_that_holds_its_own() -> None:
    from preprocessing.placement import Fit

    alone = TransformConfig(fit=Fit.MIN_MAX, crop_size=320, resize_size=320, max_size=640,
                            size_divisible=32)  # fmt: skip
    detector = replace(alone, buckets=((480, 320), (320, 470), (416, 416)))
    assert detector.buckets == ((320, 480), (416, 416), (480, 320))  # rounded as the model pads
    for (width, height), canvas in {
        (640, 480): (320, 480),  # its own 320x448: the smallest bucket that holds it
        (480, 640): (480, 320),
        (500, 500): (320, 480),  # its own 320x320 fits all three; 320x480 is the smallest
        (1280, 320): (160, 640),  # no bucket holds 160x640: its own
    }.items():
        placed, own = detector.placement(width, height), alone.placement(width, height)
        assert placed.canvas == canvas
        assert (placed.content, placed.top, placed.left) == (own.content, 0, 0)
    with pytest.raises(ValueError, match="FIT=stretch gives every image the same canvas"):
        TransformConfig(fit=Fit.STRETCH, crop_size=320, resize_size=320, buckets=((320, 320),))
