"""DeepSeek-V4 checkpoints in the published (hub), transformers and T-Rex formats: read them as native
tensors (dequantising FP8 and MXFP4), write them back streamed, convert between them."""

from trainer.hub.reader import CheckpointError, CheckpointReader, detect_format, load_model, open_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "detect_format", "load_model", "open_checkpoint"]
