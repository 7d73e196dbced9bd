import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from tests._parallel import pytest_cmdline_main, pytest_xdist_make_scheduler  # noqa: F401  (two xdist workers on a CPU box, the long files first)


def pytest_report_header(config):
    import ep_plugin._ext as ext
    c = f"built (CUDA runtime {ext.get_c().cuda_runtime_version()})" if ext.has_c() else "not built"
    return [f"ep_plugin._C: {c}; torch {torch.__version__}; CUDA GPUs: {torch.cuda.device_count()}; "
            f"nvcc: {shutil.which('nvcc') or 'absent'}"]


@pytest.fixture(scope="module")
def solo():
    """A one-rank gloo group in this process (for calls whose checks never reach a collective)."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- "terminate called" guard
# A process that aborts at exit ("terminate called without an active exception": a C++ thread, e.g.
# gloo's, still alive while the interpreter shuts down) fails the test that started it, even where the
# test's own checks passed or the abort happened after the result was read. Seen in the output pytest
# captures (spawned ranks write to the test's file descriptors) and in what subprocess.run captured.
TERMINATE = "terminate called"
_seen_in_subprocess = []
_run = subprocess.run


def note_output(cmd, *outs):
    for out in outs:
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        if isinstance(out, str) and TERMINATE in out:
            line = next(x for x in out.splitlines() if TERMINATE in x)
            _seen_in_subprocess.append(f"{cmd!r}: {line.strip()}")


def _guarded_run(*args, **kwargs):
    proc = _run(*args, **kwargs)
    note_output(args[0] if args else kwargs.get("args"), proc.stdout, proc.stderr)
    return proc


subprocess.run = _guarded_run


def terminate_lines(text: str) -> list:
    return [line.strip() for line in text.splitlines() if TERMINATE in line]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    found = list(_seen_in_subprocess)
    _seen_in_subprocess.clear()
    for title, text in report.sections:  # this phase's own output (capstderr joins every phase so far)
        if title.startswith("Captured std") and title.endswith(f" {report.when}"):
            found += terminate_lines(text)
    if found and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = (f"a process of this test aborted ({TERMINATE!r} in its output) during {report.when}: "
                           + "; ".join(found[:5]))
