"""scripts/setup.sh's modes and the triton stand-in that --light relies on (megatron-core imports triton
on its way to GPTModel; a CPU venv has none)."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = ROOT / "ep_plugin" / "testing" / "megatron_without_triton.py"

# What the .pth line does in a --light venv, with triton made unimportable (it may be installed here).
_NO_TRITON = textwrap.dedent(f"""
    import importlib.abc, importlib.util, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {{name!r}}")
    sys.meta_path.insert(0, _Block())
    spec = importlib.util.spec_from_file_location("_ep_plugin_megatron_without_triton", {str(STAND_IN)!r})
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
""")


def _python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_megatron_gpt_imports_without_triton():
    out = _python(_NO_TRITON + textwrap.dedent("""
        from megatron.core.models.gpt import GPTModel  # gpt_model -> moe/paged_stash -> ops/paged_stash
        from megatron.core.transformer.moe.ops import paged_stash as ps
        assert ps.EP_PLUGIN_STAND_IN and ps.GLOBAL_BLOCK_SIZE == 1024
        try:
            ps.paged_stash_copy_kernel[(1,)](0)
        except RuntimeError as exc:
            print("refused:", exc)
        import torch.utils._triton as tt
        print("has_triton_package", tt.has_triton_package())
    """))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: megatron-core's paged_stash_copy_kernel" in out.stdout and "pip install triton" in out.stdout
    assert "has_triton_package False" in out.stdout  # torch is not told there is a triton


def test_stand_in_steps_aside_when_triton_is_installed():
    code = textwrap.dedent(f"""
        import importlib.util, sys, types
        sys.modules["triton"] = types.ModuleType("triton"); sys.modules["triton"].__spec__ = importlib.util.spec_from_loader("triton", loader=None)
        spec = importlib.util.spec_from_file_location("s", {str(STAND_IN)!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        print(mod._Finder().find_spec(mod.TARGET) is None, mod._Finder().find_spec("json") is None)
    """)
    out = _python(code)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_setup_sh_usage():
    out = subprocess.run(["bash", "scripts/setup.sh", "--lite"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "usage: bash scripts/setup.sh [--light]" in out.stderr
    out = subprocess.run(["bash", "scripts/setup.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--light" in out.stdout and "no triton" in out.stdout
    assert subprocess.run(["bash", "-n", "scripts/setup.sh"]).returncode == 0


def test_compile_progress_lines(capsys):
    sys.path.insert(0, str(ROOT))
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_ep_setup", ROOT / "setup.py")
        src = (ROOT / "setup.py").read_text().split("\ncuda_home = want_c_build()")[0]  # the definitions only
        ns = {"__name__": "_ep_setup", "__file__": str(ROOT / "setup.py")}
        exec(compile(src, str(ROOT / "setup.py"), "exec"), ns)
    finally:
        sys.path.remove(str(ROOT))
    Progress = ns["Progress"]
    Progress.QUIET_S = 0.2
    with Progress(2) as p:
        p.run("nvlink/a.cu", lambda: None)
        p.start("nvshmem/b.cu")
        import time

        time.sleep(1.5)
        p.finish("nvshmem/b.cu")
    out = capsys.readouterr().out
    assert "ep_plugin: _C [ 1/2] nvlink/a.cu" in out and "ep_plugin: _C [ 2/2] nvshmem/b.cu" in out
    assert "ep_plugin: _C still compiling nvshmem/b.cu" in out and "ep_plugin: _C built in" in out


def test_compile_link_step_passes_keywords(capsys):
    """build_ext calls link_shared_object with keywords: the progress wrapper passes them on."""
    ns = _setup_namespace()
    p = ns["Progress"](1)
    assert p.run("link", lambda *a, **k: (a, k), 1, libraries=["x"]) == ((1,), {"libraries": ["x"]})


def test_unchanged_cuda_objects_are_kept(tmp_path, capsys):
    ns = _setup_namespace()
    src = next(ns["CSRC"].rglob("*.cu"))
    obj = tmp_path / "a.o"
    cmd = ["true", "-c", str(src), "-o", str(obj)]
    calls = []
    ns["subprocess"].check_call, real = (lambda c: calls.append(c) or obj.write_text("o")), ns["subprocess"].check_call
    try:
        p = ns["Progress"](3)
        name = str(src.relative_to(ns["CSRC"]))
        ns["compile_cuda"](p, name, cmd)          # built
        ns["compile_cuda"](p, name, cmd)          # same command, inputs older: kept
        ns["compile_cuda"](p, name, cmd + ["-O0"])  # another command: built again
    finally:
        ns["subprocess"].check_call = real
    assert len(calls) == 2
    assert "(unchanged: kept)" in capsys.readouterr().out


def _setup_namespace():
    src = (ROOT / "setup.py").read_text().split("\ncuda_home = want_c_build()")[0]  # the definitions only
    ns = {"__name__": "_ep_setup", "__file__": str(ROOT / "setup.py")}
    exec(compile(src, str(ROOT / "setup.py"), "exec"), ns)
    return ns
