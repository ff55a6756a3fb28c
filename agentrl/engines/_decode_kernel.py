"""Decode attention over the slot KV cache in one native call per layer (CPU, fp32), and the fast
forward's elementwise steps (RMS norm with its residual add, rotary, SwiGLU's product) in one
pass each.

Why: a decode row has one query token per query head, so its attention is a matrix-vector
product over its own K/V. Through torch that is a batched matrix product of a few query rows
(the heads that share a K/V head) per slot, every slot padded to the step's longest row, then a
mask, a softmax and a second batched product: the small products spend more time packing
their operands than reading K/V, and the padding reads K/V no row needs (docs/benchmarks.md,
"the roofline of each step"). This kernel walks each (row, K/V head) once over that row's own
length: the scores of the group's query heads against each key, their softmax, and the
weighted sum of the values, with nothing padded and nothing written but the output.

It is C compiled on first use with the machine's C compiler (``$CC``, else ``cc``/``gcc``) for this
CPU (``-march=native``) and for the model's attention shape (``kernel(shape)``: its loops then
have constant bounds), cached under ``$AGENTRL_CACHE/kernels`` (default ``~/.cache/agentrl``) by
a hash of the source, the flags, the compiler's version and the CPU, and loaded with ``ctypes``.
Where there is no compiler, the build fails, the tensors are not CPU fp32, or
``AGENTRL_DECODE_KERNEL=0`` is set, ``kernel()`` returns None and the engine keeps torch's ops
(``_ragged.attend``'s batched products, ``_packed``'s norms and rotary): the same arithmetic,
summed in another order.

The source is compiled with ``-ffast-math`` (so the exponentials vectorise) but linked without
it: linking a shared library with it adds a constructor that sets flush-to-zero for the whole
process. Rows are spread over torch's OpenMP threads when torch runs on libgomp (its Linux
builds), which the library then shares; elsewhere it runs on one thread.
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
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["DecodeKernel", "kernel"]

WIDTH = 16  # floats per vector in the source below: head_dim must be a multiple of it

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16
/* Rows of up to this many keys prefetch (score_keys, sum_values), into the L2 cache: a short row
   ends before the hardware prefetcher has caught up with its streams; a longer one streams well
   without it, and was measured slower with it. Into L2 rather than L1: the model's weights stream
   through the caches between one step's read of a row's K/V and the next, so it comes from
   memory, and prefetches into L1 were held back by the L1's few outstanding misses (measured in
   docs/benchmarks.md). */
#define SHORT 256
#define PREFETCH(address) __builtin_prefetch((address), 0, 1)
typedef float vf __attribute__((vector_size(W * 4), aligned(4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

static inline float hsum(vf a) {
    vf8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* The two passes over one (row, K/V head)'s keys and values; `ahead` (a constant where inlined)
   prefetches, one key at a time, the values while scoring the keys and the next item's keys
   while summing the values. */
static inline __attribute__((always_inline)) void score_keys(
        const float *restrict Q, const float *restrict K, const float *restrict V, int64_t len,
        int64_t group, int64_t nd, float scale, float *restrict scores, int64_t stride, int ahead) {
    for (int64_t j = 0; j < len; j++) {
        const vf *kj = (const vf *)(K + j * nd * W);
        if (ahead) for (int64_t c = 0; c < nd; c++) PREFETCH(V + (j * nd + c) * W);
        for (int64_t g = 0; g < group; g++) {
            const vf *qg = (const vf *)(Q + g * nd * W);
            vf a = qg[0] * kj[0];
            for (int64_t c = 1; c < nd; c++) a += qg[c] * kj[c];
            scores[g * stride + j] = hsum(a) * scale;
        }
    }
}

static inline __attribute__((always_inline)) void sum_values(
        const float *restrict V, int64_t len, int64_t group, int64_t nd, const float *restrict scores,
        int64_t stride, vf *restrict acc, const float *next_k, int64_t next_len, int ahead) {
    for (int64_t c = 0; c < group * nd; c++) acc[c] = (vf){0};
    for (int64_t j = 0; j < len; j++) {
        const vf *vj = (const vf *)(V + j * nd * W);
        if (ahead && j < next_len) for (int64_t c = 0; c < nd; c++) PREFETCH(next_k + (j * nd + c) * W);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * stride + j];
            vf *a = acc + g * nd;
            for (int64_t c = 0; c < nd; c++) a[c] += p * vj[c];
        }
    }
}

/* One (row, K/V head): the scores of its `group` query heads against each of its `len` keys,
   their softmax, and the weighted sum of the values. Inlined with constant group and d / W where
   the library is built for a model's shape (AGENTRL_GROUP, AGENTRL_ND), so that their loops unroll. */
static inline __attribute__((always_inline)) void attend_item(
        const float *restrict Q, const float *restrict K, const float *restrict V, int64_t len,
        int64_t group, int64_t nd, float scale, float *restrict scores, int64_t stride,
        vf *restrict acc, float *restrict O, const float *next_k, int64_t next_len) {
    const int64_t padded = (len + W - 1) / W * W;
    if (len <= SHORT) score_keys(Q, K, V, len, group, nd, scale, scores, stride, 1);
    else score_keys(Q, K, V, len, group, nd, scale, scores, stride, 0);
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * stride, top = s[0], total = 0.f;
        for (int64_t j = 1; j < len; j++) top = s[j] > top ? s[j] : top;
        /* the tail up to a whole vector: finite and far below the top, so its exp is 0 */
        for (int64_t j = len; j < padded; j++) s[j] = top - 200.f;
        for (int64_t j = 0; j < padded; j++) { s[j] = expf(s[j] - top); total += s[j]; }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; j++) s[j] *= inv;
    }
    if (next_len <= SHORT) sum_values(V, len, group, nd, scores, stride, acc, next_k, next_len, 1);
    else sum_values(V, len, group, nd, scores, stride, acc, next_k, next_len, 0);
    memcpy(O, acc, sizeof(float) * group * nd * W);
}

/* q: [n, heads, d] with rows q_stride floats apart; ck, cv: [slots, kvh, cap, d]; row r attends
   positions [0, lengths[r]) of slot slots[r]; out: [n, heads, d]. Query head h reads K/V head
   h / (heads / kvh). new_k, new_v ([n, kvh, d], rows kv_stride floats apart), when given, are the
   rows' K/V of this step: each is written at position lengths[r] - 1 just before that row's
   attention reads it (the line is read next, where a separate scatter would fetch it twice).
   Returns nonzero when a buffer could not be allocated. */
int agentrl_decode_attention(const float *restrict q, int64_t q_stride, const float *new_k, const float *new_v,
                             int64_t kv_stride, float *ck, float *cv,
                             const int64_t *restrict slots, const int64_t *restrict lengths,
                             int64_t n, int64_t heads, int64_t kvh, int64_t cap, int64_t d, float scale,
                             float *restrict out, int threads) {
    const int64_t group = heads / kvh, nd = d / W;
    int64_t longest = 1;
    for (int64_t r = 0; r < n; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    const int64_t stride = (longest + W - 1) / W * W;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
    float *scores = malloc(sizeof(float) * group * stride);
    vf *acc = malloc(sizeof(vf) * group * nd);
    if (!scores || !acc) {
        #pragma omp atomic write
        failed = 1;
    }
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < n * kvh; item++) {
        if (!scores || !acc) continue;
        const int64_t r = item / kvh, h = item % kvh, len = lengths[r];
        float *K = ck + (slots[r] * kvh + h) * cap * d, *V = cv + (slots[r] * kvh + h) * cap * d;
        if (new_k) {
            memcpy(K + (len - 1) * d, new_k + r * kv_stride + h * d, sizeof(float) * d);
            memcpy(V + (len - 1) * d, new_v + r * kv_stride + h * d, sizeof(float) * d);
        }
        const float *Q = q + r * q_stride + h * group * d;
        float *O = out + (r * heads + h * group) * d;
        const int64_t nr = (item + 1) / kvh, nh = (item + 1) % kvh;  /* the next item this thread takes */
        const float *next_k = item + 1 < n * kvh ? ck + (slots[nr] * kvh + nh) * cap * d : K;
        const int64_t next_len = item + 1 < n * kvh ? lengths[nr] : 0;
#ifdef AGENTRL_GROUP  /* the library built for one model's shape: its loops with constant bounds */
        if (group == AGENTRL_GROUP && nd == AGENTRL_ND)
            attend_item(Q, K, V, len, AGENTRL_GROUP, AGENTRL_ND, scale, scores, stride, acc, O, next_k, next_len);
        else
#endif
            attend_item(Q, K, V, len, group, nd, scale, scores, stride, acc, O, next_k, next_len);
    }
    free(scores);
    free(acc);
    }
    return failed;
}

/* The small elementwise steps around the linear layers, one pass each, rows over the threads. */

/* hidden += delta (when delta is given), then out = hidden / sqrt(mean(hidden^2) + eps) * weight. */
void agentrl_add_rms_norm(float *restrict hidden, const float *restrict delta, const float *restrict weight,
                          int64_t rows, int64_t width, float eps, float *restrict out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *x = hidden + r * width, *o = out + r * width, total = 0.f;
        if (delta) {
            const float *y = delta + r * width;
            for (int64_t i = 0; i < width; i++) x[i] += y[i];
        }
        for (int64_t i = 0; i < width; i++) total += x[i] * x[i];
        const float inv = 1.f / sqrtf(total / (float)width + eps);
        for (int64_t i = 0; i < width; i++) o[i] = x[i] * inv * weight[i];
    }
}

/* out = silu(gate) * up; gate and up: [rows, width] with rows `stride` floats apart (the two
   halves of one fused product's output, or two tensors of their own); out: [rows, width]. */
void agentrl_silu_mul(const float *restrict gate, const float *restrict up, int64_t rows, int64_t width, int64_t stride,
                      float *restrict out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * stride, *u = up + r * stride;
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* x: [rows, heads, d] with rows row_stride floats apart, rotated in place at each row's position:
   the first half of each head becomes x1 * cos - x2 * sin, the second x2 * cos + x1 * sin
   (cos, sin: [positions, d]). */
void agentrl_rotary(float *restrict x, int64_t row_stride, const float *restrict cos_table, const float *restrict sin_table,
                    const int64_t *restrict positions, int64_t rows, int64_t heads, int64_t d, int threads) {
    const int64_t half = d / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * d, *s = sin_table + positions[r] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * row_stride + h * d, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
    }
}
"""

_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=gnu11"]


class DecodeKernel:
    """The loaded library: ``__call__`` attends ``n`` decode rows of one layer into ``out``."""

    def __init__(self, library: ctypes.CDLL, openmp: bool):
        self._library = library  # kept alive with the function
        self._fn = library.agentrl_decode_attention
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, size, pointer, pointer, size] + [pointer] * 4 + [size] * 5 + [ctypes.c_float, pointer, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._add_rms_norm = library.agentrl_add_rms_norm
        self._add_rms_norm.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_float, pointer, ctypes.c_int]
        self._silu_mul = library.agentrl_silu_mul
        self._silu_mul.argtypes = [pointer, pointer, size, size, size, pointer, ctypes.c_int]
        self._rotary = library.agentrl_rotary
        self._rotary.argtypes = [pointer, size] + [pointer] * 3 + [size] * 3 + [ctypes.c_int]
        for fn in (self._add_rms_norm, self._silu_mul, self._rotary):
            fn.restype = None
        self.openmp = openmp

    @staticmethod
    def serves(cache_k: torch.Tensor) -> bool:
        """A contiguous CPU fp32 cache (queries come in its dtype) with a head size the vectors divide."""
        return (
            cache_k.device.type == "cpu"
            and cache_k.dtype == torch.float32
            and cache_k.is_contiguous()
            and cache_k.shape[-1] % WIDTH == 0
        )

    def __call__(self, query: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float, out: torch.Tensor, new_key: torch.Tensor | None = None,
                 new_value: torch.Tensor | None = None) -> None:
        """query, out: [n, heads, head_dim]; cache_k, cache_v: [slots, kv_heads, capacity, head_dim];
        slots, lengths: [n] int64 (row i attends positions [0, lengths[i]) of slot slots[i]).
        new_key, new_value ([n, kv_heads, head_dim]): this step's K/V, written at each row's last
        position first. Rows of query, new_key and new_value may be strided (views into one fused
        projection's output); each row's heads must be contiguous."""
        query = _rows(query)
        n, heads, head_dim = query.shape
        _, kv_heads, capacity, _ = cache_k.shape
        if not (out.is_contiguous() and cache_k.is_contiguous() and cache_v.is_contiguous() and slots.is_contiguous()
                and lengths.is_contiguous()):
            raise ValueError("decode kernel: out, the caches, slots and lengths must be contiguous")
        kv_stride = 0
        if new_key is not None:
            new_key, new_value = _rows(new_key), _rows(new_value)
            if new_key.stride(0) != new_value.stride(0):
                new_key, new_value = new_key.contiguous(), new_value.contiguous()
            kv_stride = new_key.stride(0)
        failed = self._fn(query.data_ptr(), query.stride(0), None if new_key is None else new_key.data_ptr(),
                          None if new_value is None else new_value.data_ptr(), kv_stride, cache_k.data_ptr(), cache_v.data_ptr(),
                          slots.data_ptr(), lengths.data_ptr(), n, heads, kv_heads, capacity, head_dim, scale, out.data_ptr(),
                          self._threads())
        if failed:
            raise MemoryError("decode kernel: could not allocate its scores buffer")

    # The elementwise steps of the fast forward (``_packed.PackedDecoderForward``) on contiguous
    # CPU fp32 tensors: one pass each instead of several torch ops.

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``hidden += delta`` in place (when given), then the RMS norm of ``hidden`` ([rows, width]) times ``weight``."""
        _check(hidden, weight, *(() if delta is None else (delta,)))
        out = torch.empty_like(hidden)
        rows, width = hidden.shape
        self._add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), rows, width, eps,
                           out.data_ptr(), self._threads())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` ([rows, width] each, CPU float32, each row contiguous, the two with the
        same row stride: views into one fused product's output, or tensors of their own), a new tensor."""
        if not (gate.shape == up.shape and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
                and gate.stride(0) == up.stride(0)):
            gate, up = gate.contiguous(), up.contiguous()
        _check(gate, up, rows_only=True)
        rows, width = gate.shape
        out = gate.new_empty((rows, width))
        self._silu_mul(gate.data_ptr(), up.data_ptr(), rows, width, gate.stride(0), out.data_ptr(), self._threads())
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of ``x`` ([rows, heads, head_dim]; its rows may be strided, each row's
        heads contiguous) in place, row i at ``positions[i]`` of the ``cos``/``sin`` tables ([positions, head_dim])."""
        _check(cos, sin)
        if not _heads_contiguous(x):
            raise ValueError("decode kernel: rotary needs float32 rows whose heads are contiguous")
        positions = positions.to(torch.int64).contiguous()  # the same tensor when it already is
        rows, heads, head_dim = x.shape
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), rows, heads, head_dim,
                     self._threads())
        return x

    def _threads(self) -> int:
        return torch.get_num_threads() if self.openmp else 1


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Whether ``x`` ([rows, heads, head_dim]) is CPU float32 with each row's heads contiguous
    (its rows may be strided)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where each row's heads lie contiguous (``_heads_contiguous``), else a contiguous copy."""
    return x if _heads_contiguous(x) else x.contiguous()


def _check(*tensors: torch.Tensor, rows_only: bool = False) -> None:
    """CPU float32, contiguous (``rows_only``: each row contiguous, the rows may be strided)."""
    for t in tensors:
        laid_out = t.stride(-1) == 1 if rows_only else t.is_contiguous()
        if t.device.type != "cpu" or t.dtype != torch.float32 or not laid_out:
            raise ValueError(f"decode kernel: needs contiguous CPU float32 tensors, got {t.dtype} on {t.device}, contiguous={t.is_contiguous()}")


_lock = threading.Lock()
_loaded: dict[tuple[int, int] | None, DecodeKernel | None] = {}  # by shape, filled by kernel()


def kernel(shape: tuple[int, int] | None = None) -> DecodeKernel | None:
    """The compiled library, or None. ``shape``: (query heads per K/V head, head size) of the model
    it serves, whose decode attention it is then compiled for (any shape still runs, through
    the generic loops). Built on the first call of the process for that shape (cached on disk)."""
    if shape is not None and shape[1] % WIDTH:
        shape = None  # a head size the vectors do not divide: the kernel's attention is not used
    if shape in _loaded:
        return _loaded[shape]
    with _lock:
        if shape not in _loaded:
            _loaded[shape] = _load(shape)
    return _loaded[shape]


def _load(shape: tuple[int, int] | None) -> DecodeKernel | None:
    if os.environ.get("AGENTRL_DECODE_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or platform.system() != "Linux":
        logger.info("decode attention through torch: no C compiler (or not Linux) for the native kernel")
        return None
    openmp = _torch_uses_libgomp()
    link = ["-fopenmp", "-lm"] if openmp else ["-lm"]  # -lm: the vector exponentials (libmvec)
    path = None
    try:
        defines = [] if shape is None else [f"-DAGENTRL_GROUP={shape[0]}", f"-DAGENTRL_ND={shape[1] // WIDTH}"]
        path = _build(compiler, defines, link)
        return DecodeKernel(ctypes.CDLL(str(path)), openmp)
    except (OSError, subprocess.SubprocessError) as exc:
        if path is not None:
            path.unlink(missing_ok=True)  # built but not loadable: the next process builds it again
        logger.info("decode attention through torch: the native kernel did not build or load: %s", exc)
        return None


def _torch_uses_libgomp() -> bool:
    """Whether torch's own OpenMP runtime is libgomp, which the kernel's library then shares
    (the dynamic loader reuses a library already loaded under the same name)."""
    return "OpenMP" in torch.__config__.parallel_info() and any((Path(torch.__file__).parent / "lib").glob("libgomp*"))


def _build(compiler: str, defines: list[str], link: list[str]) -> Path:
    compile_flags = _COMPILE_FLAGS + defines + (["-fopenmp"] if "-fopenmp" in link else [])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, *compile_flags, *link, version, _cpu()]).encode()).hexdigest()[:16]
    directory = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl")) / "kernels"
    target = directory / f"decode_attention-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source, obj, lib = Path(work) / "decode.c", Path(work) / "decode.o", Path(work) / "decode.so"
        source.write_text(SOURCE)
        for command in ([compiler, *compile_flags, "-c", str(source), "-o", str(obj)], [compiler, "-shared", str(obj), "-o", str(lib), *link]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()[:2000]}")
        os.replace(lib, target)  # atomic: a process building the same key at once writes the same bytes
    return target


def _cpu() -> str:
    """The CPU's model and feature flags (``-march=native`` compiles for them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))
