"""Training data. Imports nothing from the rest of meshtrain but its errors, so loaders
can run anywhere (worker processes, tools) without pulling in the model or the parallel
runtime.

    preprocess     JSON lines -> Megatron-LM indexed dataset (<prefix>.bin / .idx)
    indexed        read and write those files, byte compatible with Megatron-LM
    tokenizer      bytes, or a Hugging Face tokenizer.json
    dataset        packing, shuffling, the trainer's splits
    blend          mixing datasets by weight
    build          build_data: the trainer's data from data.paths, checked
    builtin        the embedded corpus (the default, no-download dataset)
    config         the run config's data.* section (DataConfig) and data.paths' shape
"""

from ..lazy import lazy_exports

# Loaded on first use: the config imports data/config.py without torch or numpy.
_EXPORTS = {"CORPUS": ".builtin", "builtin_dataset": ".builtin", "BlendSchedule": ".blend", "build_data": ".build",
            "EpochShuffle": ".dataset", "PackedDataset": ".dataset", "TokenData": ".dataset", "DataError": ".errors",
            "IndexedDataset": ".indexed", "IndexedWriter": ".indexed", "preprocess": ".preprocess",
            "ByteTokenizer": ".tokenizer", "HFTokenizer": ".tokenizer", "load_tokenizer": ".tokenizer",
            "DataConfig": ".config", "parse_paths": ".config"}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
