"""Interoperability with other ecosystems: Hugging Face transformers (`hf`)."""

from .hf import (export_dcp, from_hf_config, hf_layout, load_hf_params, read_hf_config, save_hf,
                 to_hf_config)

__all__ = ["export_dcp", "from_hf_config", "hf_layout", "load_hf_params", "read_hf_config", "save_hf",
           "to_hf_config"]
