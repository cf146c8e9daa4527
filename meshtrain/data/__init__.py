"""Training data. Imports nothing from the rest of meshtrain, so loaders can run anywhere
(worker processes, tools) without pulling in the model or the parallel runtime."""

from .builtin import CORPUS, ByteTokenizer, BuiltinData, sample_windows

__all__ = ["CORPUS", "BuiltinData", "ByteTokenizer", "sample_windows"]
