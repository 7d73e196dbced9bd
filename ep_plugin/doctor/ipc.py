"""Does CUDA IPC work here? Two processes: one allocates on GPU 0 and shares the memory through
torch's CUDA IPC (cudaIpcGetMemHandle), the other opens it (cudaIpcOpenMemHandle) and copies it to
GPU 1. This is what the nvlink backend does with its buffers. In a container without a shared IPC
namespace (docker without --ipc=host, Kubernetes without hostIPC), the open fails.
"""
from __future__ import annotations

import queue
from typing import Tuple

_VALUE = 3.0
_N = 1 << 16


def _child(inbox, outbox) -> None:
    try:
        t = inbox.get(timeout=60)                # rebuilt from the IPC handle: the open happens here
        got = t.to("cuda:1").sum().item()        # and a read from the other GPU
        want = _VALUE * _N
        outbox.put((got == want, f"read {got:g}, expected {want:g}" if got != want else ""))
    except Exception as exc:  # reported to the parent, which explains it
        outbox.put((False, f"{type(exc).__name__}: {exc}".strip()))


def probe(timeout_s: float = 60.0) -> Tuple[bool, str]:
    """(works, what happened). Needs 2 visible GPUs; takes a few seconds (a spawned interpreter)."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child, args=(inbox, outbox), daemon=True)
    proc.start()
    try:
        shared = torch.full((_N,), _VALUE, device="cuda:0")
        inbox.put(shared)
        ok, msg = outbox.get(timeout=timeout_s)
    except queue.Empty:
        ok, msg = False, f"the second process did not answer within {timeout_s:.0f} s"
    except Exception as exc:
        ok, msg = False, f"{type(exc).__name__}: {exc}"
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    return ok, msg or "a second process opened a GPU0 buffer through CUDA IPC and read it from GPU1"
