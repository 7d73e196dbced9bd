"""The one EPBuffer cache of the framework integrations (Megatron-core and DeepSpeed).

One EPBuffer per (process group, config, hidden), shared by every layer that asks with the same
three and reused for every batch. A kernel backend's EPBuffer holds communication memory sized by
``comm.max_tokens_per_rank`` (CUDA IPC or NVSHMEM), and building one is collective, so every rank
must build the same buffers in the same order: the key holds nothing that differs between batches or
ranks (no token count). A batch larger than the capacity is the caller's error to raise, before any
communication, never a reason for a bigger buffer.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, List

import torch.distributed as dist

from ..buffer import EPBuffer
from ..config import EPConfig

logger = logging.getLogger(__name__)

_BUFFERS: Dict[tuple, EPBuffer] = {}


def _frozen(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def buffer_key(group, cfg: EPConfig, hidden: int) -> tuple:
    """(group, hidden, every config value): configs that compare equal share a buffer."""
    group = group if group is not None else dist.group.WORLD
    return group, int(hidden), _frozen(cfg.to_dict())


def get_buffer(group, cfg: EPConfig, hidden: int) -> EPBuffer:
    """The cached EPBuffer for (group, cfg, hidden); built on first use, which is collective: every
    rank of `group` must ask for the same buffers in the same order."""
    key = buffer_key(group, cfg, hidden)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = EPBuffer(key[0], cfg, hidden=int(hidden), num_experts=cfg.moe.num_experts)
        _BUFFERS[key] = buf
        logger.info("ep_plugin: EPBuffer(hidden=%d, experts=%d, max_tokens_per_rank=%d, backend=%s)",
                    buf.hidden, buf.num_experts, cfg.comm.max_tokens_per_rank, buf.backend_name)
    return buf


def cached_buffers() -> List[EPBuffer]:
    """Every buffer in the cache, in the order they were built."""
    return list(_BUFFERS.values())


def clear_buffers() -> None:
    """Close and drop every cached EPBuffer (both integrations'). Closing a kernel backend's buffer
    synchronises its group, so every rank calls this together, before the process group goes away;
    layers that run again afterwards build new buffers."""
    for buf in _BUFFERS.values():
        with contextlib.suppress(Exception):
            buf.close()
    _BUFFERS.clear()


__all__ = ["buffer_key", "get_buffer", "cached_buffers", "clear_buffers"]
