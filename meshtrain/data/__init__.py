"""Training data. Imports nothing from the rest of meshtrain, so loaders can run anywhere
(worker processes, tools) without pulling in the model or the parallel runtime.

    preprocess     JSON lines -> Megatron-LM indexed dataset (<prefix>.bin / .idx)
    indexed        read and write those files, byte compatible with Megatron-LM
    tokenizer      bytes, or a Hugging Face tokenizer.json
    dataset        packing, shuffling, the trainer's splits
    blend          mixing datasets by weight
    build          build_data: the trainer's data from data.paths, checked
    builtin        the embedded corpus (the default, no-download dataset)
"""

from .builtin import CORPUS, builtin_dataset
from .blend import BlendSchedule
from .build import build_data, parse_paths
from .dataset import EpochShuffle, PackedDataset, TokenData
from .errors import DataError
from .indexed import IndexedDataset, IndexedWriter
from .preprocess import preprocess
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["CORPUS", "BlendSchedule", "ByteTokenizer", "DataError", "EpochShuffle", "HFTokenizer",
           "IndexedDataset", "IndexedWriter", "PackedDataset", "TokenData", "build_data", "builtin_dataset",
           "load_tokenizer", "parse_paths", "preprocess"]
