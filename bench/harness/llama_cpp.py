"""llama.cpp's `llama-server`, built from source for the machine it runs on, as a peer in the CPU comparison.

The sources come from PyPI, the one index this project's machines reach: the `llama-cpp-python` sdist
vendors llama.cpp (vendor/llama.cpp, tools/server included). cmake builds the `llama-server` target with
GGML_NATIVE (the CPU's own vector units, as Headroom's kernels are built) and without the web UI, the
prebuilt-UI download or OpenSSL; on 2 cores that takes about 15 minutes, once: the binary is kept under
the work directory and reused. For `HEADROOM_CPU_ISA=avx2` (engine/model/dtype_choice.py) it is built for AVX2
without AVX-512 (ggml's own switches), so that a run as on an AVX2-only CPU holds llama.cpp to it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # llama.cpp 0c1e570 (its ggml commit)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)  # fmt: skip
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"),
}  # fmt: skip
BUILD_TIMEOUT_S = 3600


def llama_server(work: Path, isa: str = "native") -> Path:
    """The binary built for `isa` under `work`, building it first where it is not there. Raises
    CalledProcessError or FileNotFoundError (no cmake) with the tool's message."""
    binary = work / ("llama.cpp-build" if isa == "native" else f"llama.cpp-build-{isa}") / "bin" / "llama-server"
    if binary.exists():
        return binary
    work.mkdir(parents=True, exist_ok=True)
    if not any(work.glob("llama_cpp_python-*.tar.gz")):
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST, "-d", str(work)]
        subprocess.run(pip, check=True, capture_output=True, text=True, timeout=600)
    if not any(work.glob("llama_cpp_python-*/vendor/llama.cpp")):
        with tarfile.open(next(work.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = binary.parent.parent
    run = {"check": True, "capture_output": True, "text": True, "timeout": BUILD_TIMEOUT_S}
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS, *ISA_FLAGS[isa]], **run)  # type: ignore[call-overload]
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], **run)  # type: ignore[call-overload]
    return binary


def amx_repack_crashes(isa: str) -> bool:
    """A native build on a CPU with AMX-INT8 runs Q4_1 through ggml's AMX buffer type, the only layout it
    repacks Q4_1 into on x86, and this llama.cpp crashes there at the first step (SIGSEGV in
    ggml_backend_amx_mul_mat, a Xeon with amx_int8): such a build must run with --no-repack, which turns off
    that path alone."""
    cpuinfo = Path("/proc/cpuinfo")  # the CPU's own flags: an ISA cap hides AMX from Headroom, not from this build
    return isa == "native" and cpuinfo.exists() and "amx_int8" in cpuinfo.read_text().split()


def llama_server_argv(
    binary: Path, gguf: Path, port: int, name: str, threads: int, slots: int, context: int, isa: str
) -> list[str]:
    """Continuous batching over `slots` parallel slots sharing a `context`-token KV cache (f16, its default),
    for the build of `isa`."""
    return [
        str(binary), "-m", str(gguf), "--alias", name, "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-np", str(slots), "-c", str(context), "--cont-batching",
        *(["--no-repack"] if amx_repack_crashes(isa) else []),
    ]  # fmt: skip
