"""Build ep_plugin, compiling csrc/ into ep_plugin._C when nvcc is available.

EP_PLUGIN_BUILD_C=1 forces the compiled module (fails without nvcc), =0 skips it, unset builds it
whenever nvcc is found. The module takes device pointers and streams as integers and links the
CUDA runtime statically, so it neither links libtorch nor depends on the torch version.

The NVSHMEM part (csrc/nvshmem/, csrc/python/nvshmem.cpp) is built when the nvidia-nvshmem-cu<major>
wheel matching the CUDA major of torch (of nvcc when torch is a CPU build) is installed; otherwise
one line says why not. EP_PLUGIN_WITH_NVSHMEM=0 skips it, =1 fails the build instead of skipping.
"""
import importlib.metadata as md
import importlib.util
import os
import re
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


def cuda_major(cuda):
    """torch's CUDA major, read from torch/version.py without importing torch; nvcc's for a CPU torch."""
    spec = importlib.util.find_spec("torch")
    if spec and spec.submodule_search_locations:
        version_py = Path(list(spec.submodule_search_locations)[0]) / "version.py"
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+)\.", version_py.read_text(), re.M) if version_py.exists() else None
        if m:
            return int(m.group(1)), "torch"
    try:
        out = subprocess.run([str(cuda / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None, "nvcc"
    m = re.search(r"release (\d+)\.", out)
    return (int(m.group(1)) if m else None), "nvcc"


def find_nvshmem(cuda):
    """(include dir, lib dir) of the NVSHMEM wheel to build against, or (None, reason)."""
    flag = os.environ.get("EP_PLUGIN_WITH_NVSHMEM", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return None, "EP_PLUGIN_WITH_NVSHMEM=0"
    major, source = cuda_major(cuda)
    wheels = {}
    for m in (12, 13):
        try:
            wheels[m] = md.version(f"nvidia-nvshmem-cu{m}")
        except md.PackageNotFoundError:
            pass
    spec = importlib.util.find_spec("nvidia.nvshmem") if importlib.util.find_spec("nvidia") else None
    if spec is None or not spec.submodule_search_locations:
        return None, f"nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu{major or '<CUDA major>'})"
    root = Path(list(spec.submodule_search_locations)[0])
    if len(wheels) > 1:  # both write nvidia/nvshmem/: the files are whichever was installed last
        return None, "nvidia-nvshmem-cu12 and -cu13 are both installed; uninstall the one not matching CUDA"
    if not wheels:
        return None, f"{root} belongs to no nvidia-nvshmem-cu12/-cu13 wheel, so its CUDA major is unknown"
    wheel_major = next(iter(wheels))
    if major is None:
        return None, "the CUDA major of torch and nvcc is unknown"
    if wheel_major != major:
        return None, f"nvidia-nvshmem-cu{wheel_major} does not match the CUDA {major} of {source}"
    inc, lib = root / "include", root / "lib"
    for need in (inc / "nvshmem.h", lib / "libnvshmem_device.a", lib / "libnvshmem_host.so.3"):
        if not need.exists():
            return None, f"{need} is missing from the nvidia-nvshmem-cu{wheel_major} wheel"
    return (inc, lib), None


def nvshmem_setting(cuda):
    """find_nvshmem, printing the one line that says why NVSHMEM is skipped (or failing when it is required)."""
    found, reason = find_nvshmem(cuda)
    if found is None:
        if os.environ.get("EP_PLUGIN_WITH_NVSHMEM", "").strip().lower() in ("1", "true", "yes", "on"):
            raise RuntimeError(f"EP_PLUGIN_WITH_NVSHMEM=1 but {reason}")
        print(f"ep_plugin: building _C without NVSHMEM: {reason}", flush=True)
    return found


class NvccBuildExt(build_ext):
    """Compiles csrc/**/*.cu with nvcc into objects that the pybind11 extension links."""

    def build_extension(self, ext):
        cuda = find_cuda_home()
        arch = os.environ.get("EP_PLUGIN_CUDA_ARCH", "90")
        objdir = Path(self.build_temp) / "cu"
        objdir.mkdir(parents=True, exist_ok=True)
        import pybind11

        nvshmem = NVSHMEM
        gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
        objects, rdc_objects, commands = [], [], []
        for cu in cuda_sources(nvshmem is not None):
            # one object per source path: nvlink/dispatch.cu -> nvlink_dispatch.o (stems repeat across folders)
            obj = objdir / ("_".join(cu.relative_to(CSRC).with_suffix("").parts) + ".o")
            cmd = [str(cuda / "bin" / "nvcc"), "-c", str(cu), "-o", str(obj), "-O3", "-std=c++17", gencode,
                   "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-lineinfo", f"-I{CSRC}"]
            if is_nvshmem_source(cu):  # relocatable device code: NVSHMEM's device API is in a static library
                cmd += ["-rdc=true", f"-I{nvshmem[0]}"]
                rdc_objects.append(str(obj))
            print(" ".join(cmd), flush=True)
            commands.append(cmd)
            objects.append(str(obj))
        # One kernel file per process, so the files compile side by side; only the NVSHMEM objects
        # are device-linked, after them.
        with ThreadPoolExecutor(max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            list(pool.map(subprocess.check_call, commands))
        link_args = []
        if nvshmem is not None:
            inc, lib = nvshmem
            # One device-link unit holding every -rdc object and libnvshmem_device, so that NVSHMEM's
            # __device__ state exists once in _C (a second unit would hold a copy nobody initializes).
            dlink = objdir / "nvshmem_dlink.o"
            cmd = [str(cuda / "bin" / "nvcc"), "-dlink", *rdc_objects, "-o", str(dlink), gencode,
                   "-Xcompiler", "-fPIC", f"-L{lib}", "-lnvshmem_device"]
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            # the host half of libnvshmem_device.a (nvshmemi_init_thread) and the host library, by
            # path: the wheel ships libnvshmem_host.so.3 only, no libnvshmem_host.so for -l to find.
            objects += [str(dlink), str(lib / "libnvshmem_device.a"), str(lib / "libnvshmem_host.so.3")]
            # $ORIGIN/..: site-packages/ep_plugin/_C.so -> site-packages/nvidia/nvshmem/lib (a wheel
            # install); the absolute dir serves an editable install, whose _C.so sits in the repo.
            link_args += ["-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib", f"-Wl,-rpath,{lib}"]
        ext.extra_objects = objects
        ext.extra_link_args = (ext.extra_link_args or []) + link_args
        ext.include_dirs += [pybind11.get_include(), str(cuda / "include"), str(CSRC)]
        ext.library_dirs += [str(cuda / "lib64"), str(cuda / "lib64" / "stubs")]
        super().build_extension(ext)


def is_nvshmem_source(path):
    """csrc/nvshmem/* and its bindings: compiled only with the NVSHMEM wheel."""
    rel = Path(path).resolve().relative_to(CSRC)
    return rel.parts[0] == "nvshmem" or rel == Path("python/nvshmem.cpp")


def cuda_sources(with_nvshmem=False):
    """Every .cu under csrc/: the layout kernel and one file per transport kernel (common/ holds headers only)."""
    return [p for p in sorted(CSRC.rglob("*.cu")) if with_nvshmem or not is_nvshmem_source(p)]


def host_sources(with_nvshmem=False):
    """csrc/**/*.cpp: the bindings and host runtimes, compiled by the C++ compiler into the extension."""
    return [str(p.relative_to(ROOT)) for p in sorted(CSRC.rglob("*.cpp")) if with_nvshmem or not is_nvshmem_source(p)]


cuda_home = want_c_build()
NVSHMEM = nvshmem_setting(cuda_home) if cuda_home is not None else None
ext_modules = []
if cuda_home is not None:
    ext_modules.append(Extension(
        "ep_plugin._C",
        sources=host_sources(NVSHMEM is not None),
        define_macros=[("EP_WITH_NVSHMEM", "1")] if NVSHMEM is not None else [],
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
    # cu12/cu13: the NVSHMEM wheel for torch's CUDA major (never both: they write the same files).
    # nvshmem-cu12/-cu13 are the older names of the same extras.
    extras_require={"test": ["pytest"], "cu12": ["nvidia-nvshmem-cu12"], "cu13": ["nvidia-nvshmem-cu13"],
                    "nvshmem-cu12": ["nvidia-nvshmem-cu12"], "nvshmem-cu13": ["nvidia-nvshmem-cu13"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": NvccBuildExt},
    entry_points={"console_scripts": ["ep_plugin = ep_plugin.__main__:main"]},  # ep_plugin doctor
    zip_safe=False,
)
