"""Importers of pretrained checkpoints from other libraries (numpy only, no PyTorch)."""

from posenc_jax.convert.hf_bert import (ConversionError, ConversionReport, config_from_hf,
                                        load_hf_bert, package_model_dir, read_hf_config,
                                        vocab_path)

__all__ = [
    "ConversionError", "ConversionReport", "config_from_hf", "load_hf_bert", "package_model_dir",
    "read_hf_config", "vocab_path",
]
