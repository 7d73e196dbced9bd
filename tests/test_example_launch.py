"""Launch mistakes with the examples: each ends with one line naming the fix (exit status 2, no
traceback), before torch, DeepSpeed or megatron gets to raise; a YAML's problems all at once."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "examples" / "megatron" / "pretrain_gpt_moe.py"
EXAMPLES = [MEGATRON, ROOT / "examples" / "train_moe.py", ROOT / "examples" / "deepspeed" / "train_moe_ds.py",
            ROOT / "examples" / "deepspeed" / "autoep_hf_moe.py"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **extra)
    return env


def _run(args, cwd=ROOT, **env):
    out = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=_env(**env), capture_output=True,
                         text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not _known_notice(ln)]
    return out, lines


def _known_notice(line):
    # notices the frameworks print at import on a machine without a GPU (not ep_plugin's lines)
    return ("real_accelerator.py" in line or "Setting accelerator to CPU" in line or "warnings.warn" in line
            or "UserWarning" in line)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_plain_python_is_told_to_use_torchrun(script):
    rel = script.relative_to(ROOT)
    out, lines = _run([rel])
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1, lines
    assert f"start it with torchrun --nproc-per-node 2 {rel}" in lines[0], lines


def test_megatron_example_names_the_world_sizes_that_work():
    # what torchrun --nproc-per-node 3 gives each process; refused before any process group exists
    out, lines = _run([MEGATRON], RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
    assert "moe.num_experts = 8 does not split over 3 processes" in lines[0]
    assert "start it with torchrun --nproc-per-node 2 (1, 4 or 8 work too for its 8 experts)" in lines[0]
    assert "gpt_moe_tiny.yaml" in lines[0]


def test_train_moe_names_the_world_sizes_that_work():
    out, lines = _run([EXAMPLES[1]], RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "does not split over 3 processes" in lines[0] and "--nproc-per-node 2" in lines[0]


def test_the_other_ranks_stay_quiet():
    out, lines = _run([MEGATRON], RANK="1", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert out.returncode == 2 and lines == [], out.stderr[-3000:]


def test_relative_config_from_another_directory():
    out, lines = _run([MEGATRON, "--config", "examples/megatron/gpt_moe_tiny.yaml"], cwd=ROOT / "examples")
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert f"resolved from the directory you start in, {ROOT / 'examples'}" in lines[0]
    assert "did you mean --config megatron/gpt_moe_tiny.yaml?" in lines[0]


def test_missing_config_with_no_guess_names_the_presets(tmp_path):
    out, lines = _run([EXAMPLES[1], "--config", "nothere/x.yaml"], cwd=tmp_path)
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "--config nothere/x.yaml: no such file" in lines[0] and "tiny" in lines[0]


def test_every_problem_of_the_example_yaml_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (MEGATRON.parent / "gpt_moe_tiny.yaml").read_text()
    text = text.replace("  steps: 200", "  step: 200").replace("  num_layers: 2", "  num_layer: 2")
    text = text.replace("  lr: 3.0e-3", "  lr: fast").replace("  backend: auto", "  backend: torc")
    text = text.replace("  topk: 2\n", "  topk: 2\n  topk: 2\n", 1)
    bad.write_text(text)
    out, lines = _run([MEGATRON.relative_to(ROOT), "--config", bad])
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert lines[0] == f"{MEGATRON.relative_to(ROOT)}: {bad}: 5 problems:", lines
    body = "\n".join(lines[1:])
    assert len(lines) == 6, lines
    for part in ("moe.topk: written twice (lines", "model.num_layer: unknown key (did you mean 'num_layers'?)",
                 "train.step: unknown key (did you mean 'steps'?)", "train.lr: wrong type, got 'fast'",
                 "comm.backend: not an allowed value (did you mean 'torch'?)"):
        assert part in body, (part, body)


def test_model_section_takes_transformer_config_fields(tmp_path):
    """Keys beyond the documented ones are megatron TransformerConfig fields; a misspelt one is named."""
    sys.path.insert(0, str(MEGATRON.parent))
    try:
        import pretrain_gpt_moe as ex
    finally:
        sys.path.remove(str(MEGATRON.parent))
    p = tmp_path / "m.yaml"
    p.write_text("model:\n  num_layers: 2\n  init_method_std: 0.01\n  add_bias_linaer: true\nmoe:\n  num_experts: 4\n")
    with pytest.raises(Exception) as ei:
        ex.load_yaml(str(p), {})
    assert f"{p}: model.add_bias_linaer: unknown key (did you mean 'add_bias_linear'?)" in str(ei.value)
    p.write_text("model:\n  num_layers: 2\n  init_method_std: 0.01\ntrain:\n  steps: 3\nmoe:\n  num_experts: 4\n")
    cfg, model, train = ex.load_yaml(str(p), {"comm.backend": "torch"})
    assert model == {"num_layers": 2, "init_method_std": 0.01} and train == {"steps": 3}
    assert cfg.source == str(p) and cfg.comm.backend == "torch"
