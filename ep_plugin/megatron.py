"""Megatron-core (0.19.2) integration: ep_plugin as a MoE token dispatcher.

    import ep_plugin.megatron                      # installs the hooks (see install())
    config = TransformerConfig(..., moe_token_dispatcher_type="ep_plugin")

or, as a backend of megatron's flex dispatcher (what megatron's own scheduling code expects for
shared-expert overlap and overlap_moe_expert_parallel_comm):

    config = TransformerConfig(..., moe_token_dispatcher_type="flex",
                               moe_flex_dispatcher_backend="ep_plugin")

Routing, overlap and communication settings can come from one ep_plugin YAML file:

    fields = ep_plugin.megatron.config_from_yaml("configs/deepseek_v3.yaml", **{"comm.backend": "auto"})
    config = TransformerConfig(num_layers=..., hidden_size=..., **fields)

The dispatcher sends each token once to every rank that owns one of its experts (EPBuffer.dispatch),
then sorts the received (row, expert) pairs into the expert-grouped layout megatron's experts take,
with the matching routing probabilities; megatron's experts apply those probabilities exactly as with
the `alltoall` dispatcher (after the activation, or on the input with moe_apply_probs_on_input).
After the experts it sums each row's expert outputs (un-permute) and combines them back
(EPBuffer.combine). Forward and backward match `alltoall` (tests/test_megatron.py).

megatron-core has no dispatcher registry: MoELayer.__init__ picks a class by name. install() wraps
MoELayer.__init__ (for the "ep_plugin" name), swaps the flex dispatcher class that moe_layer uses
for a small factory (for flex + "ep_plugin"), and lets TransformerConfig validate
moe_token_dispatcher_type="ep_plugin" with the rules of "alltoall" (so shared-expert overlap and
overlap_moe_expert_parallel_comm are accepted, as they are for alltoall). uninstall() restores all
three. Nothing else in megatron is touched.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Any, Dict, List, Optional

import torch

from .buffer import EPBuffer
from .config import EPConfig, load_config
from .errors import BackendUnavailableError

logger = logging.getLogger(__name__)

NAME = "ep_plugin"

__all__ = [
    "NAME",
    "EPPluginTokenDispatcher",
    "install",
    "uninstall",
    "is_installed",
    "config_from_yaml",
    "set_default_config",
    "get_default_config",
    "attach_config",
    "GroupedMMLinear",
    "grouped_mm_experts",
    "cpu_stand_ins",
]

# ------------------------------------------------------------------------------------------ config

_DEFAULT_CFG: Optional[EPConfig] = None
_SECTIONS = ("moe", "comm", "overlap")


def set_default_config(cfg) -> Optional[EPConfig]:
    """Set the EPConfig (or YAML path / dict / preset name, or None) the dispatchers use when the
    TransformerConfig carries none (see attach_config). Returns the loaded EPConfig."""
    global _DEFAULT_CFG
    _DEFAULT_CFG = None if cfg is None else load_config(cfg)
    return _DEFAULT_CFG


def get_default_config() -> Optional[EPConfig]:
    return _DEFAULT_CFG


def attach_config(transformer_config, cfg) -> EPConfig:
    """Give one TransformerConfig its own ep_plugin settings (takes precedence over the default)."""
    cfg = load_config(cfg)
    transformer_config.ep_plugin_config = cfg
    return cfg


def config_from_yaml(path_or_cfg, **overrides) -> Dict[str, Any]:
    """Turn an ep_plugin YAML file (path, preset name, dict or EPConfig) into TransformerConfig fields.

    Keyword overrides: keys naming an ep_plugin setting ("comm.backend", "moe.topk", or a whole
    section: comm={"backend": "torch"}) are applied to the YAML before validation; any other key is
    a TransformerConfig field and is put into (or replaces an entry of) the returned dict.

    The routing section becomes moe_router_* fields (experts, top-k, groups, score function,
    scaling, expert bias, pre-softmax), the overlap section becomes moe_shared_expert_overlap, and
    moe_token_dispatcher_type is "ep_plugin". The comm section is handed to the dispatchers: the
    loaded EPConfig becomes the module default (set_default_config); call attach_config on a
    TransformerConfig to give it a different one.
    """
    ep_over, tc_over = {}, {}
    for k, v in overrides.items():
        (ep_over if ("." in k or k in _SECTIONS) else tc_over)[k] = v
    cfg = load_config(path_or_cfg, ep_over or None)
    m = cfg.moe
    fields: Dict[str, Any] = {
        "num_moe_experts": m.num_experts,
        "moe_router_topk": m.topk,
        "moe_router_num_groups": m.num_groups,
        "moe_router_group_topk": m.group_topk,
        "moe_router_score_function": m.score_function,
        "moe_router_topk_scaling_factor": m.topk_scaling_factor,
        "moe_router_enable_expert_bias": bool(m.expert_bias),
        "moe_router_pre_softmax": bool(getattr(m, "use_pre_softmax", False)),
        "moe_shared_expert_overlap": bool(cfg.overlap.shared_expert_overlap),
        "moe_token_dispatcher_type": NAME,
    }
    if m.expert_bias:
        # megatron keeps the expert bias in fp32 and needs fp32 routing for it
        fields["moe_router_dtype"] = "fp32"
    fields.update(tc_over)
    if fields.get("moe_token_dispatcher_type") == "flex":
        fields.setdefault("moe_flex_dispatcher_backend", NAME)
    set_default_config(cfg)
    return fields


def _resolve_cfg(config, num_experts: int, topk: int, num_tokens: int) -> EPConfig:
    base = getattr(config, "ep_plugin_config", None) or _DEFAULT_CFG
    comm, overlap = {}, {}
    if base is not None:
        base = load_config(base)
        comm = dict(vars(base.comm))
        overlap = dict(vars(base.overlap))
    comm["max_tokens_per_rank"] = max(int(comm.get("max_tokens_per_rank", 0) or 0), int(num_tokens), 1)
    raw = {"moe": {"num_experts": int(num_experts), "topk": int(topk)}, "comm": comm, "overlap": overlap}
    return load_config(raw)


# ------------------------------------------------------------------------------------ dispatcher

# One EPBuffer per (group, hidden, experts, comm settings), shared by all layers (kernel backends
# hold large communication buffers; calls are serialized on the communication stream).
_BUFFERS: Dict[Any, EPBuffer] = {}


def _get_buffer(group, cfg: EPConfig, hidden: int) -> EPBuffer:
    key = (id(group), hidden, cfg.moe.num_experts,
           tuple(sorted(vars(cfg.comm).items())), tuple(sorted(vars(cfg.overlap).items())))
    buf = _BUFFERS.get(key)
    if buf is None:
        try:
            buf = EPBuffer(group, cfg, hidden=hidden, num_experts=cfg.moe.num_experts)
        except (ValueError, BackendUnavailableError) as exc:
            if cfg.comm.backend != "auto":
                raise
            # auto picked a kernel backend that cannot take this layer (e.g. hidden size out of
            # its range): the torch backend always can
            warnings.warn(f"ep_plugin.megatron: comm.backend auto -> torch for hidden={hidden} ({exc})")
            cfg = load_config({"moe": vars(cfg.moe), "comm": dict(vars(cfg.comm), backend="torch"),
                               "overlap": vars(cfg.overlap)})
            buf = EPBuffer(group, cfg, hidden=hidden, num_experts=cfg.moe.num_experts)
        _BUFFERS[key] = buf
        logger.info("ep_plugin.megatron: EPBuffer(hidden=%d, experts=%d, backend=%s)",
                    hidden, cfg.moe.num_experts, buf.backend_name)
    return buf


def clear_buffers() -> None:
    """Close and drop the cached EPBuffers (e.g. before destroying the process group)."""
    for b in _BUFFERS.values():
        with contextlib.suppress(Exception):
            b.close()
    _BUFFERS.clear()


def _wait(event) -> None:
    if event is not None:
        event.current_stream_wait()


def _megatron_base():
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    return MoETokenDispatcher


def _make_dispatcher_class():
    MoETokenDispatcher = _megatron_base()

    class EPPluginTokenDispatcher(MoETokenDispatcher):
        """megatron-core MoETokenDispatcher on ep_plugin.EPBuffer (one copy per destination rank).

        Workflow (same hooks, same outputs as MoEAlltoAllTokenDispatcher):
          dispatch_preprocess : [S, B, H] -> [T, H]; routing map -> top-k ids + their probs
          token_dispatch      : EPBuffer.dispatch (rows once per destination rank, + the probs)
          dispatch_postprocess: (row, local expert) pairs sorted by expert -> expert-grouped rows,
                                tokens_per_expert (host), permuted probs for the experts
          combine_preprocess  : sum each row's expert outputs (un-permute)
          token_combine       : EPBuffer.combine
          combine_postprocess : [T, H] -> [S, B, H] (+ shared experts when overlapped)
        Tensors that carry gradients always flow through the method arguments (never through
        state), so megatron's 1F1B EP-overlap schedule, which detaches between stages, works.
        """

        def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                     pg_collection=None) -> None:
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

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
            # per-forward metadata (no gradients)
            self.hidden_shape = None
            self.topk_idx = None
            self.handle = None
            self.recv_topk_idx = None
            self.tokens_per_expert = None
            self.permute_rows = None
            self.num_recv = None
            self.probs_dtype = None

        # ---------------------------------------------------------------- helpers
        def _buffer_for(self, x: torch.Tensor) -> EPBuffer:
            T, H = x.shape
            buf = self.buffer
            if buf is None or buf.hidden != H or buf.cfg.comm.max_tokens_per_rank < T:
                cfg = _resolve_cfg(self.config, self.num_experts, self.router_topk, T)
                buf = self.buffer = _get_buffer(self.ep_group, cfg, H)
            return buf

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
            hidden_states = hidden_states.contiguous()
            buf = self._buffer_for(hidden_states)
            if self.shared_experts is not None:
                self.shared_experts.wait_current_stream()
            res = buf.dispatch(hidden_states, self.topk_idx, probs.float().contiguous())
            if self.shared_experts is not None:
                # shared experts' fc1 runs on its stream while the rows are in flight
                self.shared_experts.linear_fc1_forward_and_act(res.x)
            _wait(res.event)
            self.handle = res.handle
            self.recv_topk_idx = res.topk_idx
            self.tokens_per_expert = list(res.tokens_per_expert)
            self.num_recv = res.x.shape[0]
            self.topk_idx = None
            return res.x, res.topk_weights

        def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
            idx = self.recv_topk_idx
            R, K = idx.shape
            n = int(sum(self.tokens_per_expert))
            flat = idx.reshape(-1)
            key = torch.where(flat >= 0, flat, torch.full_like(flat, self.num_local_experts))
            # expert-major, then by received row (= source rank, then position): alltoall's order
            order = torch.sort(key, stable=True).indices[:n]
            rows = torch.div(order, K, rounding_mode="floor")
            self.permute_rows = rows
            permuted_x = hidden_states.index_select(0, rows)
            permuted_probs = probs.reshape(-1).index_select(0, order).to(self.probs_dtype)
            tokens_per_expert = torch.tensor(self.tokens_per_expert, dtype=torch.long)
            self.recv_topk_idx = None
            return permuted_x, tokens_per_expert, permuted_probs

        # ---------------------------------------------------------------- combine
        def combine_preprocess(self, hidden_states: torch.Tensor):
            rows = self.permute_rows
            self.permute_rows = None
            out = hidden_states.new_zeros((self.num_recv, hidden_states.shape[-1]))
            return out.index_add(0, rows, hidden_states)

        def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs):
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

    EPPluginTokenDispatcher.__qualname__ = "EPPluginTokenDispatcher"
    EPPluginTokenDispatcher.__module__ = __name__
    return EPPluginTokenDispatcher


class _LazyClass:
    """Resolves the dispatcher class on first use, so `import ep_plugin.megatron` works without
    megatron-core installed until a megatron feature is actually used."""

    _cls = None

    def get(self):
        if self._cls is None:
            type(self)._cls = _make_dispatcher_class()
        return self._cls


_lazy = _LazyClass()


def __getattr__(name):
    if name == "EPPluginTokenDispatcher":
        return _lazy.get()
    raise AttributeError(name)


# ------------------------------------------------------------------------------------- the hooks

_ORIG: Dict[str, Any] = {}
_BUILDING = threading.local()
_LOCK = threading.Lock()


def _uses_ep_plugin(config) -> Optional[str]:
    t = getattr(config, "moe_token_dispatcher_type", None)
    if t == NAME:
        return "name"
    if t == "flex" and getattr(config, "moe_flex_dispatcher_backend", None) == NAME:
        return "flex"
    return None


def _flex_factory(num_local_experts, local_expert_indices, config, pg_collection=None):
    if getattr(_BUILDING, "active", False) or _uses_ep_plugin(config):
        return _lazy.get()(num_local_experts, local_expert_indices, config=config,
                           pg_collection=pg_collection)
    return _ORIG["MoEFlexTokenDispatcher"](num_local_experts, local_expert_indices, config=config,
                                           pg_collection=pg_collection)


def _moe_layer_init(self, config, *args, **kwargs):
    if _uses_ep_plugin(config) != "name":
        return _ORIG["MoELayer.__init__"](self, config, *args, **kwargs)
    # MoELayer.__init__ chooses the dispatcher with an if/elif on the name: let it take the flex
    # branch (whose class is our factory) while _BUILDING is set, then restore the name.
    _BUILDING.active = True
    object.__setattr__(config, "moe_token_dispatcher_type", "flex")
    try:
        return _ORIG["MoELayer.__init__"](self, config, *args, **kwargs)
    finally:
        object.__setattr__(config, "moe_token_dispatcher_type", NAME)
        _BUILDING.active = False


def _config_post_init(self, *args, **kwargs):
    if getattr(self, "moe_token_dispatcher_type", None) != NAME:
        return _ORIG["TransformerConfig.__post_init__"](self, *args, **kwargs)
    # validate "ep_plugin" with alltoall's rules (same capabilities: dropless, overlaps)
    object.__setattr__(self, "moe_token_dispatcher_type", "alltoall")
    try:
        return _ORIG["TransformerConfig.__post_init__"](self, *args, **kwargs)
    finally:
        object.__setattr__(self, "moe_token_dispatcher_type", NAME)


def install() -> None:
    """Hook megatron-core so that moe_token_dispatcher_type="ep_plugin" and
    flex + moe_flex_dispatcher_backend="ep_plugin" build EPPluginTokenDispatcher. Idempotent;
    done on import of ep_plugin.megatron when megatron-core is importable."""
    with _LOCK:
        if _ORIG:
            return
        from megatron.core.transformer import transformer_config as tc_mod
        from megatron.core.transformer.moe import moe_layer as ml_mod

        _ORIG["MoELayer.__init__"] = ml_mod.MoELayer.__init__
        _ORIG["MoEFlexTokenDispatcher"] = ml_mod.MoEFlexTokenDispatcher
        _ORIG["TransformerConfig.__post_init__"] = tc_mod.TransformerConfig.__post_init__
        _moe_layer_init.__wrapped__ = _ORIG["MoELayer.__init__"]
        _config_post_init.__wrapped__ = _ORIG["TransformerConfig.__post_init__"]
        ml_mod.MoELayer.__init__ = _moe_layer_init
        ml_mod.MoEFlexTokenDispatcher = _flex_factory
        tc_mod.TransformerConfig.__post_init__ = _config_post_init


def uninstall() -> None:
    """Restore megatron-core's MoELayer.__init__, flex dispatcher class and config validation."""
    with _LOCK:
        if not _ORIG:
            return
        from megatron.core.transformer import transformer_config as tc_mod
        from megatron.core.transformer.moe import moe_layer as ml_mod

        ml_mod.MoELayer.__init__ = _ORIG["MoELayer.__init__"]
        ml_mod.MoEFlexTokenDispatcher = _ORIG["MoEFlexTokenDispatcher"]
        tc_mod.TransformerConfig.__post_init__ = _ORIG["TransformerConfig.__post_init__"]
        _ORIG.clear()


def is_installed() -> bool:
    return bool(_ORIG)


# ------------------------------------------------------------------ grouped-GEMM experts (no TE)

def _grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


class GroupedMMLinear(torch.nn.Module):
    """All local experts' weights of one linear in one [G, in, out] parameter, run with
    torch grouped_mm on GPU (a per-expert loop elsewhere). Builder-compatible with megatron's
    TEGroupedMLP linear_fc1 / linear_fc2 (forward(x, tokens_per_expert) -> (y, None))."""

    impl = None  # what ran last: "grouped_mm" / "_grouped_mm", or "loop"

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *, config,
                 init_method=None, bias: bool = False, skip_bias_add: bool = False,
                 is_expert: bool = True, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        if bias:
            raise ValueError("GroupedMMLinear has no bias (set add_bias_linear=False)")
        if pg_collection is not None and getattr(pg_collection, "expt_tp", None) is not None \
                and pg_collection.expt_tp.size() > 1:
            raise ValueError("GroupedMMLinear supports expert_tensor_parallel_size=1 only")
        dtype = config.params_dtype
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(num_local_experts, output_size, input_size,
                                                     dtype=dtype, device=device))
        init = init_method or torch.nn.init.xavier_normal_
        with torch.no_grad():
            for g in range(num_local_experts):
                init(self.weight[g])
        setattr(self.weight, "allreduce", False)  # expert parameter: not reduced over EP
        self.num_local_experts = num_local_experts

    def forward(self, x: torch.Tensor, tokens_per_expert):
        counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                                   else tokens_per_expert)]
        gmm = _grouped_mm()
        w = self.weight.to(x.dtype)
        if x.is_cuda and gmm is not None and x.dtype == torch.bfloat16 and GroupedMMLinear.impl != "loop":
            # grouped_mm wants int32 group ends (cumsum would promote to int64)
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            offs = offs.to(x.device, non_blocking=True)
            try:
                out = gmm(x, w.transpose(1, 2), offs=offs)
                GroupedMMLinear.impl = getattr(gmm, "__name__", "grouped_mm")
                return out, None
            except (RuntimeError, TypeError) as exc:  # e.g. a GPU without grouped-GEMM support
                warnings.warn(f"GroupedMMLinear: grouped_mm failed ({exc}); using a per-expert loop")
                GroupedMMLinear.impl = "loop"
        # unbind, not w[g]: indexing would give every expert a full-size weight gradient
        outs = [xi @ wg.t() for wg, xi in zip(w.unbind(0), torch.split(x, counts))]
        out = torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))
        return out, None

    def backward_dw(self):
        return None


def grouped_mm_experts():
    """Experts builder for MoESubmodules(experts=...): megatron's TEGroupedMLP (which runs without
    TransformerEngine on its non-fused path) with GroupedMMLinear for fc1/fc2."""
    from functools import partial

    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=GroupedMMLinear,
                                                                   linear_fc2=GroupedMMLinear))


# --------------------------------------------------------------------- CPU stand-ins for torch.cuda

_CPU_PATCHED: Dict[str, Any] = {}


class _CpuStream:
    def wait_stream(self, stream): pass
    def wait_event(self, event): pass
    def record_event(self, event=None): return _CpuEvent()
    def synchronize(self): pass
    def query(self): return True


class _CpuEvent:
    def __init__(self, *args, **kwargs): pass
    def record(self, stream=None): pass
    def wait(self, stream=None): pass
    def synchronize(self): pass
    def query(self): return True


_CPU_STREAM = _CpuStream()


def cpu_stand_ins(eager: bool = True) -> bool:
    """On a machine without CUDA, stand in for the few torch.cuda calls megatron-core makes on its
    MoE / GPT path (streams, events, current_device, the CUDA RNG tracker) with CPU no-ops, and let
    gloo's all_to_all_single take the tensor split sizes megatron passes. With `eager`, megatron's
    torch.compile'd helpers (the router's) run eagerly: compiling them costs ~30 s on a small CPU.
    Does nothing when CUDA is available. For examples and tests; True when the stand-ins are active."""
    if torch.cuda.is_available():
        return False
    if eager:
        import torch._dynamo as dynamo

        dynamo.config.disable = True
    if _CPU_PATCHED:
        return True
    import torch.distributed as dist

    c = torch.cuda
    for name in ("Stream", "Event", "current_stream", "stream", "synchronize", "current_device"):
        _CPU_PATCHED[name] = getattr(c, name)
    c.Stream = lambda *a, **k: _CpuStream()
    c.Event = _CpuEvent
    c.current_stream = lambda device=None: _CPU_STREAM
    c.stream = lambda stream=None: contextlib.nullcontext()
    c.synchronize = lambda device=None: None
    c.current_device = lambda: torch.device("cpu")

    orig_record = torch.Tensor.record_stream
    _CPU_PATCHED["Tensor.record_stream"] = orig_record

    def record_stream(self, stream):
        if isinstance(stream, _CpuStream) or not self.is_cuda:
            return None
        return orig_record(self, stream)

    torch.Tensor.record_stream = record_stream

    orig_a2a = dist.all_to_all_single
    _CPU_PATCHED["all_to_all_single"] = orig_a2a

    def _host(s):
        return s.tolist() if hasattr(s, "tolist") else s

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return orig_a2a(output, input, _host(output_split_sizes), _host(input_split_sizes),
                        group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single

    # megatron forks a "CUDA RNG state" around attention dropout: a CPU tracker with no states
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    tracker = _CpuRngTracker()
    _CPU_PATCHED["tensor_parallel.get_cuda_rng_tracker"] = tensor_parallel.get_cuda_rng_tracker
    _CPU_PATCHED["random.get_cuda_rng_tracker"] = tp_random.get_cuda_rng_tracker
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    return True


class _CpuRngTracker:
    def is_initialized(self): return True
    def reset(self): pass
    def get_states(self): return {}
    def set_states(self, states): pass
    def add(self, name, seed): pass

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def remove_cpu_stand_ins() -> None:
    import torch.distributed as dist

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    for name, fn in list(_CPU_PATCHED.items()):
        if name == "all_to_all_single":
            dist.all_to_all_single = fn
        elif name == "Tensor.record_stream":
            torch.Tensor.record_stream = fn
        elif name == "tensor_parallel.get_cuda_rng_tracker":
            tensor_parallel.get_cuda_rng_tracker = fn
        elif name == "random.get_cuda_rng_tracker":
            tp_random.get_cuda_rng_tracker = fn
        else:
            setattr(torch.cuda, name, fn)
    _CPU_PATCHED.clear()


# install on import when megatron-core is there
try:  # pragma: no branch
    import megatron.core  # noqa: F401
except ImportError:  # pragma: no cover
    warnings.warn("ep_plugin.megatron: megatron-core is not importable; hooks not installed")
else:
    install()
    EPPluginTokenDispatcher = _lazy.get()
