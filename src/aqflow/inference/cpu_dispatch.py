"""Which CPU kernel sums the lookup tables of 8-bit-code layers: chosen by the CPU's features at run time.

    avx512  csrc/lut_cpu.c      each column's table held in AVX-512 registers (x86-64 with AVX-512 F and BW)
    avx2    csrc/lut_cpu_l1.c   tables in L1, one scalar load a code (x86-64 with AVX2 and FMA)
    neon    csrc/lut_cpu_l1.c   the same source built for aarch64 (NEON is part of the architecture there)
    numba   cpu_kernels          gathers from L1-sized table slices (any CPU; nothing to compile)

`AQFLOW_CPU_KERNEL` picks one: `auto` (the default) takes the first of that order this CPU runs and
whose C source builds (a build that fails is reported once as a warning, and the next one is tried);
a kernel's name forces it, and a name that is unknown or that this CPU cannot run is an error naming
the choices. Forcing a lower kernel is how a machine tests the paths of CPUs it is not (the test
suite runs the kernel tests once per kernel this machine has). Where it is unset, the older
`AQFLOW_REGISTER_KERNEL` still works, with a warning: 0 is numba, anything else auto.

The C sources are compiled on first use with the system C compiler (`$CC`, else `cc`) into
`$AQFLOW_KERNEL_CACHE` (default `~/.cache/aqflow/kernels`), once per kernel, source, flags and
compiler, and loaded with ctypes (register_kernel binds and calls them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

KERNEL_ENV = "AQFLOW_CPU_KERNEL"
KERNELS = ("avx512", "avx2", "neon", "numba")  # the order `auto` tries them in
RETIRED_ENV = "AQFLOW_REGISTER_KERNEL"  # the switch before this module: 0 meant numba
PREFETCH_ENV = "AQFLOW_CPU_PREFETCH"  # avx512: code columns requested ahead of the one summed (0: none)
DEFAULT_PREFETCH_COLUMNS = 8
CSRC = Path(__file__).parent / "csrc"
X86_64 = ("x86_64", "AMD64")
AARCH64 = ("aarch64", "arm64")
L1_BLOCK_COLUMNS = 16  # avx2, neon: code columns a block of their block-major layout (register_kernel.block_tiles)


@dataclass(frozen=True)
class KernelBuild:
    """How a compiled kernel is made and where it runs: its C source, the compiler flags beyond
    -shared -fPIC, the machines (platform.machine()) and the CPU flags (/proc/cpuinfo) it needs."""

    name: str
    source: Path
    flags: tuple[str, ...]
    machines: tuple[str, ...]
    cpu_flags: tuple[str, ...]


BUILDS = {
    "avx512": KernelBuild("avx512", CSRC / "lut_cpu.c", ("-O3", "-mavx512f", "-mavx512bw"), X86_64,
                          ("avx512f", "avx512bw")),
    "avx2": KernelBuild("avx2", CSRC / "lut_cpu_l1.c", ("-O3", "-mavx2", "-mfma", f"-DBLOCK_COLUMNS={L1_BLOCK_COLUMNS}"),
                        X86_64, ("avx2", "fma")),
    "neon": KernelBuild("neon", CSRC / "lut_cpu_l1.c", ("-O3", f"-DBLOCK_COLUMNS={L1_BLOCK_COLUMNS}"), AARCH64, ()),
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them ("flags" on x86, "Features" on ARM; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def machine() -> str:
    return platform.machine()


def missing_features(name: str) -> list[str]:
    """What this CPU lacks to run kernel `name` (empty: it runs it): the architecture, then CPU flags."""
    if name == "numba":
        return []
    build = BUILDS[name]
    if machine() not in build.machines:
        return [f"an {build.machines[0]} CPU (this is {machine() or 'unknown'})"]
    flags = cpu_flags()
    return [flag for flag in build.cpu_flags if flag not in flags]


def prefetch_columns() -> int:
    """How many code columns ahead the AVX-512 kernel requests codes ($AQFLOW_CPU_PREFETCH, default 8; 0: none)."""
    value = os.environ.get(PREFETCH_ENV, str(DEFAULT_PREFETCH_COLUMNS))
    try:
        columns = int(value)
    except ValueError:
        raise ValueError(f"{PREFETCH_ENV}={value!r}: expected a whole number of code columns (0: none)") from None
    if columns < 0:
        raise ValueError(f"{PREFETCH_ENV}={value!r}: expected 0 or more code columns")
    return columns


def build_flags(build: KernelBuild) -> tuple[str, ...]:
    """The compiler flags of `build` in this process: its own, a shared library, the prefetch distance."""
    return (*build.flags, "-shared", "-fPIC", f"-DAHEAD={prefetch_columns()}")


def kernel_cache_dir() -> Path:
    env = os.environ.get("AQFLOW_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aqflow" / "kernels"


def build_library(build: KernelBuild, compiler: str, cache_dir: Path, flags: tuple[str, ...] | None = None) -> Path:
    """The compiled kernel's path in cache_dir, compiling it with `flags` (default: build_flags(build))
    to a temporary file, then renamed, unless a build of the same source, flags and compiler is there.
    Raises CalledProcessError/OSError."""
    flags = build_flags(build) if flags is None else flags
    digest = hashlib.sha256(build.source.read_bytes() + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    library = cache_dir / f"{build.source.stem}-{build.name}-{digest}.so"
    if library.is_file():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{build.source.stem}-", suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(build.source), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


class KernelBuildError(RuntimeError):
    """A kernel this CPU runs could not be compiled or loaded (no compiler, a compiler error)."""


def load_library(name: str) -> ctypes.CDLL:
    """Kernel `name`'s library, compiled on first use ($CC, the flags and the cache folder as set now).
    Raises KernelBuildError where it cannot be built."""
    return _load_library(name, build_flags(BUILDS[name]), os.environ.get("CC", "cc"), kernel_cache_dir())


@functools.cache
def _load_library(name: str, flags: tuple[str, ...], compiler_name: str, cache_dir: Path) -> ctypes.CDLL:
    """load_library's work, once per kernel, flags, compiler and folder in a process (a failure is not kept)."""
    compiler = shutil.which(compiler_name)
    try:
        if compiler is None:
            raise OSError(f"no C compiler ({compiler_name}) on PATH")
        return ctypes.CDLL(str(build_library(BUILDS[name], compiler, cache_dir, flags)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        raise KernelBuildError(f"the {name} kernel could not be built ({detail})") from error


def requested_kernel() -> str:
    """$AQFLOW_CPU_KERNEL checked: "auto" or one of KERNELS (an error naming the choices otherwise).
    Where it is unset, the switch it replaced still does what it did, with a warning: 0 numba
    (no compiled kernel), anything else auto."""
    value = os.environ.get(KERNEL_ENV)
    if value is None and RETIRED_ENV in os.environ:
        value = "numba" if os.environ[RETIRED_ENV].strip() == "0" else "auto"
        warnings.warn(f"aqflow: {RETIRED_ENV} is deprecated and read as {KERNEL_ENV}={value}; set {KERNEL_ENV} "
                      f"(auto or one of {', '.join(KERNELS)})", FutureWarning, stacklevel=2)
    value = value or "auto"
    if value != "auto" and value not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={value!r}: expected auto or one of {', '.join(KERNELS)}")
    return value


def runnable_kernels() -> list[str]:
    """The kernels whose CPU features this machine has, in KERNELS' order (numba always)."""
    return [name for name in KERNELS if not missing_features(name)]


def available_kernels() -> list[str]:
    """The kernels this machine runs and builds, in KERNELS' order (numba always; building is cached)."""
    available = []
    for name in runnable_kernels():
        try:
            if name != "numba":
                load_library(name)
        except KernelBuildError:
            continue
        available.append(name)
    return available


def chosen_kernel() -> tuple[str, ctypes.CDLL | None]:
    """(name, library) of the kernel this process uses ($AQFLOW_CPU_KERNEL; library None for numba).

    auto: the first kernel of KERNELS this CPU runs and that builds (a failed build is a warning);
    a forced name this CPU cannot run is a ValueError naming what it lacks and what runs here, one
    that fails to build a KernelBuildError."""
    wanted = requested_kernel()
    if wanted != "auto":
        missing = missing_features(wanted)
        if missing:
            raise ValueError(f"{KERNEL_ENV}={wanted}: this CPU lacks {', '.join(missing)}; "
                             f"it runs {', '.join(runnable_kernels())}")
        return wanted, None if wanted == "numba" else load_library(wanted)
    for name in runnable_kernels():
        if name == "numba":
            return name, None
        try:
            return name, load_library(name)
        except KernelBuildError as error:
            warnings.warn(f"aqflow: {error}; trying the next CPU kernel", stacklevel=2)
    raise AssertionError("numba is always runnable")  # pragma: no cover
