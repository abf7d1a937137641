"""Native CPU kernels, compiled on first use with the system C compiler.

Plain C called through ctypes: it builds in about a second, needs no torch headers, and
when no compiler is found the engine falls back to torch's attention and element-wise
operations. paged_attention.c: attention over the paged KV cache; elementwise.c: the
decoder layer's residual add with its RMS norm, and the rotary embedding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from tokenfleet import envs

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_HEADER = _SOURCE.with_name("paged_attention_impl.h")  # included once per cache dtype
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


# How a library is built, in its cache key: a change here builds it again.
_RECIPE = b"compile with the flags, then link without them"


def _cpu_signature() -> str:
    # -march=native code is only valid on the CPU it was built for.
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def _build(compiler: str, source: Path, flags: list[str], includes: tuple[Path, ...] = ()) -> Path:
    digest = hashlib.sha256(
        source.read_bytes()
        + b"".join(path.read_bytes() for path in includes)
        + " ".join(flags).encode()
        + _cpu_signature().encode()
        + _RECIPE
    ).hexdigest()[:16]
    out_dir = envs.cache_dir() / "kernels"
    target = out_dir / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        obj = Path(tmp) / f"{source.stem}.o"
        # Compiled with `flags`, linked without them: linked with -ffast-math, gcc adds
        # crtfastmath.o, which sets the CPU's flush-to-zero flags for the whole process as
        # the library loads (subnormal floats read as zero everywhere, torch included).
        compile_flags = [f for f in flags if f != "-shared"]
        link_flags = ["-shared", *(f for f in flags if f == "-fopenmp")]
        for argv in (
            [compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
            [compiler, *link_flags, str(obj), "-o", str(built), "-lm"],
        ):
            subprocess.run(argv, check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders both end with a whole file
    logger.info("built %s", target)
    return target


def _load(source: Path, flags: list[str], includes: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `source`, or None (logged) when it cannot be built here."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: %s's kernels fall back to torch", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, flags, includes)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("%s unavailable (%s): using torch", source.name, detail.strip())
        return None


# The kernel for each KV cache element type (queries are float32 in all).
_KERNELS = {
    torch.float32: "paged_attention_f32",
    torch.float16: "paged_attention_f16",
    torch.bfloat16: "paged_attention_bf16",
}


@cache
def paged_attention_lib() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged) when it cannot be built here."""
    lib = _load(_SOURCE, _FLAGS, (_HEADER,))
    if lib is None:
        return None
    for fn in _KERNELS.values():
        fn = getattr(lib, fn)
        fn.restype = None
        fn.argtypes = (
            [ctypes.c_void_p] * 8
            + [ctypes.c_int64] * 6
            + [
                ctypes.c_float,
                ctypes.c_int64,
                ctypes.c_int,
            ]
        )
    lib.paged_attention_splits_contexts.restype = ctypes.c_int
    lib.paged_attention_splits_contexts.argtypes = []
    return lib


def paged_attention_splits_contexts() -> bool:
    """Whether the built kernel cuts a long context across threads (its AVX-512 path); the
    portable path reads each context in one pass at any thread count."""
    lib = paged_attention_lib()
    return lib is not None and bool(lib.paged_attention_splits_contexts())


def paged_attention(
    q: torch.Tensor,  # [T, H, D] float32: each sequence's query rows, one after another
    k_cache: torch.Tensor,  # [num_blocks, BS, HKV, D] float32, float16 or bfloat16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64: each sequence's context, its queries included
    query_starts: torch.Tensor,  # [B] int64: its first row in q
    query_lens: torch.Tensor,  # [B] int64: its rows (the last query_lens of its context)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context, read in
    place (kernels/paged_attention.c)."""
    lib = paged_attention_lib()
    assert lib is not None, "call only when paged_attention_lib() is available"
    q = q.contiguous()
    assert q.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in _KERNELS, k_cache.dtype
    for index in (block_tables, context_lens, query_starts, query_lens):
        assert index.dtype == torch.int64 and index.is_contiguous()
    _, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    getattr(lib, _KERNELS[k_cache.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        query_starts.data_ptr(),
        query_lens.data_ptr(),
        out.data_ptr(),
        block_tables.shape[0],
        h,
        hkv,
        d,
        bs,
        block_tables.shape[1],
        scale,
        sliding_window or 0,
        torch.get_num_threads(),
    )
    return out


_ELEMENTWISE = Path(__file__).with_name("elementwise.c")
# No -ffast-math, no contraction into fused multiply-adds: torch's rounding, op by op.
_ELEMENTWISE_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11"]


@cache
def elementwise_lib() -> ctypes.CDLL | None:
    """The decoder layer's fused element-wise kernels (kernels/elementwise.c), or None."""
    lib = _load(_ELEMENTWISE, _ELEMENTWISE_FLAGS)
    if lib is None:
        return None
    lib.add_rms_norm_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.rope_f32.restype = None
    lib.rope_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    return lib


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden] float32, contiguous: the residual stream, added to in place
    residual: torch.Tensor | None,  # [T, hidden] float32, contiguous, or None: no add
    weight: torch.Tensor,  # [hidden] float32
    eps: float,
) -> torch.Tensor:
    """x += residual (where given), then the RMS norm of x times weight, as a new tensor."""
    lib = elementwise_lib()
    assert lib is not None, "call only when elementwise_lib() is available"
    assert x.dtype == weight.dtype == torch.float32 and x.is_contiguous()
    assert weight.is_contiguous() and weight.shape == (x.shape[1],)
    rows, hidden = x.shape
    if residual is not None:
        assert residual.dtype == torch.float32 and residual.is_contiguous()
        assert residual.shape == x.shape
    out = torch.empty_like(x)
    lib.add_rms_norm_f32(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
    )
    return out


def rope_(
    x: torch.Tensor,  # [T, width] float32, rows contiguous: the heads to rotate come first
    cos: torch.Tensor,  # [T, head_dim] float32, by each row's position
    sin: torch.Tensor,
    heads: int,
    head_dim: int,
) -> None:
    """Rotate the first `heads` heads of each row in place: x * cos + rotate_half(x) * sin."""
    lib = elementwise_lib()
    assert lib is not None, "call only when elementwise_lib() is available"
    rows, width = x.shape
    assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(1) == 1
    assert heads * head_dim <= width and head_dim % 2 == 0 and head_dim <= 1024
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (rows, head_dim)
    lib.rope_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, x.stride(0), heads, head_dim)
