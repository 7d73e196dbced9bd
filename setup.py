"""Build ep_plugin, compiling csrc/ into ep_plugin._C when nvcc is available.

EP_PLUGIN_BUILD_C=1 forces the compiled module (fails without nvcc), =0 skips it, unset builds it
whenever nvcc is found. The module takes device pointers and streams as integers and links the
CUDA runtime statically, so it neither links libtorch nor depends on the torch version.
"""
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def find_cuda_home():
    nvcc = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return Path(home)
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    return None


def want_c_build():
    flag = os.environ.get("EP_PLUGIN_BUILD_C", "").strip().lower()
    cuda = find_cuda_home()
    if flag in ("0", "false", "no", "off"):
        return None
    if flag in ("1", "true", "yes", "on") and cuda is None:
        raise RuntimeError("EP_PLUGIN_BUILD_C=1 but nvcc was not found: set CUDA_HOME or put nvcc on PATH")
    return cuda


class NvccBuildExt(build_ext):
    """Compiles csrc/**/*.cu with nvcc into objects that the pybind11 extension links."""

    def build_extension(self, ext):
        cuda = find_cuda_home()
        arch = os.environ.get("EP_PLUGIN_CUDA_ARCH", "90")
        objdir = Path(self.build_temp) / "cu"
        objdir.mkdir(parents=True, exist_ok=True)
        import pybind11

        objects, commands = [], []
        for cu in cuda_sources():
            # one object per source path: nvlink/dispatch.cu -> nvlink_dispatch.o (stems repeat across folders)
            obj = objdir / ("_".join(cu.relative_to(CSRC).with_suffix("").parts) + ".o")
            cmd = [str(cuda / "bin" / "nvcc"), "-c", str(cu), "-o", str(obj), "-O3", "-std=c++17",
                   f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xcompiler", "-fPIC",
                   "--expt-relaxed-constexpr", "-lineinfo", f"-I{CSRC}"]
            print(" ".join(cmd), flush=True)
            commands.append(cmd)
            objects.append(str(obj))
        # One kernel file per process and no device linking, so the files compile side by side.
        with ThreadPoolExecutor(max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            list(pool.map(subprocess.check_call, commands))
        ext.extra_objects = objects
        ext.include_dirs += [pybind11.get_include(), str(cuda / "include"), str(CSRC)]
        ext.library_dirs += [str(cuda / "lib64"), str(cuda / "lib64" / "stubs")]
        super().build_extension(ext)


def cuda_sources():
    """Every .cu under csrc/: the layout kernel and one file per transport kernel (common/ holds headers only)."""
    return sorted(CSRC.rglob("*.cu"))


def host_sources():
    """csrc/**/*.cpp: the bindings and host runtimes, compiled by the C++ compiler into the extension."""
    return [str(p.relative_to(ROOT)) for p in sorted(CSRC.rglob("*.cpp"))]


cuda_home = want_c_build()
ext_modules = []
if cuda_home is not None:
    ext_modules.append(Extension(
        "ep_plugin._C",
        sources=host_sources(),
        extra_compile_args=["-O3", "-std=c++17"],
        libraries=["cudart_static", "dl", "rt", "pthread"],
        language="c++",
    ))
else:
    print("ep_plugin: nvcc not found or EP_PLUGIN_BUILD_C=0: installing pure Python (torch backend only)")

setup(
    name="ep_plugin",
    version="0.1.0",
    description="Expert-parallel dispatch/combine for MoE layers, with Megatron-core and DeepSpeed plugins",
    packages=find_packages(include=["ep_plugin", "ep_plugin.*"]),
    package_data={"ep_plugin.config": ["presets/*.yaml"]},  # configs/*.yaml link to these
    python_requires=">=3.10",
    install_requires=["torch", "PyYAML", "tqdm"],
    extras_require={"test": ["pytest"], "nvshmem-cu13": ["nvidia-nvshmem-cu13"], "nvshmem-cu12": ["nvidia-nvshmem-cu12"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": NvccBuildExt},
    entry_points={"console_scripts": ["ep_plugin = ep_plugin.__main__:main"]},  # ep_plugin doctor
    zip_safe=False,
)
