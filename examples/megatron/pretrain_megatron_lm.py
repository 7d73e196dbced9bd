#!/usr/bin/env python3
"""Pretrain a small GPT-MoE with Megatron-LM's own launcher and training loop (megatron.training),
selecting ep_plugin the way a Megatron-LM user selects a dispatcher: on the command line.

    torchrun --nproc-per-node 2 examples/megatron/pretrain_megatron_lm.py             # 2 GPUs, NCCL, BF16
    torchrun --nproc-per-node 2 examples/megatron/pretrain_megatron_lm.py \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ep_plugin      # the flex form
    torchrun --nproc-per-node 2 examples/megatron/pretrain_megatron_lm.py \\
        --moe-token-dispatcher-type alltoall                                          # megatron's own, to compare
    python3 examples/megatron/pretrain_megatron_lm.py --dry-run                       # CPU: arguments only

What ep_plugin adds to a Megatron-LM script is two lines (see main()):

    import ep_plugin.megatron as epm              # the hooks: "ep_plugin" becomes a valid choice
    args = parse_and_validate_args(extra_args_provider=epm.add_ep_plugin_args)   # --ep-plugin-config

and then the usual Megatron-LM flags: `--moe-token-dispatcher-type ep_plugin --ep-plugin-config
examples/megatron/gpt_moe_gpu.yaml`. The rest is Megatron-LM's pretrain_gpt.py cut down to mock data
(megatron-core's MockGPTDataset, --mock-data, NullTokenizer): `pretrain()` builds the model from
the arguments (gpt_config_from_args), runs megatron's optimizer, schedules and logging, and prints
its usual `iteration ... | lm loss: ...` lines.

DEFAULT_ARGS below are the model: 4 layers, hidden 1024, 32 experts top-4 with the group-limited
sigmoid routing and expert bias of gpt_moe_gpu.yaml (whose moe section they repeat: megatron's
arguments define the routing; the YAML's comm section configures the EPBuffer), one shared expert,
TP = PP = 1, EP = world size, 20 iterations of 4 x 1024 tokens per rank. Any Megatron-LM argument
given on the command line comes after them and wins (e.g. --train-iters 50).

GPUs only: megatron.training's pretrain() asserts CUDA (initialize_megatron: "Megatron requires
CUDA") and allocates its own bookkeeping tensors on 'cuda'. On CPU, --dry-run parses and validates
the arguments and builds the TransformerConfig (what tests/test_megatron_training.py checks);
examples/megatron/pretrain_gpt_moe.py trains on CPU with megatron-core alone.

Checked against megatron-core 0.19.2 (megatron/training as in Megatron-LM's core_v0.19.0).
"""
from __future__ import annotations

import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = "pretrain_megatron_lm.py"

DEFAULT_ARGS = [
    # model: GPT with RMSNorm, SwiGLU, RoPE, no biases; megatron's local (no TransformerEngine) layers
    "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "4096",
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.02",
    "--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    # MoE: the routing of gpt_moe_gpu.yaml's moe section, one shared expert, EP over all ranks
    "--num-experts", "32", "--moe-router-topk", "4", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32",
    "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.0",
    "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "512", "--moe-shared-expert-overlap",
    # the dispatcher, as a Megatron-LM user selects it
    "--moe-token-dispatcher-type", "ep_plugin",
    "--ep-plugin-config", os.path.join(HERE, "gpt_moe_gpu.yaml"),
    # training: 4 x 1024 tokens per rank and step (= comm.max_tokens_per_rank of gpt_moe_gpu.yaml)
    "--micro-batch-size", "4", "--train-iters", "20", "--bf16",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
    "--weight-decay", "0.0", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", "1234",
    # data: megatron-core's mock GPT dataset, no tokenizer files
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--num-workers", "0",
    # logging / evaluation
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000", "--no-one-logger",
]


def _say(msg: str) -> None:
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0:
        print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str, code: int = 2) -> None:
    """One line (from the first rank of each node) instead of a traceback per rank."""
    _say(msg)
    sys.exit(code)


# pip names of modules that megatron.training / megatron.core import, where they differ
_PIP = {"yaml": "pyyaml", "google": "protobuf", "sklearn": "scikit-learn"}


def import_megatron_training():
    """Import what this example uses from megatron.training; a missing package is one line."""
    import typing

    if not hasattr(typing, "override"):  # megatron.training imports typing.override (Python >= 3.12)
        try:
            import typing_extensions
        except ImportError:
            _fail(f"Python {sys.version_info.major}.{sys.version_info.minor}: megatron.training needs "
                  "typing.override (Python >= 3.12) or the package typing_extensions")
        typing.override = typing_extensions.override  # example-only stand-in on Python < 3.12
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex|Apex) (are|is) not installed",
                            category=UserWarning)
    warnings.filterwarnings("ignore", message=r"absl\.logging is not installed", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"Only transformer-engine>=", category=UserWarning)
    try:
        import megatron.training  # noqa: F401
        from megatron.training import training as _training  # noqa: F401
        from megatron.core.datasets.gpt_dataset import MockGPTDataset  # noqa: F401

        import ep_plugin.megatron  # noqa: F401  (the hooks; needs megatron-core, imported above)
    except ModuleNotFoundError as exc:
        _fail(_missing(exc))
    except ImportError as exc:
        _fail(f"megatron.training cannot be imported: {exc}")


def _missing(exc: ModuleNotFoundError, where: str = "while importing megatron.training") -> str:
    name = (exc.name or str(exc)).split(".")[0]
    if name == "megatron":
        return (f"cannot import {exc.name}: megatron-core (with its megatron/training package) is not on "
                "the Python path")
    pip = _PIP.get(name, name)
    return f"missing package '{pip}' ({exc}, {where}); pip install {pip}"


def use_prebuilt_dataset_helpers() -> None:
    """pretrain() runs `make` in megatron/core/datasets to build helpers_cpp; a megatron-core wheel has
    them built and ships no Makefile (make would fail and pretrain exit). Skip it when they import."""
    from megatron.core.datasets import utils as ds_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        if not os.path.exists(os.path.join(os.path.dirname(ds_utils.__file__), "Makefile")):
            _fail("megatron.core.datasets.helpers_cpp is not built for this Python and this megatron-core "
                  "has no Makefile to build it: install a megatron-core wheel for this Python")
        return  # a source checkout: let megatron compile them
    ds_utils.compile_helpers = lambda: None


# ----------------------------------------------------------------------------------------- data

def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-core's MockGPTDataset with --mock-data, else GPTDataset on --data-path."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its datasets (TP = 1)


def get_batch(data_iterator):
    """One micro-batch on this rank's GPU (TP = 1: no broadcast; on CPU, for the tests, as it is)."""
    import torch

    batch = next(data_iterator)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def get(key):
        t = batch.get(key)
        return t.to(dev, non_blocking=True) if t is not None and dev is not None else t

    return get("tokens"), get("labels"), get("loss_mask"), get("attention_mask"), get("position_ids")


# ------------------------------------------------------------------------------------ the step

_REPORTED = []


def report_dispatchers(model) -> None:
    """Once, on rank 0, after the first forward: which dispatcher the MoE layers use, and for
    ep_plugin the EPBuffer's backend and the attached config."""
    import torch

    if _REPORTED:
        return
    _REPORTED.append(True)
    if torch.distributed.get_rank() != 0:
        return
    mods = model if isinstance(model, (list, tuple)) else [model]
    disps = [m.token_dispatcher for mm in mods for m in mm.modules() if hasattr(m, "token_dispatcher")]
    if not disps:
        print("dispatcher: no MoE layers found", flush=True)
        return
    d = disps[0]
    cfg = d.config
    kind = cfg.moe_token_dispatcher_type + (f"/{cfg.moe_flex_dispatcher_backend}"
                                            if cfg.moe_token_dispatcher_type == "flex" else "")
    line = f"dispatcher: {len(disps)} MoE layers, moe_token_dispatcher_type={kind} ({type(d).__name__})"
    ep = getattr(cfg, "ep_plugin_config", None)
    if type(d).__name__ == "EPPluginTokenDispatcher":
        buf = getattr(d, "buffer", None)
        cap = getattr(getattr(buf, "cfg", None), "comm", None)
        line += (f", EPBuffer backend {getattr(buf, 'backend_name', '?')}, config "
                 f"{getattr(ep, 'source', None) or 'ep_plugin defaults (no --ep-plugin-config)'}, "
                 f"comm.max_tokens_per_rank {getattr(cap, 'max_tokens_per_rank', '?')}")
    print(line, flush=True)


def loss_func(loss_mask, model, output_tensor):
    import torch

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report_dispatchers(model)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from functools import partial

    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    if return_schedule_plan:  # --overlap-moe-expert-parallel-comm (combined 1F1B)
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask, model)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, model)


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    user = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in user
    user = [a for a in user if a != "--dry-run"]
    # megatron.training parses sys.argv (and parses it again inside pretrain()): put the defaults there,
    # with expert parallelism over all ranks
    ep = ["--expert-model-parallel-size", os.environ.get("WORLD_SIZE", "1")]
    sys.argv = [sys.argv[0]] + DEFAULT_ARGS + ep + user

    import_megatron_training()
    import torch

    if not dry_run and not torch.cuda.is_available():
        _fail("needs CUDA GPUs: megatron.training's pretrain() requires CUDA (use --dry-run to check the "
              "arguments on CPU, or examples/megatron/pretrain_gpt_moe.py to train on CPU)")
    if not dry_run:
        from ep_plugin.testing.launch import require_torchrun

        require_torchrun()  # plain python: one line naming torchrun, not torch's "RANK expected"

    import ep_plugin.megatron as epm  # 1. the hooks: megatron.training's parser now takes "ep_plugin"
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    # 2. --ep-plugin-config; parse_and_validate_args also sets megatron's global args, from which
    #    the TransformerConfig built below gets its ep_plugin config attached
    args = parse_and_validate_args(extra_args_provider=epm.add_ep_plugin_args)
    parallel = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size)
    if parallel != (1, 1, 1):
        _fail("this example runs TP = PP = CP = 1 (expert parallelism over all ranks)")
    model_cfg = gpt_config_from_args(args)
    tc = model_cfg.transformer  # the TransformerConfig pretrain() builds the model from
    if args.rank == 0:
        kind = tc.moe_token_dispatcher_type
        if kind == "flex":
            kind += "/" + tc.moe_flex_dispatcher_backend
        ep = getattr(tc, "ep_plugin_config", None)
        attached = (f"{ep.source} (comm.backend {ep.comm.backend}, max_tokens_per_rank "
                    f"{ep.comm.max_tokens_per_rank})" if ep is not None else None)
        print(f"{PROG}: TransformerConfig moe_token_dispatcher_type={kind}, {tc.num_moe_experts} experts "
              f"top-{tc.moe_router_topk}, EP {tc.expert_model_parallel_size}, ep_plugin config: {attached}",
              flush=True)
    if dry_run:
        return 0

    use_prebuilt_dataset_helpers()
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    t0 = time.time()
    try:
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    except ModuleNotFoundError as exc:  # an import inside megatron's loop (a feature's package)
        _fail(_missing(exc, "in megatron.training's pretrain()"))
    if torch.distributed.get_rank() == 0:
        print(f"{PROG}: done: {args.train_iters} iterations in {time.time() - t0:.1f} s "
              f"(dispatcher {tc.moe_token_dispatcher_type})", flush=True)
    epm.clear_buffers()  # on every rank, before the process group goes
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
