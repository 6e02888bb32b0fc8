"""Importers of pretrained checkpoints from other libraries, and the exporter back to the
Hugging Face format (numpy and safetensors only, no PyTorch)."""

from posenc_jax.convert.hf_bert import (ConversionError, ConversionReport, config_from_hf,
                                        hf_config_of, load_hf_bert, package_model_dir,
                                        read_hf_config, save_hf_bert, vocab_path)

__all__ = [
    "ConversionError", "ConversionReport", "config_from_hf", "hf_config_of", "load_hf_bert",
    "package_model_dir", "read_hf_config", "save_hf_bert", "vocab_path",
]
