"""EPPluginTokenDispatcher: megatron-core's MoETokenDispatcher on ep_plugin.EPBuffer.

Imports megatron-core at import time: hooks.install() (run by `import ep_plugin.megatron` when
megatron-core is importable) imports this module, and nothing else in ep_plugin does.

With comm.stats on, the buffer's stats are reported every comm.stats_interval steps through Python
logging (logger "ep_plugin.megatron", rank 0 of the EP group): tokens/s, the communication share of
the wall time, the slowest rank, imbalance and timeouts (ep_plugin.telemetry).

What the experts get (dispatch_postprocess) depends on the experts MoELayer built with the dispatcher:
  - experts that take device counts (EPGroupedMLP: it calls take_device_counts() while MoELayer builds
    it, right after this dispatcher): the expert-major rows as dispatch delivered them and
    tokens_per_expert as the [E_local] int64 device tensor, with the attached comm.host_sync (false
    by default: rows sized for the worst case of comm.max_tokens_per_rank, their tail unwritten).
    token_dispatch, dispatch_postprocess and token_combine then read nothing on the host, eager or
    compiled (no graph break, no unbacked int);
  - megatron's experts (SequentialMLP, TEGroupedMLP) split their input by host counts
    (`tokens_per_expert.tolist()`, experts.py, 0.19.2), so eager forwards dispatch with
    comm.host_sync on (exact rows: the host waits once, inside the dispatch) and get the counts as a
    host tensor.

Under torch.compile (torch.compiler.is_compiling() while dynamo traces the layer) the dispatcher
takes one of two paths, chosen by the attached config's comm.host_sync (resolve_config):
  - false (the default): dispatch and combine are the custom ops of ep_plugin.ops, traced into the
    graph (no graph break in these hooks). The dispatch rows are sized for the worst case of
    comm.max_tokens_per_rank (their shape follows from the config), and the counts stay on the
    device. For megatron's experts dispatch_postprocess cuts the rows to the valid ones by one host
    read of their count, `tokens_per_expert.sum().item()`. With
    torch._dynamo.config.capture_scalar_outputs = True both reads (ours and megatron's tolist) trace as
    unbacked ints (one device->host copy each at run time, no graph break); without it each is a
    graph break. Experts that take device counts need neither.
  - true: the eager EPBuffer calls, each hook a torch.compiler.disable'd call (three graph breaks per
    layer: token_dispatch, dispatch_postprocess, token_combine), exact-size rows.
The compiled path uses its own EPBuffer (comm.host_sync false), from the same cache; it is built
when the first compiled forward runs its first dispatch (a collective, in program order). The
stats reports (comm.stats) are not made by compiled forwards.
"""
from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Dict, List, Optional

import torch
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ... import ops
from ...buffer import EPBuffer
from ...config import EPConfig
from ...telemetry import log_to, training_step
from ..buffer_cache import buffer_key, get_buffer
from .config import resolve_config

_REPORT = log_to(logging.getLogger("ep_plugin.megatron"))

# The compiled path's constants. Dynamo runs the assume_constant_result functions below when it
# traces and puts their results into the graph, so the config is resolved and the op id registered in
# plain Python, never traced. Their arguments must be constants: an int key per (TransformerConfig,
# EP group, experts, top-k), shared by every layer built from the same config, so that layers
# compiled one by one hit the same cache entry (a per-layer key would recompile for each layer).
class _CompiledSpec:
    def __init__(self, transformer_config, ep_group, ep_size: int, num_experts: int, topk: int):
        self.transformer_config, self.ep_group, self.ep_size = transformer_config, ep_group, ep_size
        self.num_experts, self.topk = num_experts, topk
        self._cfg: Optional[EPConfig] = None

    def config(self) -> EPConfig:
        if self._cfg is None:
            self._cfg = resolve_config(self.transformer_config, self.num_experts, self.topk, compiled=True)
        return self._cfg


_SPECS: Dict[int, _CompiledSpec] = {}
_SPEC_KEYS: Dict[tuple, int] = {}  # the spec holds its TransformerConfig, so the id in a key stays its own


def _spec_key(transformer_config, ep_group, ep_size: int, num_experts: int, topk: int) -> int:
    k = (id(transformer_config), ep_group, int(num_experts), int(topk))
    key = _SPEC_KEYS.get(k)
    if key is None:
        key = _SPEC_KEYS[k] = len(_SPECS) + 1
        _SPECS[key] = _CompiledSpec(transformer_config, ep_group, ep_size, num_experts, topk)
    return key


@torch.compiler.assume_constant_result
def _compiled_uses_ops(key: int) -> bool:
    """True: the compiled path runs ep_plugin.ops (comm.host_sync false); False: eager calls."""
    return not _SPECS[key].config().comm.host_sync


@torch.compiler.assume_constant_result
def _compiled_capacity(key: int) -> int:
    return _SPECS[key].config().comm.max_tokens_per_rank


@torch.compiler.assume_constant_result
def _compiled_buffer_id(key: int, hidden: int) -> int:
    """The ep_plugin.ops id of the compiled path's buffer: registered, not built (the op builds it)."""
    spec = _SPECS[key]
    cfg = spec.config()
    return ops.register_factory(functools.partial(get_buffer, spec.ep_group, cfg, hidden), cfg, spec.ep_size,
                                hidden, key=("megatron",) + buffer_key(spec.ep_group, cfg, hidden))


def _wait(event) -> None:
    if event is not None:
        event.current_stream_wait()


# The dispatcher this thread built last, with the (config, pg_collection) it was given: MoELayer.__init__
# builds its dispatcher and then, at once, its experts from the same two objects, and megatron has no
# other link between them (the dispatcher never sees its experts).
_LAST_BUILT = threading.local()


def take_device_counts(config, pg_collection) -> Optional["EPPluginTokenDispatcher"]:
    """Called by experts that take tokens_per_expert as a device tensor and worst-case-sized rows
    (EPGroupedMLP) from their __init__: the ep_plugin dispatcher MoELayer built just before them from
    the same config and process groups now hands them its expert-major output without a host read
    (see the module docstring). Returns that dispatcher, or None when the layer has another one (the
    experts then get its exact-size output). Each dispatcher is taken once."""
    last = getattr(_LAST_BUILT, "entry", None)
    if last is None:
        return None
    ref, cfg, pgs = last
    d = ref()
    if d is None or cfg is not config or pgs is not pg_collection:
        return None
    _LAST_BUILT.entry = None
    d.device_counts = True
    return d


class EPPluginTokenDispatcher(MoETokenDispatcher):
    """megatron-core MoETokenDispatcher on ep_plugin.EPBuffer (one copy per destination rank).

    Workflow (same hooks, same outputs as MoEAlltoAllTokenDispatcher):
      dispatch_preprocess : [S, B, H] -> [T, H]; routing map -> top-k ids + their probs
      token_dispatch      : EPBuffer.dispatch(layout="expert"): one row per (token, local expert),
                            grouped by expert in the received order, with its prob
      dispatch_postprocess: no permute; tokens_per_expert for the experts: on the device with
                            experts that take it (EPGroupedMLP: no host read, worst-case rows),
                            else on the host (exact rows)
      combine_preprocess  : nothing (the un-permute is summed inside the combine kernel)
      token_combine       : EPBuffer.combine of the expert-major rows
      combine_postprocess : [T, H] -> [S, B, H] (+ shared experts when overlapped)
    Tensors that carry gradients always flow through the method arguments (never through
    state), so megatron's 1F1B EP-overlap schedule, which detaches between stages, works.

    Buffer: the EPBuffer of (EP group, config, hidden) from integrations/buffer_cache.py, shared by
    every layer and batch and sized by comm.max_tokens_per_rank; a batch with more tokens raises
    ValueError in dispatch_preprocess, before any communication.

    torch.compile: token_dispatch / token_combine become ep_plugin.ops' custom ops (worst-case rows,
    counts on the device) and dispatch_postprocess cuts the rows to the valid ones for megatron's
    experts; see the module docstring for what breaks the graph and when.

    device_counts: whether the experts take device counts and worst-case rows; set by
    take_device_counts() while MoELayer builds the experts (or by hand, before the first forward).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        given_pgs = pg_collection
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size != 1:
            raise ValueError(
                "moe_token_dispatcher_type='ep_plugin' supports expert_tensor_parallel_size=1 "
                f"only (got expert TP size {self.tp_size})")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("moe_token_dispatcher_type='ep_plugin' is dropless: "
                             "moe_pad_expert_input_to_capacity is not supported")
        if config.moe_router_padding_for_quantization:
            raise ValueError("moe_token_dispatcher_type='ep_plugin' does not support "
                             "moe_router_padding_for_quantization")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.router_topk = config.moe_router_topk
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_moe_experts={self.num_experts} is not divisible by the EP size {self.ep_size}")
        if self.local_expert_indices != list(range(self.ep_rank * num_local_experts,
                                                   (self.ep_rank + 1) * num_local_experts)):
            raise ValueError("ep_plugin expects rank r to own experts [r*E/ep, (r+1)*E/ep)")
        self.cudagraph_attrs = []
        self.shared_experts = None
        self.buffer: Optional[EPBuffer] = None
        self._ep_cfg: Optional[EPConfig] = None
        # per-forward metadata (no gradients)
        self.hidden_shape = None
        self.topk_idx = None
        self.handle = None
        self.num_recv = None
        self.tokens_per_expert = None
        self.probs_dtype = None
        self._key = _spec_key(config, self.ep_group, self.ep_size, self.num_experts, self.router_topk)
        self.device_counts = False
        _LAST_BUILT.entry = (weakref.ref(self), config, given_pgs)

    # ---------------------------------------------------------------- helpers
    def _ep_config(self) -> EPConfig:
        if self._ep_cfg is None:
            self._ep_cfg = resolve_config(self.config, self.num_experts, self.router_topk,
                                          device_counts=self.device_counts)
        return self._ep_cfg

    def _check_capacity(self, num_tokens: int) -> None:
        # checked at the first hook, before any communication: a rank that went on to dispatch
        # would leave its peers waiting in a collective
        if torch.compiler.is_compiling():
            cap = _compiled_capacity(self._key)
        else:
            cap = self._ep_config().comm.max_tokens_per_rank
        if num_tokens > cap:
            raise ValueError(
                f"ep_plugin.megatron: this MoE layer got {num_tokens} tokens on EP rank {self.ep_rank} "
                f"(hidden states {tuple(self.hidden_shape)}), more than comm.max_tokens_per_rank={cap} "
                f"that its EPBuffer is sized for; set comm.max_tokens_per_rank to at least {num_tokens} "
                "in the ep_plugin YAML (or the config given to ep_plugin.megatron.attach_config)")

    def _buffer_for(self, x: torch.Tensor) -> EPBuffer:
        H = x.shape[1]
        if self.buffer is None or self.buffer.hidden != H:
            self.buffer = get_buffer(self.ep_group, self._ep_config(), H)
        return self.buffer

    def _routing_to_topk(self, routing_map: torch.Tensor) -> torch.Tensor:
        """[T, E] bool -> [T, K] int64 expert ids in increasing order, -1 for unused slots."""
        K = min(self.router_topk, routing_map.shape[1])
        vals, idx = torch.sort(routing_map.to(torch.uint8), dim=1, descending=True, stable=True)
        vals, idx = vals[:, :K], idx[:, :K]
        return torch.where(vals > 0, idx, torch.full_like(idx, -1)).contiguous()

    # ---------------------------------------------------------------- dispatch
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        assert routing_map.dim() == 2 and routing_map.dtype == torch.bool, "routing_map must be [T, E] bool"
        assert probs.dim() == 2, "probs must be [T, E]"
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        self._check_capacity(hidden_states.shape[0])
        if self.config.overlap_moe_expert_parallel_comm:
            # megatron's EP-overlap schedule frees the dispatch node's inputs after the
            # forward (resize_(0)); a view would free the layernorm output the router needs
            hidden_states = hidden_states.clone()
        with torch.no_grad():
            topk_idx = self._routing_to_topk(routing_map)
        self.topk_idx = topk_idx
        self.probs_dtype = probs.dtype
        topk_probs = probs.gather(1, topk_idx.clamp(min=0))
        topk_probs = topk_probs.masked_fill(topk_idx < 0, 0).float().contiguous()
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return hidden_states, topk_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if torch.compiler.is_compiling():
            if _compiled_uses_ops(self._key):
                return self._token_dispatch_op(hidden_states, probs)
            return _eager_token_dispatch(self, hidden_states, probs)
        return self._token_dispatch_eager(hidden_states, probs)

    def _token_dispatch_op(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The compiled path: ep_plugin.ops' dispatch, worst-case rows, counts on the device."""
        hidden_states = hidden_states.contiguous()
        bid = _compiled_buffer_id(self._key, hidden_states.shape[1])
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        res = ops.dispatch(bid, hidden_states, self.topk_idx, probs.float().contiguous(), layout="expert")
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(res.x)
        self.handle = res.handle  # an ops.OpHandle: the handle token (a tensor of the graph) and T
        self.num_recv = None      # not read on the host in a compiled forward
        self.tokens_per_expert = res.num_tokens_per_expert  # [E_local] int64 on the device
        self.topk_idx = None
        return res.x, res.topk_weights

    def _token_dispatch_eager(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        hidden_states = hidden_states.contiguous()
        buf = self._buffer_for(hidden_states)
        training_step(self, buf, hidden_states.shape[0], _REPORT)  # every comm.stats_interval steps
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        # expert-major: the rows land grouped by local expert, in the received order (alltoall's)
        res = buf.dispatch(hidden_states, self.topk_idx, probs.float().contiguous(), layout="expert")
        if self.shared_experts is not None:
            # shared experts' fc1 runs on its stream while the rows are in flight
            self.shared_experts.linear_fc1_forward_and_act(res.x)
        _wait(res.event)
        self.handle = res.handle
        if self.device_counts:
            # tokens received (one per source token), for reports: the device count, read by nobody here
            self.num_recv = res.handle.num_recv_device
            self.tokens_per_expert = res.num_tokens_per_expert  # [E_local] int64 on the device
        else:
            self.num_recv = res.handle.num_recv
            self.tokens_per_expert = list(res.tokens_per_expert)  # the experts' split sizes (host)
        self.topk_idx = None
        return res.x, res.topk_weights

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if torch.compiler.is_compiling():
            if _compiled_uses_ops(self._key):
                return self._dispatch_postprocess_op(hidden_states, probs)
            return _eager_dispatch_postprocess(self, hidden_states, probs)
        return self._dispatch_postprocess_eager(hidden_states, probs)

    def _dispatch_postprocess_op(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.device_counts:
            return self._device_counts_output(hidden_states, probs)
        # megatron's experts split their input by host counts (tokens_per_expert.tolist()), which must
        # add up to its rows: cut the worst-case rows to the valid ones. The count is the one host
        # read of the compiled path (an unbacked int with capture_scalar_outputs, else a graph break)
        tokens_per_expert = self.tokens_per_expert
        n = tokens_per_expert.sum().item()
        torch._check(n >= 0)
        torch._check(n <= hidden_states.shape[0])
        rows = hidden_states[:n]
        if self.config.overlap_moe_expert_parallel_comm:
            rows = rows.clone()
        return rows, tokens_per_expert, probs[:n].to(self.probs_dtype)

    def _device_counts_output(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        # the experts find their rows by the device counts and zero the tail themselves: nothing to
        # cut, so nothing to read on the host
        rows = hidden_states
        if self.config.overlap_moe_expert_parallel_comm:
            rows = rows.clone()  # see _dispatch_postprocess_eager
        return rows, self.tokens_per_expert, probs.to(self.probs_dtype)

    def _dispatch_postprocess_eager(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.device_counts:
            return self._device_counts_output(hidden_states, probs)
        # already grouped by expert: nothing to permute. An exact-size dispatch (the config this
        # dispatcher resolves) has exactly sum(tokens_per_expert) rows; a worst-case-sized one is cut
        # to them (a view)
        n = int(sum(self.tokens_per_expert))
        tokens_per_expert = torch.tensor(self.tokens_per_expert, dtype=torch.long)
        rows = hidden_states[:n]
        if self.config.overlap_moe_expert_parallel_comm:
            # megatron's EP-overlap schedule frees the dispatch stage's outputs after the forward
            # (resize_(0)), but the experts keep their input for backward: give them their own copy
            rows = rows.clone()
        return rows, tokens_per_expert, probs[:n].to(self.probs_dtype)

    # ---------------------------------------------------------------- combine
    def combine_preprocess(self, hidden_states: torch.Tensor):
        # the un-permute (sum of each row's experts) happens inside the combine kernel
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():
            if _compiled_uses_ops(self._key):
                return self._token_combine_op(hidden_states)
            return _eager_token_combine(self, hidden_states)
        return self._token_combine_eager(hidden_states)

    def _token_combine_op(self, hidden_states: torch.Tensor):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        out = ops.combine(hidden_states.contiguous(), self.handle)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        self.handle = None
        return out

    def _token_combine_eager(self, hidden_states: torch.Tensor):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        out = self.buffer.combine(hidden_states.contiguous(), self.handle)
        event = None
        if isinstance(out, tuple):
            out, event = out
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        _wait(event)
        self.handle = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        out = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts.get_output()
        return out

    # flex-dispatcher API used by megatron's paged stash
    def check_over_budget(self):
        return None

    def reset_over_budget(self):
        return None


# comm.host_sync: true under torch.compile: the eager calls, each behind a graph break. The buffer is
# the compiled config's (host_sync true: the same as the eager path's, so the eager cache entry).
@torch.compiler.disable
def _eager_token_dispatch(d: EPPluginTokenDispatcher, hidden_states, probs):
    return d._token_dispatch_eager(hidden_states, probs)


@torch.compiler.disable
def _eager_dispatch_postprocess(d: EPPluginTokenDispatcher, hidden_states, probs):
    return d._dispatch_postprocess_eager(hidden_states, probs)


@torch.compiler.disable
def _eager_token_combine(d: EPPluginTokenDispatcher, hidden_states):
    return d._token_combine_eager(hidden_states)
