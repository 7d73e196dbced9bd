"""DeepSpeed on a machine without CUDA, for the examples and tests: without its shared-memory all-reduce op.

On the CPU accelerator, the first deepspeed.init_distributed of a process (deepspeed.initialize calls it
too) builds DeepSpeed's shared-memory all-reduce op (deepspeed_shm_comm) with torch's JIT extension
builder: two C++ files against torch's headers, ~120 CPU-s on the 2-core CI box, into
~/.cache/torch_extensions, a folder that every venv of the user shares. The build names the venv's include
paths, so a venv whose build another venv replaced compiles it again, inside whichever run comes first
(an example, a test). The op serves DeepSpeed's inference_all_reduce (AutoTP inference) only, which no
path of ep_plugin, its examples or its tests takes; without it DeepSpeed's comm uses the process group's
own all_reduce (gloo), and nothing is compiled.
"""
from __future__ import annotations

import torch

SHM_OP = "deepspeed_shm_comm"


def deepspeed_without_shm_op() -> bool:
    """On a machine without CUDA, mark DeepSpeed's shared-memory all-reduce op unavailable in this process,
    before deepspeed.init_distributed or deepspeed.initialize, so that DeepSpeed neither builds nor loads it.
    Does nothing where CUDA is available (DeepSpeed's CPU accelerator, the one that builds the op, is not
    used there). True when applied."""
    if torch.cuda.is_available():
        return False
    import deepspeed.ops

    # DeepSpeed probes which ops can be built once per process and keeps the answers in this dict, which
    # deepspeed.comm.torch.build_shm_op reads before building (its own comment: edits to it persist).
    deepspeed.ops.__compatible_ops__[SHM_OP] = False
    return True
