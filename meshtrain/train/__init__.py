"""Step factories (one process, sharded, pipelined), the optimizer, learning-rate schedules
and the FLOPs / MFU accounting of a step."""
