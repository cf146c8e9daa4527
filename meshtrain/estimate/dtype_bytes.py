"""Bytes per element of the fixed-width dtypes the estimates count (fp32 statistics and
gradients, int64 indices, bool masks), so memory and collectives size them alike."""

FP32, INT64, BOOL, BF16 = 4, 8, 1, 2
