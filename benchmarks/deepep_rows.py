"""DeepEP V1 (v1.2.1) rows, timed with the same inputs and protocols as ep_plugin's.

Normal (intranode) kernels: `get_dispatch_layout`, `dispatch` (BF16, FP8 pair, cached with `handle=`)
and `combine`, on a `deep_ep.Buffer` sized by DeepEP's own config hints. Low-latency kernels (128
tokens per rank) on a second buffer in low-latency mode, over NVSHMEM's P2P transport on one host:
dispatch BF16 and FP8, combine BF16, and both halves of each with return_recv_hook=True, the calls
alternating dispatch, combine, ... as DeepEP requires (protocols.measure_low_latency, the same
function that times ep_plugin's low-latency calls).
`deep_ep` is optional: when it does not import or a part fails to set up, that part's ops are
recorded as failed with the reason ("n/a" in the table) and ep_plugin's rows are unaffected.
DeepEP's `dispatch` without a handle computes no layout itself, so the comparable figure for our
dispatch (which does) is "layout + dispatch"; the precomputed-layout figure is kept beside it.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from protocols import Protocols, _short, failed, ll_op_names, measure, measure_low_latency

NORMAL_OPS = ("deepep.layout", "deepep.dispatch_bf16", "deepep.dispatch_bf16_prelayout", "deepep.dispatch_fp8",
              "deepep.dispatch_cached", "deepep.combine_bf16")
LL_OPS = ll_op_names("deepep_ll")


def _agree(err: Optional[str]) -> Optional[str]:
    """Every rank's error, so all ranks take the same branch (DeepEP's set-up is collective)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, err)
    return next((f"rank {r}: {e}" for r, e in enumerate(every) if e), None)


class DeepEP:
    def __init__(self, hidden: int, num_experts: int, num_sms: int, enabled: bool = True):
        self.hidden, self.num_experts, self.num_sms = hidden, num_experts, num_sms
        self.world = dist.get_world_size()
        self.mod = None
        self.buf = self.ll = None
        self.error: Optional[str] = None      # why the normal kernels did not run
        self.ll_error: Optional[str] = None   # why the low-latency kernels did not run
        self.info: Dict = {}
        if not enabled:
            self.error = self.ll_error = "skipped (--no-deepep)"
            return
        err = None
        try:
            import deep_ep
            self.mod = deep_ep
            self.info["file"] = getattr(deep_ep, "__file__", None)
            self.info["version"] = getattr(deep_ep, "__version__", None)
        except Exception as exc:
            err = f"import deep_ep failed: {_short(exc)}"
        self.error = self.ll_error = _agree(err)

    # ------------------------------------------------------------------ normal kernels
    def setup_normal(self) -> None:
        if self.error:
            return
        err = None
        try:
            Buffer = self.mod.Buffer
            Buffer.set_num_sms(self.num_sms)  # the configs below capture the SM count
            self.dcfg = Buffer.get_dispatch_config(self.world)
            self.ccfg = Buffer.get_combine_config(self.world)
            row_bytes = self.hidden * 2  # BF16 rows bound the FP8 ones
            try:
                nvl = max(c.get_nvl_buffer_size_hint(row_bytes, self.world) for c in (self.dcfg, self.ccfg))
            except Exception:
                nvl = 1 << 30
            self.info["num_nvl_bytes"] = int(nvl)
            self.info["num_sms"] = int(Buffer.num_sms)
            self.buf = Buffer(dist.group.WORLD, int(nvl), 0, low_latency_mode=False, num_qps_per_rank=1,
                              explicitly_destroy=True)
        except Exception as exc:
            err = f"deep_ep.Buffer (intranode) set-up failed: {_short(exc)}"
        self.error = _agree(err)

    def normal_case(self, proto: Protocols, x, xf8, idx, w) -> Tuple[Dict, Dict]:
        """Ops and facts ({"recv_rows", "combine_ok", "recv_x"}) for one case; recv_x is this rank's
        BF16 received rows (for comparison with ours), dropped by the caller before reporting."""
        if self.error:
            return {k: failed(f"n/a: {self.error}") for k in NORMAL_OPS}, {"error": self.error}
        buf, E, dcfg, ccfg = self.buf, self.num_experts, self.dcfg, self.ccfg

        def layout():
            return buf.get_dispatch_layout(idx, E)

        def dispatch(rows, lay=None):
            per_rank, _, per_expert, in_rank, _ = lay if lay is not None else layout()
            return buf.dispatch(rows, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=dcfg)

        facts: Dict = {}
        err = None
        try:
            lay = layout()
            recv_x, _, _, _, handle, _ = dispatch(x, lay)
            y, _, _ = buf.combine(recv_x, handle, config=ccfg)
            reach = lay[3].sum(dim=1, keepdim=True).to(torch.float32)
            facts["recv_rows"] = int(recv_x.size(0))
            facts["combine_ok"] = bool(torch.allclose(y.float(), x.float() * reach, atol=3e-2, rtol=1e-2))
            facts["recv_x"] = recv_x
        except Exception as exc:
            err = f"DeepEP first dispatch/combine failed: {_short(exc)}"
        err = _agree(err)
        if err:
            return {k: failed(err) for k in NORMAL_OPS}, {"error": err}
        ops = {"deepep.layout": measure(proto, layout),
               "deepep.dispatch_bf16": measure(proto, lambda: dispatch(x)),
               "deepep.dispatch_bf16_prelayout": measure(proto, lambda: dispatch(x, lay)),
               "deepep.dispatch_fp8": measure(proto, lambda: dispatch(xf8))}
        recv_x, _, _, _, handle, _ = dispatch(x, lay)  # a fresh handle for the cached dispatch and combine
        ops["deepep.dispatch_cached"] = measure(proto, lambda: buf.dispatch(x, handle=handle, config=dcfg))
        ops["deepep.combine_bf16"] = measure(proto, lambda: buf.combine(recv_x, handle, config=ccfg))
        return ops, facts

    # ------------------------------------------------------------------ low-latency kernels
    def setup_low_latency(self, max_tokens: int) -> None:
        """A second buffer in low-latency mode (NVSHMEM); num_qps_per_rank = local experts, as DeepEP's
        low-latency kernels require."""
        if self.ll_error:
            return
        err = None
        try:
            Buffer = self.mod.Buffer
            nbytes = Buffer.get_low_latency_rdma_size_hint(max_tokens, self.hidden, self.world, self.num_experts)
            self.info["ll_num_rdma_bytes"] = int(nbytes)
            self.ll = Buffer(dist.group.WORLD, 0, int(nbytes), low_latency_mode=True,
                             num_qps_per_rank=self.num_experts // self.world, explicitly_destroy=True)
            self.ll_max_tokens = max_tokens
        except Exception as exc:
            err = f"deep_ep.Buffer (low-latency) set-up failed: {_short(exc)}"
        self.ll_error = _agree(err)

    def low_latency_case(self, proto: Protocols, x, idx, w) -> Tuple[Dict, Dict]:
        if self.ll_error:
            return {k: failed(f"n/a: {self.ll_error}") for k in LL_OPS}, {"error": self.ll_error}
        ll, E, T = self.ll, self.num_experts, self.ll_max_tokens

        def dispatch(use_fp8=False, hook=False):
            return ll.low_latency_dispatch(x, idx, T, E, use_fp8=use_fp8, return_recv_hook=hook)

        def combine(rows, handle, hook=False):
            return ll.low_latency_combine(rows, idx, w, handle, return_recv_hook=hook)

        facts: Dict = {}
        err = None
        try:
            recv, count, handle, _, _ = dispatch()
            # the expert output stands in as a copy: the call's own result tensor is reused by later calls
            expert_out = recv.clone()
            y, _, _ = combine(expert_out, handle)
            want = x.float() * w.masked_fill(idx < 0, 0).sum(dim=1, keepdim=True)
            facts["recv_copies"] = int(count.sum())
            facts["combine_ok"] = bool(torch.allclose(y.float(), want, atol=5e-2, rtol=2e-2))
        except Exception as exc:
            err = f"DeepEP low-latency first dispatch/combine failed: {_short(exc)}"
        err = _agree(err)
        if err:
            return {k: failed(err) for k in LL_OPS}, {"error": err}
        return measure_low_latency(proto, "deepep_ll", dispatch, combine, expert_out), facts

    def close(self) -> None:
        for b in (self.ll, self.buf):
            if b is not None:
                try:
                    b.destroy()
                except Exception:
                    pass
        self.ll = self.buf = None
