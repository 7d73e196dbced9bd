"""Build ep_plugin, compiling csrc/ into ep_plugin._C when nvcc is available.

EP_PLUGIN_BUILD_C=1 forces the compiled module (fails without nvcc), =0 skips it, unset builds it
whenever nvcc is found. EP_PLUGIN_CHECK_BUILD=1 compiles every file as always, with less optimisation
(CHECK_BUILD_FLAGS): for a machine that has no GPU to run the kernels and builds _C only to check that
it builds (scripts/setup.sh sets it there); never for a _C that a GPU will run. The module takes
device pointers and streams as integers and links the CUDA runtime statically, so it neither links
libtorch nor depends on the torch version.

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
# CPU seconds of a full _C build (NVSHMEM part included), measured on this project's 2-core CI box;
# the build's first line divides it by the cores to say about how long it takes.
COMPILE_CPU_S = {"full": 240, "check": 100}
CSRC = ROOT / "csrc"
# EP_PLUGIN_CHECK_BUILD=1: the same sources through the same compilers (cicc, ptxas, the host compiler),
# so that a file that fails to build fails here too, but cheaper: cicc (NVVM) and ptxas at -O1 instead
# of -O3 (nvlink/notify.cu: cicc 5.7 -> 1.0 CPU-s, ptxas 13.6 -> 0.5) and the C++ files at -O0 without
# debug information (-g is Python's own flag: the pybind11 bindings, ~20 CPU-s each at -g -O3, ~10 at
# -g0 -O0). And grouped:
# the NVSHMEM .cu files go through nvcc as one translation unit (a generated file that #includes each
# of them), and so do the C++ files (see below).
CHECK_BUILD_FLAGS = {"nvcc": ["-Xcicc", "-O1", "-Xptxas", "-O1"], "cxx": ["-O0", "-g0"]}
# Units: why the check build groups files. with -rdc, cicc compiles every device function of NVSHMEM's headers
# in each file that includes them, ~10 CPU-s a file however small the file (nvshmem/runtime.cu: 104
# lines, 16.5 CPU-s, of which cicc 9.5); the 8 NVSHMEM files took ~150 CPU-s one by one and take
# ~27 as one unit. The C++ files (pybind11's headers and templates): 38 CPU-s one by one, 21 as one.
# Every file still goes through every compiler, the same code, as part of its unit; an error names the
# file and line it is in. Names at file scope (anonymous namespaces, statics) of two files of a unit
# would clash: if a unit fails, its files are compiled one by one, so that an error of a file fails the
# build as before and a clash only costs the time (a line says so). The build for GPUs is file by file.


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


def check_build():
    return os.environ.get("EP_PLUGIN_CHECK_BUILD", "").strip().lower() in ("1", "true", "yes", "on")


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


class Progress:
    """One line per finished step of the _C build ("files done of total"), and a line naming what is
    still compiling whenever nothing was printed for 15 s: the build never goes quiet for long."""

    QUIET_S = 15.0

    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self.running, self.last = {}, self.t0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def say(self, text):
        with self.lock:
            print(f"ep_plugin: _C {text}", flush=True)
            self.last = time.monotonic()

    def start(self, name):
        with self.lock:
            self.running[name] = time.monotonic()

    def finish(self, name):
        with self.lock:
            t = time.monotonic() - self.running.pop(name, time.monotonic())
            self.done += 1
            done = self.done
        self.say(f"[{done:2d}/{self.total}] {name} ({t:.0f} s)")

    def run(self, name, fn, *args, **kwargs):
        self.start(name)
        out = fn(*args, **kwargs)
        self.finish(name)
        return out

    def skip(self, name):
        """A step whose output is current (an object file rebuilt from unchanged inputs)."""
        with self.lock:
            self.done += 1
            done = self.done
        self.say(f"[{done:2d}/{self.total}] {name} (unchanged: kept)")

    def _watch(self):
        while not self.stop.wait(1.0):
            with self.lock:
                quiet = time.monotonic() - self.last >= self.QUIET_S
                names = ", ".join(self.running)
            if quiet:
                self.say(f"still compiling {names or '...'} ({time.monotonic() - self.t0:.0f} s in)")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        if exc[0] is None:
            self.say(f"built in {time.monotonic() - self.t0:.0f} s")


def _newest_input(*srcs):
    """The newest mtime of the sources and every header under csrc/ (any of them may be included)."""
    headers = [p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".hpp")]
    return max([Path(src).stat().st_mtime for src in srcs] + [h.stat().st_mtime for h in headers])


def compile_cuda(progress, name, cmd, inputs=None):
    """nvcc ``cmd`` for csrc/``name``, unless its object was built by the same command from inputs no
    newer than it (a rebuild after a failed link, or after a change to other files, recompiles only
    what changed). The command is kept beside the object (.o.cmd). inputs: the sources a unit
    (write_unit) includes, when cmd compiles one."""
    obj = Path(cmd[cmd.index("-o") + 1])
    stamp = obj.with_suffix(".o.cmd")
    line = "\n".join(cmd)
    if (obj.exists() and stamp.exists() and stamp.read_text() == line
            and obj.stat().st_mtime > _newest_input(*(inputs or [CSRC / name]))):
        progress.skip(name)
        return
    stamp.unlink(missing_ok=True)
    progress.run(name, subprocess.check_call, cmd)
    stamp.write_text(line)


def write_unit(path, sources):
    """A translation unit that #includes each of sources (the check build's units: see CHECK_BUILD_FLAGS); the file
    is rewritten only when its text changes, so that an unchanged unit's object is kept."""
    text = "// generated by setup.py (EP_PLUGIN_CHECK_BUILD=1): these files as one translation unit\n" + \
        "".join(f'#include "{Path(s).resolve()}"\n' for s in sources)
    path = Path(path)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def unit_name(sources):
    """What a unit's progress line calls it: nvshmem/{ll_combine,ll_dispatch,...}.cu as one unit."""
    rels = [Path(_rel(s)) for s in sources]
    folders = sorted({str(r.parent) for r in rels})
    return f"{', '.join(folders)}: {len(rels)} files as one unit ({', '.join(r.name for r in rels)})"


def one_by_one_note(what):
    print(f"ep_plugin: _C {what} as one unit failed (the compiler's lines above say why); compiling them one "
          f"by one, so that an error of a file fails the build and a clash of names between two of them (the "
          f"unit's only other cause) costs only the time", flush=True)


def _rel(path):
    try:
        return str(Path(path).resolve().relative_to(CSRC))
    except ValueError:
        return str(path)


class NvccBuildExt(build_ext):
    """Compiles csrc/**/*.cu with nvcc into objects that the pybind11 extension links, and the C++ files
    beside them, side by side on every core (the longest first), with a progress line per file.
    EP_PLUGIN_BUILD_VERBOSE=1 also prints every command."""

    def build_extension(self, ext):
        cuda = find_cuda_home()
        arch = os.environ.get("EP_PLUGIN_CUDA_ARCH", "90")
        verbose = os.environ.get("EP_PLUGIN_BUILD_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on")
        objdir = Path(self.build_temp) / "cu"
        objdir.mkdir(parents=True, exist_ok=True)
        import pybind11

        nvshmem = NVSHMEM
        gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
        objects, rdc_objects = [], []

        def nvcc_command(src, obj, rdc):
            cmd = [str(cuda / "bin" / "nvcc"), "-c", str(src), "-o", str(obj), "-O3", "-std=c++17", gencode,
                   "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-lineinfo", f"-I{CSRC}"]
            if check_build():
                cmd += CHECK_BUILD_FLAGS["nvcc"]
            if rdc:  # relocatable device code: NVSHMEM's device API is in a static library
                cmd += ["-rdc=true", f"-I{nvshmem[0]}"]
            if verbose:
                print(" ".join(cmd), flush=True)
            return cmd

        sources = cuda_sources(nvshmem is not None)
        # one object per source path: nvlink/dispatch.cu -> nvlink_dispatch.o (stems repeat across folders)
        file_jobs = {cu: (_rel(cu), nvcc_command(cu, objdir / ("_".join(cu.relative_to(CSRC).with_suffix("").parts)
                                                                + ".o"), is_nvshmem_source(cu)))
                     for cu in sources}
        nvshmem_cu = [cu for cu in sources if is_nvshmem_source(cu)]
        jobs = []  # (sort key, function returning its objects)
        if check_build() and len(nvshmem_cu) > 1:  # one unit (the comment at CHECK_BUILD_FLAGS says why)
            unit = write_unit(objdir / "nvshmem_unit.cu", nvshmem_cu)
            unit_cmd = nvcc_command(unit, objdir / "nvshmem_unit.o", True)

            def nvshmem_unit():
                try:
                    compile_cuda(progress, unit_name(nvshmem_cu), unit_cmd, nvshmem_cu)
                    return [unit_cmd[unit_cmd.index("-o") + 1]], "rdc"
                except subprocess.CalledProcessError:
                    one_by_one_note("the NVSHMEM files")
                    progress.total += len(nvshmem_cu) - 1
                    for cu in nvshmem_cu:
                        compile_cuda(progress, *file_jobs[cu])
                    return [cmd[cmd.index("-o") + 1] for _, cmd in (file_jobs[cu] for cu in nvshmem_cu)], "rdc"
            jobs.append(((0, 0), nvshmem_unit))
        in_unit = set(nvshmem_cu) if jobs else set()
        n_cuda = len(sources) - len(in_unit) + (1 if in_unit else 0)
        for cu in sources:
            if cu in in_unit:
                continue

            def one(job=file_jobs[cu], rdc=cu in nvshmem_cu):
                compile_cuda(progress, *job)
                return [job[1][job[1].index("-o") + 1]], "rdc" if rdc else "cuda"
            # the slowest first (the NVSHMEM files, -rdc: 2-3x the others; then the C++ files, _host_jobs), so that
            # no long file starts last
            jobs.append(((0 if cu in nvshmem_cu else 2, -cu.stat().st_size), one))
        workers = max(1, os.cpu_count() or 1)
        n_host = len(ext.sources)
        steps_host = 1 if check_build() and n_host > 1 else n_host
        total = n_cuda + steps_host + (1 if nvshmem is not None else 0) + 1  # + device link, + link
        kind = " (a check build: less optimised, not for GPU use)" if check_build() else ""
        grouped = " (the NVSHMEM files as one unit, the C++ files as one)" if check_build() else ""
        cpu_s = COMPILE_CPU_S["check" if check_build() else "full"]
        print(f"ep_plugin: compiling _C for sm_{arch}{kind}: {len(sources)} CUDA files, {n_host} C++ files"
              f"{', NVSHMEM part included' if nvshmem is not None else ''}{grouped}, {workers} at a time "
              f"(about {cpu_s // workers} s on {workers} cores: {cpu_s} s of CPU time)", flush=True)
        progress = Progress(total)
        ext.include_dirs += [pybind11.get_include(), str(cuda / "include"), str(CSRC)]
        host_jobs = self._host_jobs(ext, progress)
        with progress, ThreadPoolExecutor(workers) as pool:
            # one kernel file (or unit) per process, side by side, the C++ files among them; only the NVSHMEM
            # objects are device-linked, after
            host_objects = []
            for objs, kind in pool.map(lambda kj: kj[1](), sorted(host_jobs + jobs, key=lambda kj: kj[0])):
                if kind == "host":
                    host_objects += objs
                else:
                    objects += objs
                    rdc_objects += objs if kind == "rdc" else []
            link_args = []
            if nvshmem is not None:
                inc, lib = nvshmem
                # One device-link unit holding every -rdc object and libnvshmem_device, so that NVSHMEM's
                # __device__ state exists once in _C (a second unit would hold a copy nobody initializes).
                dlink = objdir / "nvshmem_dlink.o"
                cmd = [str(cuda / "bin" / "nvcc"), "-dlink", *rdc_objects, "-o", str(dlink), gencode,
                       "-Xcompiler", "-fPIC", f"-L{lib}", "-lnvshmem_device"]
                if verbose:
                    print(" ".join(cmd), flush=True)
                progress.run("device link of the NVSHMEM objects", subprocess.check_call, cmd)
                # the host half of libnvshmem_device.a (nvshmemi_init_thread) and the host library, by
                # path: the wheel ships libnvshmem_host.so.3 only, no libnvshmem_host.so for -l to find.
                objects += [str(dlink), str(lib / "libnvshmem_device.a"), str(lib / "libnvshmem_host.so.3")]
                # $ORIGIN/..: site-packages/ep_plugin/_C.so -> site-packages/nvidia/nvshmem/lib (a wheel
                # install); the absolute dir serves an editable install, whose _C.so sits in the repo.
                link_args += ["-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib", f"-Wl,-rpath,{lib}"]
            ext.extra_objects = objects
            ext.extra_link_args = (ext.extra_link_args or []) + link_args
            ext.library_dirs += [str(cuda / "lib64"), str(cuda / "lib64" / "stubs")]
            compile_, link = self.compiler.compile, self.compiler.link_shared_object
            if host_jobs:  # distutils' compile step: done in the pool above
                self.compiler.compile = lambda *a, **k: list(host_objects)
            self.compiler.link_shared_object = lambda *a, **k: progress.run("link", link, *a, **k)
            try:
                super().build_extension(ext)
            finally:
                self.compiler.compile, self.compiler.link_shared_object = compile_, link

    def _host_jobs(self, ext, progress):
        """The C++ sources' jobs (pybind11 bindings: ~10-20 CPU-s each; one unit in a check build), with the
        arguments distutils' build_ext passes to compiler.compile, so that they run in the pool beside the CUDA
        files from the start (after them, the unit ran alone on one core for ~20 s). Each job returns
        (objects, "host"). None where the compiler is another distutils': its own serial compile, after."""
        compiler = self.compiler
        if not all(hasattr(compiler, n) for n in ("_setup_compile", "_get_cc_args", "_compile")):
            return []
        macros = ext.define_macros[:] + [(undef,) for undef in ext.undef_macros]
        _, objects, postargs, pp_opts, build = compiler._setup_compile(
            self.build_temp, macros, ext.include_dirs, ext.sources, ext.depends, ext.extra_compile_args or [])
        cc_args = compiler._get_cc_args(pp_opts, self.debug, None)

        def one(obj):
            src, suffix = build[obj]
            progress.run(_rel(src), compiler._compile, obj, src, suffix, cc_args, postargs, pp_opts)
            return [obj], "host"

        if check_build() and len(objects) > 1:  # the C++ files as one unit (the comment at CHECK_BUILD_FLAGS says why)
            srcs = [build[obj][0] for obj in objects]
            unit = write_unit(Path(self.build_temp) / "cu" / "host_unit.cpp", srcs)
            unit_obj = str(Path(self.build_temp) / "cu" / "host_unit.o")

            def host_unit():
                try:
                    progress.run(unit_name(srcs), compiler._compile, unit_obj, str(unit), ".cpp", cc_args, postargs,
                                 pp_opts)
                    return [unit_obj], "host"
                except Exception:  # distutils' CompileError
                    one_by_one_note("the C++ files")
                    progress.total += len(objects) - 1
                    return [o for obj in objects for o in one(obj)[0]], "host"
            return [((1, 0), host_unit)]
        return [((1, -Path(build[obj][0]).stat().st_size), lambda obj=obj: one(obj)) for obj in objects]


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
        extra_compile_args=["-std=c++17"] + (CHECK_BUILD_FLAGS["cxx"] if check_build() else ["-O3"]),
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
    extras_require={"test": ["pytest", "pytest-xdist", "hypothesis"], "cu12": ["nvidia-nvshmem-cu12"], "cu13": ["nvidia-nvshmem-cu13"],
                    "nvshmem-cu12": ["nvidia-nvshmem-cu12"], "nvshmem-cu13": ["nvidia-nvshmem-cu13"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": NvccBuildExt},
    entry_points={"console_scripts": ["ep_plugin = ep_plugin.__main__:main"]},  # ep_plugin doctor
    zip_safe=False,
)
