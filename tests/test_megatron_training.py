"""Megatron-LM's launch path (ep_plugin/integrations/megatron/training.py) on CPU.

megatron.training's own parser accepts `--moe-token-dispatcher-type ep_plugin` (and flex with
`--moe-flex-dispatcher-backend ep_plugin`) and `--ep-plugin-config YAML`, and the TransformerConfig it
builds from those args carries the ep_plugin config; mistakes are argparse errors naming the option;
uninstall() restores megatron's own refusal. Then examples/megatron/pretrain_megatron_lm.py: its
default (GPU) arguments pass megatron's validation (--dry-run), and its data, model and step run
through megatron.training's model builder on 2 gloo ranks, giving the same losses as megatron's
alltoall dispatcher. pretrain() itself needs CUDA (it asserts it and allocates on 'cuda'), so its
loop runs only on GPUs (scripts/gpu_megatron_lm.sh).

Everything runs in one spawn of 2 processes (importing megatron.training takes ~10 s per process);
the tests then check its results. megatron.training imports typing.override (Python >= 3.12): on
older Pythons the processes stand in typing_extensions.override (tests only).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback

import pytest

from tests._need import installed, need_installed

need_installed("megatron.core")
if not installed("megatron.training"):
    pytest.skip("megatron.training is not installed", allow_module_level=True)

from tests._dist import read_rank_results, spawn, write_rank_result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_DIR = os.path.join(ROOT, "examples", "megatron")
TINY = os.path.join(EXAMPLE_DIR, "gpt_moe_tiny.yaml")  # ep_plugin sections + the example's model/train
STEPS = 3

# a tiny GPT-MoE in Megatron-LM arguments (CPU-sized; EP = 2 = the spawn's world size)
SMALL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "4",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--transformer-impl", "local",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
    "--moe-shared-expert-intermediate-size", "64", "--moe-router-dtype", "fp32",
    "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.0",
    "--expert-model-parallel-size", "2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-workers", "0",
    "--train-iters", str(STEPS), "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
    "--no-one-logger", "--lr", "1e-3",
]


def _stand_in_override():
    import typing

    if not hasattr(typing, "override"):  # Python < 3.12 (tests only; the library never does this)
        import typing_extensions

        typing.override = typing_extensions.override


@contextlib.contextmanager
def _argv(argv):
    saved = sys.argv
    sys.argv = ["pretrain.py"] + list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def _parse(argv, provider=True, validate=True):
    """megatron.training's parser on a list argv: {"args": Namespace} or {"exit": code, "stderr": text}.
    Global args set by parse_and_validate_args stay set (the caller unsets them)."""
    import ep_plugin.megatron as epm
    from megatron.training import arguments

    err, out = io.StringIO(), io.StringIO()
    extra = epm.add_ep_plugin_args if provider else None
    try:
        with _argv(argv), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if validate:
                args = arguments.parse_and_validate_args(extra_args_provider=extra)
            else:
                args = arguments.parse_args(extra_args_provider=extra, ignore_unknown_args=False)
    except SystemExit as exc:
        return {"exit": exc.code, "stderr": err.getvalue()}
    return {"args": args}


def _unset():
    from megatron.training import global_vars

    global_vars.unset_global_variables()


def _config_summary(args):
    from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args

    tc = core_transformer_config_from_args(args)
    gpt = gpt_config_from_args(args).transformer  # what pretrain_gpt.py hands to pretrain()
    ep = getattr(tc, "ep_plugin_config", None)
    gep = getattr(gpt, "ep_plugin_config", None)
    return {
        "arg_type": args.moe_token_dispatcher_type, "arg_backend": args.moe_flex_dispatcher_backend,
        "arg_config": args.ep_plugin_config,
        "type": tc.moe_token_dispatcher_type, "backend": tc.moe_flex_dispatcher_backend,
        "source": getattr(ep, "source", None), "capacity": ep.comm.max_tokens_per_rank if ep else None,
        "comm_backend": ep.comm.backend if ep else None,
        "gpt_source": getattr(gep, "source", None),
    }


def _run(results, name, fn):
    try:
        results[name] = fn()
    except Exception:  # reported per case by the tests
        results[name] = {"error": traceback.format_exc()}
    finally:
        _unset()


def _argument_cases(out_dir):
    import typing

    import ep_plugin.megatron as epm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import ft_integration, global_vars

    res = {}

    def name_form():
        p = _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config", TINY])
        return p if "exit" in p else _config_summary(p["args"])

    def flex_form():
        p = _parse(SMALL + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "ep_plugin",
                            "--ep-plugin-config", "tiny"])  # a preset name
        return p if "exit" in p else _config_summary(p["args"])

    def no_config():
        p = _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugin"])
        return p if "exit" in p else _config_summary(p["args"])

    def alltoall_with_config():
        p = _parse(SMALL + ["--moe-token-dispatcher-type", "alltoall", "--ep-plugin-config", TINY])
        return p if "exit" in p else _config_summary(p["args"])

    def reparse_inside_pretrain():
        # pretrain() parses sys.argv again with megatron's bare parser (no extra_args_provider)
        with _argv(SMALL + ["--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config", TINY]):
            ft_integration.setup()
        return {"ok": True}

    def typo():
        return _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugn"], validate=False)

    def typo_backend():
        return _parse(SMALL + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "ep-plugin"],
                      validate=False)

    def missing_yaml():
        return _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config",
                               os.path.join(out_dir, "no_such_dir", "ep.yaml")], validate=False)

    def bad_yaml():
        path = os.path.join(out_dir, "bad_ep.yaml")
        with open(path, "w") as f:
            f.write("comm:\n  backend: torch\n  max_token_per_rank: 64\n")
        return _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config", path],
                      validate=False)

    def backend_without_flex():
        p = _parse(SMALL + ["--moe-token-dispatcher-type", "alltoall", "--moe-flex-dispatcher-backend", "ep_plugin"])
        if "exit" in p:
            return p
        try:
            _config_summary(p["args"])
        except ValueError as exc:
            return {"raised": str(exc)}
        return {"raised": None}

    def yaml_cfg_global_args():
        # --yaml-cfg: megatron's global args are the YAML's namespace; its ep_plugin_config key is used
        from types import SimpleNamespace

        global_vars.set_args(SimpleNamespace(ep_plugin_config=TINY))
        tc = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                               moe_router_topk=2, moe_token_dispatcher_type="ep_plugin")
        plain = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                                  moe_router_topk=2, moe_token_dispatcher_type="alltoall")
        return {"source": tc.ep_plugin_config.source, "plain": hasattr(plain, "ep_plugin_config")}

    def uninstalled():
        field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
        installed_choices = list(typing.get_args(field.type))
        epm.uninstall()
        try:
            refused = _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugin"], validate=False)
            refused_flex = _parse(SMALL + ["--moe-token-dispatcher-type", "flex",
                                           "--moe-flex-dispatcher-backend", "ep_plugin"], validate=False)
            bare_choices = list(typing.get_args(field.type))
        finally:
            epm.install()
        again = _parse(SMALL + ["--moe-token-dispatcher-type", "ep_plugin"], validate=False)
        return {"installed_choices": installed_choices, "bare_choices": bare_choices, "refused": refused,
                "refused_flex": refused_flex, "again": "args" in again}

    def example_dry_run():
        sys.path.insert(0, EXAMPLE_DIR)
        import pretrain_megatron_lm as ex

        out = io.StringIO()
        saved = sys.argv
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                rc = ex.main(["--dry-run"])
        finally:
            sys.argv = saved
        line = [ln for ln in out.getvalue().splitlines() if ln.startswith("pretrain_megatron_lm.py:")]
        return {"rc": rc, "line": line[-1] if line else None}

    for name, fn in [("name", name_form), ("flex", flex_form), ("no_config", no_config),
                     ("alltoall_with_config", alltoall_with_config), ("reparse", reparse_inside_pretrain),
                     ("typo", typo), ("typo_backend", typo_backend), ("missing_yaml", missing_yaml),
                     ("bad_yaml", bad_yaml), ("backend_without_flex", backend_without_flex),
                     ("yaml_cfg", yaml_cfg_global_args), ("uninstall", uninstalled),
                     ("example_dry_run", example_dry_run)]:
        _run(res, name, fn)
    return res


def _train(args_extra, batches=None):
    """The example's data, model and step through megatron.training's builder (no pretrain(): its
    loop needs CUDA). Returns losses, the dispatcher found and the batches used."""
    import torch

    import pretrain_megatron_lm as ex
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import training as T
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    p = _parse(SMALL + args_extra)
    if "exit" in p:
        raise RuntimeError(p["stderr"])
    args = p["args"]
    model_cfg = gpt_config_from_args(args)
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    if batches is None:  # the example's dataset provider (MockGPTDataset)
        train_ds, _, _ = T.build_train_valid_test_datasets(ex.train_valid_test_datasets_provider)
        it = iter(build_pretraining_data_loader(train_ds, 0))
        batches = [next(it) for _ in range(STEPS)]
    torch.manual_seed(args.seed)
    builder = model_cfg.get_builder_cls()(model_cfg)
    model = builder.build_distributed_models(pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                                             ddp_config=cfg.ddp, wrap_with_ddp=False)
    opt = torch.optim.AdamW([q for m in model for q in m.parameters()], lr=args.lr)
    ex._REPORTED.clear()
    losses = []
    for b in batches:
        opt.zero_grad()
        out, loss_fn = ex.forward_step(iter([b]), model[0])
        loss, ntok, report = loss_fn(out)
        (loss / ntok).backward()
        for q in model[0].parameters():  # data-parallel mean of the dense gradients
            if q.grad is not None and getattr(q, "allreduce", True):
                torch.distributed.all_reduce(q.grad)
                q.grad /= torch.distributed.get_world_size()
        opt.step()
        total = report["lm loss"].clone()
        torch.distributed.all_reduce(total)
        losses.append((total[0] / total[1]).item())
    disp = [m.token_dispatcher for m in model[0].modules() if hasattr(m, "token_dispatcher")][0]
    ep = getattr(disp.config, "ep_plugin_config", None)
    info = {"losses": losses, "dispatcher": type(disp).__name__,
            "backend": getattr(getattr(disp, "buffer", None), "backend_name", None),
            "source": getattr(ep, "source", None)}
    _unset()
    return info, batches


def _pieces(rank, world):
    import torch

    import ep_plugin.megatron as epm
    from ep_plugin.testing import cpu_stand_ins
    from megatron.core import parallel_state as ps

    sys.path.insert(0, EXAMPLE_DIR)
    # the CPU stand-ins replace torch.cuda.Stream, which a module the tokenizer imports evaluates at
    # import time: build the tokenizer once before them
    _parse(SMALL)
    _unset()
    cpu_stand_ins()
    torch.set_num_threads(1)
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        ep, batches = _train(["--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config", TINY])
        a2a, _ = _train(["--moe-token-dispatcher-type", "alltoall"], batches)
        return {"ep_plugin": ep, "alltoall": a2a}
    finally:
        epm.clear_buffers()
        ps.destroy_model_parallel()


def _dist_body(rank, world, out_dir):
    _stand_in_override()
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    import megatron.training  # noqa: F401  (before the CPU stand-ins)

    res = {}
    if rank == 0:
        res["cases"] = _argument_cases(out_dir)
    try:
        res["pieces"] = _pieces(rank, world)
    except Exception:
        res["pieces"] = {"error": traceback.format_exc()}
    write_rank_result(out_dir, rank, res)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron_training")
    spawn(_dist_body, 2, str(d), timeout=240)
    return read_rank_results(d, 2)


def _case(results, name):
    res = results[0]["cases"][name]
    assert "error" not in res, res.get("error")
    return res


def test_name_form_reaches_transformer_config(results):
    r = _case(results, "name")
    assert "exit" not in r, r.get("stderr")
    assert r["arg_type"] == r["type"] == "ep_plugin"
    assert r["arg_config"] == TINY  # made absolute
    # the YAML (with the example's model/train sections skipped) is attached, to both configs
    assert r["source"] == r["gpt_source"] == TINY
    assert r["capacity"] == 1024 and r["comm_backend"] == "auto"


def test_flex_form_with_a_preset(results):
    r = _case(results, "flex")
    assert "exit" not in r, r.get("stderr")
    assert (r["type"], r["backend"]) == ("flex", "ep_plugin")
    assert r["source"].endswith("tiny.yaml") and r["capacity"] == 256 and r["comm_backend"] == "torch"


def test_nothing_attached_without_option_or_ep_plugin(results):
    r = _case(results, "no_config")
    assert r["type"] == "ep_plugin" and r["source"] is None and r["arg_config"] is None
    r = _case(results, "alltoall_with_config")
    assert r["type"] == "alltoall" and r["source"] is None


def test_pretrains_own_reparse_accepts_ep_plugin(results):
    assert _case(results, "reparse") == {"ok": True}


def test_typo_in_dispatcher_name(results):
    r = _case(results, "typo")
    assert r.get("exit") == 2
    assert "argument --moe-token-dispatcher-type: invalid choice: 'ep_plugn'" in r["stderr"]
    assert "'ep_plugin'" in r["stderr"]  # listed among the choices
    r = _case(results, "typo_backend")
    assert r.get("exit") == 2 and "argument --moe-flex-dispatcher-backend: invalid choice: 'ep-plugin'" in r["stderr"]


def test_bad_config_path_or_yaml(results):
    r = _case(results, "missing_yaml")
    assert r.get("exit") == 2
    assert "argument --ep-plugin-config:" in r["stderr"] and "config file not found" in r["stderr"]
    r = _case(results, "bad_yaml")
    assert r.get("exit") == 2
    assert "argument --ep-plugin-config:" in r["stderr"] and "max_token_per_rank" in r["stderr"]


def test_flex_backend_needs_flex_dispatcher(results):
    r = _case(results, "backend_without_flex")
    assert r["raised"] and "requires moe_token_dispatcher_type='flex'" in r["raised"]


def test_yaml_cfg_global_args_attach(results):
    r = _case(results, "yaml_cfg")
    assert r == {"source": TINY, "plain": False}


def test_uninstall_restores_megatrons_refusal(results):
    r = _case(results, "uninstall")
    assert r["installed_choices"] == ["allgather", "alltoall", "flex", "ep_plugin"]
    assert r["bare_choices"] == ["allgather", "alltoall", "flex"]
    assert r["refused"]["exit"] == 2
    assert "invalid choice: 'ep_plugin' (choose from 'allgather', 'alltoall', 'flex')" in r["refused"]["stderr"]
    assert r["refused_flex"]["exit"] == 2 and "--moe-flex-dispatcher-backend" in r["refused_flex"]["stderr"]
    assert r["again"]  # install() puts it back


def test_example_default_arguments_validate(results):
    r = _case(results, "example_dry_run")
    assert r["rc"] == 0
    assert "moe_token_dispatcher_type=ep_plugin" in r["line"] and "EP 2" in r["line"]
    assert "gpt_moe_gpu.yaml" in r["line"] and "max_tokens_per_rank 4096" in r["line"]


def test_example_step_matches_alltoall(results):
    for rank, res in enumerate(results):
        p = res["pieces"]
        assert "error" not in p, f"rank {rank}: {p.get('error')}"
        ep, a2a = p["ep_plugin"], p["alltoall"]
        assert ep["dispatcher"] == "EPPluginTokenDispatcher" and ep["backend"] == "torch"
        assert ep["source"] == TINY
        assert a2a["dispatcher"] == "MoEAlltoAllTokenDispatcher"
        assert len(ep["losses"]) == STEPS
        assert ep["losses"] == pytest.approx(a2a["losses"], rel=1e-5, abs=1e-5)
        assert ep["losses"][-1] < ep["losses"][0]
