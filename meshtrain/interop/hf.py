"""Hugging Face interop, the public API: config.json both ways (hf_config.py), export of
parameters in memory or streamed from a DCP checkpoint to safetensors (export.py), and
import of safetensors weights as plain tensors or as DTensors laid out by a Plan
(load.py), for every registered family with a format (llama and gpt2).

Each family's format is in its folder (models/<family>/hf.py, models/hf.py `HFFormat`):
the tensor names and layouts (llama: models/llama/hf.py, with Qwen3, Mixtral and Qwen3-MoE
in models/llama/hf_moe.py; gpt2: models/gpt2/hf.py) and its config.json keys. This
package is the machinery every format shares.

Import also accepts base-model files whose names lack the "model." / "transformer."
prefix (as the original GPT-2 release has them). Weights are read with
`safetensors.safe_open` only: pickle files (pytorch_model.bin) are never loaded.
"""

from ..models.hf import HFTensor, Piece
from .export import export_dcp, export_dtype, resolve_checkpoint, save_hf
from .hf_config import from_hf_config, read_hf_config, to_hf_config
from .layout import hf_layout
from .load import check_same_model, load_hf_params
from .pieces import DTYPES, hf_format

__all__ = ["DTYPES", "HFTensor", "Piece", "hf_format", "check_same_model", "export_dcp", "export_dtype",
           "from_hf_config", "hf_layout", "load_hf_params", "read_hf_config", "resolve_checkpoint", "save_hf",
           "to_hf_config"]
