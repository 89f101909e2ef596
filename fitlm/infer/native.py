"""C kernels of `fitlm/infer/*.c`, built once per machine by its C compiler and loaded through ctypes.

Built at first use as `$CC -O3 -march=native -fopenmp -ffp-contract=off -shared` (CC default `cc`) into
`$FITLM_CACHE_DIR/kernels` (default ~/.cache/fitlm) under a hash of the source (and the headers beside it), the
flags, the compiler and the CPU, so a cache copied to another machine never runs instructions its CPU lacks. The
file is written atomically, so processes starting together do not load half a library. OpenMP's threads are torch's own:
the library links libgomp.so.1, which resolves to the copy torch has already loaded.

Where there is no compiler or the build fails, `library(name)` is None and says why once (a warning);
callers keep their torch path. `FITLM_NATIVE=0` turns every kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from fitlm.hardware import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags: what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = {line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))}
    return "\n".join(sorted(keep)) or platform.machine()


def compiler() -> str | None:
    """The C compiler: $CC, else cc, else gcc; None when none is on PATH."""
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def source(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.c")


def build(name: str, cc: str) -> Path:
    """The cached library of `name`.c for this compiler and CPU, compiled first if missing."""
    # the source and the headers beside it (what it may include): a change to either builds again
    text = "\n".join(p.read_text() for p in [source(name), *sorted(source(name).parent.glob("*.h"))])
    key = hashlib.sha256("\n".join([text, " ".join(FLAGS), cc, _cpu_identity()]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, str(source(name)), "-o", str(built)], check=True, capture_output=True, timeout=300)
        os.replace(built, out)
    return out


def _load(name: str) -> ctypes.CDLL | None:
    if os.environ.get("FITLM_NATIVE", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        warnings.warn(f"fitlm: no C compiler on PATH (set $CC) to build {name}.c: keeping the torch path", stacklevel=3)
        return None
    try:
        return ctypes.CDLL(str(build(name, cc)))
    except (OSError, subprocess.SubprocessError) as e:
        why = e.stderr.decode(errors="replace")[-600:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(f"fitlm: building {source(name)} with {cc} failed, keeping the torch path: {why}", stacklevel=3)
        return None


def library(name: str) -> ctypes.CDLL | None:
    """The loaded kernel library `name` (fitlm/infer/<name>.c), built at the first call; None where it cannot
    be (see the module doc). Tried once per process."""
    if name not in _loaded:
        _loaded[name] = _load(name)
    return _loaded[name]


__all__ = ["FLAGS", "build", "compiler", "library", "source"]
