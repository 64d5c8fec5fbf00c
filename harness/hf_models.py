"""Hugging Face transformers models to serve offline (the tests' and the benchmarks'): small
configurations of real architectures, weights drawn from a fixed seed, their heads spread so
that answers differ on real photos (transformers' initialisation scores every class alike),
written by ``save_pretrained`` with their image processor, as a user's fine-tuned model is.
And the reference: the library's own pipeline, the image processor (transformers' default
backend) and the model on the photo Pillow decodes, one at a time, eager, fp32, answered by
the processor's own post-processing. Needs the ``transformers`` extra."""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from app.engine import Detected
from harness.photos import photos

# A classifier's (or a segmenter's) logits on the photos scaled to this spread.
LOGIT_SPREAD = 3.0
LABELS = 10


def _transformers() -> Any:
    return importlib.import_module("transformers")


def _labelled(count: int = LABELS) -> dict[str, Any]:
    return {"id2label": {i: f"class {i}" for i in range(count)},
            "label2id": {f"class {i}": i for i in range(count)}}  # fmt: skip


def _vit(t: Any) -> tuple[nn.Module, Any]:
    config = t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, image_size=224, patch_size=16,
                         **_labelled())  # fmt: skip
    return t.ViTForImageClassification(config), t.ViTImageProcessor()


def _convnext(t: Any) -> tuple[nn.Module, Any]:
    config = t.ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64], **_labelled())
    processor = t.ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875)
    return t.ConvNextForImageClassification(config), processor


def _dinov2(t: Any) -> tuple[nn.Module, Any]:
    config = t.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            mlp_ratio=2, patch_size=14, image_size=224)  # fmt: skip
    # DINOv2's own processor: the shorter side to 256 (bicubic), its centre 224, ImageNet's.
    processor = t.BitImageProcessor(size={"shortest_edge": 256}, crop_size=224,
                                    image_mean=[0.485, 0.456, 0.406],
                                    image_std=[0.229, 0.224, 0.225])  # fmt: skip
    return t.Dinov2Model(config), processor


def _clip(t: Any) -> tuple[nn.Module, Any]:
    config = t.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, image_size=224, patch_size=32,
                                projection_dim=16)  # fmt: skip
    return t.CLIPVisionModelWithProjection(config), t.CLIPImageProcessor()


def _detr(t: Any) -> tuple[nn.Module, Any]:
    backbone = t.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128],
                              embedding_size=16, out_features=["stage4"])  # fmt: skip
    config = t.DetrConfig(use_timm_backbone=False, backbone_config=backbone,
                          use_pretrained_backbone=False, d_model=32, encoder_layers=1,
                          decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=20,
                          **_labelled())  # fmt: skip
    # DETR's rule at a smaller scale: the shorter side to 480 unless the longer passes 800.
    processor = t.DetrImageProcessor(size={"shortest_edge": 480, "longest_edge": 800})
    return t.DetrForObjectDetection(config), processor


def _rt_detr_like(t: Any, decoder_layers: int) -> dict[str, Any]:
    """A small RT-DETR-like configuration (RT-DETR's, D-FINE's): its ResNet, encoder, decoder."""
    backbone = t.RTDetrResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128],
                                    embedding_size=16,
                                    out_features=["stage2", "stage3", "stage4"])  # fmt: skip
    return dict(backbone_config=backbone, encoder_in_channels=[32, 64, 128],
                encoder_hidden_dim=32, d_model=32, decoder_in_channels=[32, 32, 32],
                encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_layers=decoder_layers,
                num_queries=30, **_labelled())  # fmt: skip


def _rt_detr(t: Any) -> tuple[nn.Module, Any]:
    config = t.RTDetrConfig(**_rt_detr_like(t, decoder_layers=1))
    model = t.RTDetrForObjectDetection(config)
    _anchored(model)
    return model, t.RTDetrImageProcessor()


def _anchored(model: nn.Module, decoder_too: bool = True) -> None:
    """transformers' initialisation leaves a small RT-DETR-like encoder's memory alike at every
    position (and its box deltas zero): torch's own layer initialisation spreads it. The
    positions outside the anchors' range (memory masked to zero) are scored by the head's bias
    alone: set well below the others, so that the queries start from anchors, as trained ones
    do. D-FINE's decoder keeps its own initialisation (``decoder_too`` false): its gates and
    quality heads, redrawn, leave every query alike."""
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear | nn.Conv2d) and (
            decoder_too or not name.startswith("model.decoder.")
        ):
            layer.reset_parameters()
    encoder: Any = model.model
    with torch.no_grad():
        encoder.enc_output[0].bias.zero_()
        encoder.enc_score_head.bias.fill_(-10.0)


def _segformer(t: Any) -> tuple[nn.Module, Any]:
    config = t.SegformerConfig(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64],
                               decoder_hidden_size=32, num_attention_heads=[1, 1, 2, 2],
                               **_labelled(5))  # fmt: skip
    processor = t.SegformerImageProcessor(size={"height": 256, "width": 256})
    return t.SegformerForSemanticSegmentation(config), processor


def _conditional_detr(t: Any) -> tuple[nn.Module, Any]:
    backbone = t.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128],
                              embedding_size=16, out_features=["stage4"])  # fmt: skip
    config = t.ConditionalDetrConfig(use_timm_backbone=False, backbone_config=backbone,
                                     use_pretrained_backbone=False, d_model=32, encoder_layers=1,
                                     decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, num_queries=20,
                                     **_labelled())  # fmt: skip
    processor = t.ConditionalDetrImageProcessor(size={"shortest_edge": 480, "longest_edge": 800})
    return t.ConditionalDetrForObjectDetection(config), processor


def _upernet(t: Any) -> tuple[nn.Module, Any]:
    backbone = t.ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64],
                                out_features=["stage1", "stage2", "stage3", "stage4"])  # fmt: skip
    config = t.UperNetConfig(backbone_config=backbone, hidden_size=32, use_auxiliary_head=False,
                             **_labelled(5))  # fmt: skip
    # UperNet's checkpoints ship SegFormer's processor (a fixed square, bilinear).
    processor = t.SegformerImageProcessor(size={"height": 256, "width": 256})
    return t.UperNetForSemanticSegmentation(config), processor


def _dpt(t: Any) -> tuple[nn.Module, Any]:
    config = t.DPTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                         intermediate_size=64, image_size=224, patch_size=16,
                         backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 64],
                         fusion_hidden_size=32, use_auxiliary_head=False,
                         **_labelled(5))  # fmt: skip
    # DPT's rule for segmentation: a fixed square, bicubic, mean and std 0.5.
    processor = t.DPTImageProcessor(size={"height": 224, "width": 224})
    return t.DPTForSemanticSegmentation(config), processor


def _deformable_detr(t: Any) -> tuple[nn.Module, Any]:
    backbone = t.ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128],
                              embedding_size=16,
                              out_features=["stage2", "stage3", "stage4"])  # fmt: skip
    # Two decoder layers: transformers cannot tie one layer's box head to the next's with one.
    config = t.DeformableDetrConfig(use_timm_backbone=False, backbone_config=backbone,
                                    use_pretrained_backbone=False, d_model=32, encoder_layers=1,
                                    decoder_layers=2, encoder_attention_heads=2,
                                    decoder_attention_heads=2, encoder_ffn_dim=32,
                                    decoder_ffn_dim=32, num_queries=20, num_feature_levels=3,
                                    encoder_n_points=2, decoder_n_points=2,
                                    **_labelled())  # fmt: skip
    processor = t.DeformableDetrImageProcessor(size={"shortest_edge": 480, "longest_edge": 800})
    return t.DeformableDetrForObjectDetection(config), processor


def _d_fine(t: Any) -> tuple[nn.Module, Any]:
    config = t.DFineConfig(**_rt_detr_like(t, decoder_layers=2))
    model = t.DFineForObjectDetection(config).eval()
    _anchored(model, decoder_too=False)
    # D-FINE's checkpoints ship RT-DETR's processor.
    processor = t.RTDetrImageProcessor()
    _calibrated(model, processor)
    return model, processor


def _siglip(t: Any) -> tuple[nn.Module, Any]:
    config = t.SiglipVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, image_size=224,
                                  patch_size=16)  # fmt: skip
    # SigLIP's processor: a fixed square, bicubic, mean and std 0.5.
    return t.SiglipVisionModel(config), t.SiglipImageProcessor()


def _vit_b16(t: Any) -> tuple[nn.Module, Any]:
    """ViT-B/16 at 224 (transformers' default configuration), ImageNet's 1,000 classes."""
    config = t.ViTConfig(**_labelled(1000))
    return t.ViTForImageClassification(config), t.ViTImageProcessor()


def _rt_detr_r50(t: Any) -> tuple[nn.Module, Any]:
    """RT-DETR with its ResNet-50 (transformers' default configuration), COCO's 80 classes."""
    config = t.RTDetrConfig(**_labelled(80))
    return t.RTDetrForObjectDetection(config), t.RTDetrImageProcessor()


FAMILIES: dict[str, Callable[[Any], tuple[nn.Module, Any]]] = {
    "vit": _vit, "convnext": _convnext, "dinov2": _dinov2, "clip": _clip, "detr": _detr,
    "rt_detr": _rt_detr, "segformer": _segformer, "conditional_detr": _conditional_detr,
    "upernet": _upernet, "dpt": _dpt, "deformable_detr": _deformable_detr, "d_fine": _d_fine,
    "siglip": _siglip,
    # The benchmarks' full-size models.
    "vit_b16": _vit_b16, "rt_detr_r50": _rt_detr_r50,
}  # fmt: skip


def saved(family: str, folder: Path, seed: int = 0) -> Path:
    """A directory of ``family``'s model as ``save_pretrained`` writes it, with its image
    processor, its weights drawn from ``seed`` and its head spread (made once per folder)."""
    directory = folder / f"hf-{family}"
    if not (directory / "config.json").exists():
        torch.manual_seed(seed)
        model, processor = FAMILIES[family](_transformers())
        model.eval()
        _spread(model, processor)
        model.save_pretrained(directory)  # type: ignore[operator]
        processor.save_pretrained(directory)
    return directory


def _calibrated(model: nn.Module, processor: Any) -> None:
    """The batch norms given the photos' statistics, as training leaves them: where freshly
    drawn layers shrink the signal through many normalised convolutions (D-FINE's encoder)."""
    norms = [layer for layer in model.modules() if isinstance(layer, nn.BatchNorm2d)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # the average over every photo
        norm.train()
    with torch.no_grad():
        for image in _images():
            model(**processor(images=image, return_tensors="pt"))
    for norm in norms:
        norm.eval()


def _spread(model: nn.Module, processor: Any) -> None:
    """The head's last layer scaled so that its outputs spread on the photos (a detector's
    box regression too, so that its boxes differ)."""
    for layer, spread in ((_head(model), LOGIT_SPREAD), (_box_head(model), BOX_SPREAD)):
        if layer is not None:
            _scaled(model, processor, layer, spread)


# A detector's box regression (before its sigmoid) scaled to this spread.
BOX_SPREAD = 1.0


def _scaled(model: nn.Module, processor: Any, layer: nn.Module, spread: float) -> None:
    weight: Any = layer.weight
    if not bool(weight.any()):  # initialised to zero (RT-DETR's box deltas): drawn first
        with torch.no_grad():
            nn.init.normal_(weight, std=0.02)
    outputs: list[torch.Tensor] = []

    def kept(_: nn.Module, __: Any, output: torch.Tensor) -> None:
        outputs.append(output.flatten())

    hook = layer.register_forward_hook(kept)
    with torch.inference_mode():
        for image in _images():
            model(**processor(images=image, return_tensors="pt"))
    hook.remove()
    found = float(torch.cat(outputs).std())
    with torch.no_grad():
        weight.mul_(spread / max(found, 1e-12))
        bias: Any = layer.bias
        if bias is not None:
            bias.zero_()


def _head(model: nn.Module) -> nn.Module | None:
    for name in ("classifier", "class_labels_classifier"):
        found = getattr(model, name, None)
        if isinstance(found, nn.Linear):
            return found
    decode = getattr(model, "decode_head", None)
    if decode is not None:
        classifier: nn.Module = decode.classifier
        return classifier
    embed = getattr(getattr(getattr(model, "model", None), "decoder", None), "class_embed", None)
    if embed is None:  # Deformable DETR's heads are the model's own
        embed = getattr(model, "class_embed", None)
    if embed is not None:
        last: nn.Module = embed[-1]
        return last
    # Otherwise (DPT's segmentation head) the last convolution with a channel per class.
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    convolutions = [layer for layer in model.modules()
                    if isinstance(layer, nn.Conv2d) and layer.out_channels == labels]  # fmt: skip
    return convolutions[-1] if convolutions else None


def _box_head(model: nn.Module) -> nn.Module | None:
    predictor = getattr(model, "bbox_predictor", None)
    if predictor is None:
        embed = getattr(getattr(getattr(model, "model", None), "decoder", None), "bbox_embed",
                        None)  # fmt: skip
        if embed is None:
            embed = getattr(model, "bbox_embed", None)
        predictor = embed[-1] if embed is not None else None
    if predictor is None:
        return None
    last: nn.Module = predictor.layers[-1]
    return last


def _images(data: Sequence[bytes] | None = None) -> list[Image.Image]:
    images = []
    for each in data if data is not None else photos():
        with Image.open(io.BytesIO(each)) as image:
            images.append(image.convert("RGB"))
    return images


def reference(directory: Path) -> tuple[nn.Module, Any]:
    """The model and processor as their user loads them: ``AutoImageProcessor`` and the
    class ``config.json`` names."""
    t = _transformers()
    config = t.AutoConfig.from_pretrained(directory)
    model = getattr(t, config.architectures[0]).from_pretrained(directory).eval()
    return model, t.AutoImageProcessor.from_pretrained(directory)


def _outputs(directory: Path, images: Sequence[bytes]) -> Iterator[tuple[Image.Image, Any, Any]]:
    """Each photo, the reference model's output on it (eager, fp32) and the processor."""
    model, processor = reference(directory)
    with torch.inference_mode():
        for image in _images(images):
            yield image, model(**processor(images=image, return_tensors="pt")), processor


def classified(directory: Path, images: Sequence[bytes]) -> list[np.ndarray[Any, Any]]:
    """transformers' own answer, photo by photo: the softmax of the logits."""
    return [output.logits.softmax(-1)[0].numpy() for _, output, _ in _outputs(directory, images)]


def embedded(directory: Path, images: Sequence[bytes]) -> list[np.ndarray[Any, Any]]:
    """The image vector, photo by photo: ``image_embeds`` or ``pooler_output``."""
    answers = []
    for _, output, _ in _outputs(directory, images):
        vector = getattr(output, "image_embeds", None)
        answers.append((vector if vector is not None else output.pooler_output)[0].numpy())
    return answers


def detected(directory: Path, images: Sequence[bytes], threshold: float) -> list[Detected]:
    """``post_process_object_detection(outputs, threshold, target_sizes)`` photo by photo."""
    answers = []
    for image, output, processor in _outputs(directory, images):
        (found,) = processor.post_process_object_detection(
            output, threshold=threshold, target_sizes=[(image.height, image.width)]
        )
        answers.append(Detected(found["boxes"].numpy(), found["scores"].numpy(),
                                found["labels"].numpy()))  # fmt: skip
    return answers


def segmented(directory: Path, images: Sequence[bytes]) -> list[np.ndarray[Any, Any]]:
    """``post_process_semantic_segmentation(outputs, target_sizes)`` photo by photo."""
    answers = []
    for image, output, processor in _outputs(directory, images):
        (mask,) = processor.post_process_semantic_segmentation(
            output, target_sizes=[(image.height, image.width)]
        )
        answers.append(mask.numpy())
    return answers
