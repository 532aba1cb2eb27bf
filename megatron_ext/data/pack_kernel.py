"""Compiled pack-planning loops (C through ctypes; pure numpy + stdlib, never imports megatron).

In Python, :mod:`~megatron_ext.data.pack_planning` costs about 2 us per piece (0.6 s at 200k
documents, 25x Megatron's whole ``GPTDataset`` build); these C loops (best-fit, next-fit, the pack
shuffle's regrouping) take tens of nanoseconds and give the *same* packs. Best-fit, capacity 8,
one window, lengths ``[5, 6, 3, 2]``: longest first 6 opens pack 0 (room 2), 5 opens pack 1
(room 3), 3 -> smallest room >= 3 is pack 1 (room 0, leaves the buckets), 2 -> pack 0. Order
``[1, 3, 0, 2]``, offsets ``[0, 2, 4]``.

Legend: Q pieces, P packs.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess

import numpy as np

from megatron_ext.common.safe_files import create_temp, put_in_place

logger = logging.getLogger(__name__)

#: Bumped with any change of the functions' contract (part of the library's file name).
KERNEL_VERSION = 1
_FLAGS = ("-O2", "-std=c99", "-shared", "-fPIC")

# best_fit: open packs bucketed by remaining room (integers 1..capacity). A 64-ary bitmap tree
# over room values finds the smallest room >= the piece's length in a few word operations (ctz;
# two levels up to capacity 4096, three up to 262144); each bucket is a leftist heap of pack ids,
# so ties go to the oldest pack: the (room, pack id) order of the Python bisect version. Full
# packs (room 0) leave the buckets (pieces have >= 1 token). Every buffer, scratch included, is a
# numpy array passed in: the C code allocates nothing.
_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int64_t i64;
typedef uint64_t u64;

/* 64-ary bitmap tree over 0..nbits-1: level 0 has one bit per value, level l+1 one bit per
   non-zero word of level l; the top level is one word. */
typedef struct { u64 *w[12]; i64 nw[12]; int nlev; } tree_t;

i64 mx_tree_words(i64 nbits) {
    i64 total = 0;
    do { nbits = (nbits + 63) >> 6; total += nbits; } while (nbits > 1);
    return total;
}

static void tree_init(tree_t *t, u64 *bits, i64 nbits) {
    t->nlev = 0;
    do {
        nbits = (nbits + 63) >> 6;
        t->w[t->nlev] = bits; t->nw[t->nlev] = nbits; t->nlev++; bits += nbits;
    } while (nbits > 1);
}

static void tree_set(tree_t *t, i64 x) {
    for (int l = 0; l < t->nlev; l++) {
        u64 *word = t->w[l] + (x >> 6);
        u64 was = *word;
        *word = was | (1ULL << (x & 63));
        if (was) return;
        x >>= 6;
    }
}

static void tree_clear(tree_t *t, i64 x) {
    for (int l = 0; l < t->nlev; l++) {
        u64 *word = t->w[l] + (x >> 6);
        *word &= ~(1ULL << (x & 63));
        if (*word) return;
        x >>= 6;
    }
}

/* Smallest set value >= x, or -1. */
static i64 tree_next(const tree_t *t, i64 x) {
    int l = 0;
    for (;;) {
        i64 w = x >> 6;
        if (w >= t->nw[l]) return -1;
        u64 m = t->w[l][w] & (~0ULL << (x & 63));
        if (m) { x = (w << 6) | __builtin_ctzll(m); break; }
        if (l + 1 == t->nlev) return -1;
        x = w + 1; l++;
    }
    while (l > 0) { l--; x = (x << 6) | __builtin_ctzll(t->w[l][x]); }
    return x;
}

/* Leftist min-heap of pack ids (the node index is the key): meld is O(log n) worst case. */
static i64 meld(i64 a, i64 b, i64 *hl, i64 *hr, i64 *hs) {
    if (a < 0) return b;
    if (b < 0) return a;
    if (b < a) { i64 t = a; a = b; b = t; }
    hr[a] = meld(hr[a], b, hl, hr, hs);
    if (hl[a] < 0 || hs[hl[a]] < hs[hr[a]]) { i64 t = hl[a]; hl[a] = hr[a]; hr[a] = t; }
    hs[a] = (hr[a] < 0 ? 0 : hs[hr[a]]) + 1;
    return a;
}

/* Stable sort of idx[0..n) by len[idx] descending: LSD radix sort, 8-bit digits, of the key
   capacity - len (0..capacity-1 ascending); passes where every key shares the digit are skipped.
   Tiny inputs use insertion sort. */
static void sort_desc(const i64 *len, i64 *idx, i64 *tmp, i64 n, i64 capacity) {
    if (n < 64) {  /* insertion sort: cheaper than 256-entry histograms for tiny windows */
        for (i64 i = 1; i < n; i++) {
            i64 v = idx[i], j = i;
            while (j > 0 && len[idx[j - 1]] < len[v]) { idx[j] = idx[j - 1]; j--; }
            idx[j] = v;
        }
        return;
    }
    i64 cnt[256], *src = idx, *dst = tmp;
    for (int shift = 0; ((capacity - 1) >> shift) > 0; shift += 8) {
        for (int d = 0; d < 256; d++) cnt[d] = 0;
        for (i64 i = 0; i < n; i++) cnt[((capacity - len[src[i]]) >> shift) & 255]++;
        int d0 = ((capacity - len[src[0]]) >> shift) & 255;
        if (cnt[d0] == n) continue;
        for (i64 d = 0, sum = 0; d < 256; d++) { i64 c = cnt[d]; cnt[d] = sum; sum += c; }
        for (i64 i = 0; i < n; i++) dst[cnt[((capacity - len[src[i]]) >> shift) & 255]++] = src[i];
        i64 *t = src; src = dst; dst = t;
    }
    if (src != idx) for (i64 i = 0; i < n; i++) idx[i] = src[i];
}

/* Windowed best-fit-decreasing; returns the number of packs P (offsets_P1[0..P] written).
   len_Q[i] in 1..capacity; scratch holds 8 * min(window, n) i64; bucket holds capacity + 1
   entries, all -1; bits holds mx_tree_words(capacity) zero words (bit r - 1 = room r: a room 0
   is never searched, and capacity 4096 fits two levels). Both are left as given. */
i64 mx_best_fit(const i64 *len_Q, i64 n, i64 capacity, i64 window, i64 *order_Q,
                i64 *offsets_P1, i64 *scratch, i64 *bucket, u64 *bits) {
    i64 wmax = window < n ? window : n;
    i64 *by_len = scratch, *tmp = by_len + wmax, *pack_of = tmp + wmax, *room = pack_of + wmax;
    i64 *hl = room + wmax, *hr = hl + wmax, *hs = hr + wmax, *fill = hs + wmax;
    tree_t t;
    tree_init(&t, bits, capacity);
    i64 P = 0;
    offsets_P1[0] = 0;
    for (i64 w0 = 0; w0 < n; w0 += window) {
        i64 w = n - w0 < window ? n - w0 : window, packs = 0;
        const i64 *lens = len_Q + w0;
        for (i64 i = 0; i < w; i++) by_len[i] = i;
        sort_desc(lens, by_len, tmp, w, capacity);
        for (i64 k = 0; k < w; k++) {
            /* Every open pack already holds a piece >= need: when need > capacity / 2 none
               has room for it, so the search is skipped. */
            i64 need = lens[by_len[k]], r = 2 * need > capacity ? -1 : tree_next(&t, need - 1) + 1, p;
            if (r <= 0) {
                p = packs++;
                room[p] = capacity - need;
                fill[p] = 1;
            } else {
                p = bucket[r];  /* a leftist node without a left child has no right one */
                bucket[r] = hl[p] < 0 ? -1 : meld(hl[p], hr[p], hl, hr, hs);
                if (bucket[r] < 0) tree_clear(&t, r - 1);
                room[p] = r - need;
                fill[p]++;
            }
            pack_of[k] = p;
            if (room[p] > 0) {
                i64 b = room[p];
                hl[p] = hr[p] = -1;
                hs[p] = 1;
                if (bucket[b] < 0) {
                    tree_set(&t, b - 1);
                    bucket[b] = p;
                } else {
                    bucket[b] = meld(bucket[b], p, hl, hr, hs);
                }
            }
        }
        for (i64 p = 0; p < packs; p++) {  /* pack offsets; fill[p] becomes p's write cursor */
            offsets_P1[P + p + 1] = offsets_P1[P + p] + fill[p];
            fill[p] = offsets_P1[P + p];
        }
        for (i64 k = 0; k < w; k++) order_Q[fill[pack_of[k]]++] = w0 + by_len[k];
        for (i64 p = 0; p < packs; p++) {
            if (room[p] > 0) { bucket[room[p]] = -1; tree_clear(&t, room[p] - 1); }
        }
        P += packs;
    }
    return P;
}

/* Per-piece values (itemsize bytes each) of packs order_P[0], order_P[1], ...: one run each. */
void mx_gather_packs(const char *values_Q, const i64 *offsets_P1, const i64 *order_P, i64 P,
                     i64 itemsize, char *out_Q) {
    for (i64 i = 0; i < P; i++) {
        i64 n = (offsets_P1[order_P[i] + 1] - offsets_P1[order_P[i]]) * itemsize;
        memcpy(out_Q, values_Q + offsets_P1[order_P[i]] * itemsize, (size_t)n);
        out_Q += n;
    }
}

/* Next-fit in the given order; returns P (offsets_P1[0..P] written, n + 1 entries given). */
i64 mx_next_fit(const i64 *len_Q, i64 n, i64 capacity, i64 *offsets_P1) {
    i64 P = 0, cur = 0;
    offsets_P1[0] = 0;
    for (i64 i = 0; i < n; i++) {
        if (i > offsets_P1[P] && cur + len_Q[i] > capacity) { offsets_P1[++P] = i; cur = 0; }
        cur += len_Q[i];
    }
    if (n > 0) offsets_P1[++P] = n;
    return P;
}
"""

_I64 = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
_U64 = np.ctypeslib.ndpointer(dtype=np.uint64, flags="C_CONTIGUOUS")
_BYTES = np.ctypeslib.ndpointer(flags="C_CONTIGUOUS")  # any dtype; the itemsize is passed


def library_name() -> str:
    """File name of the compiled library: changes with the source, flags and machine type."""
    key = "\0".join([_SOURCE, *_FLAGS, str(KERNEL_VERSION), platform.machine(), os.name])
    return f"pack_kernel-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def default_kernel_dir() -> str:
    """``$MEGATRON_EXT_KERNEL_DIR``, else ``$XDG_CACHE_HOME/megatron_ext`` (~/.cache)."""
    # No -march in _FLAGS: a shared home directory serves every node of one architecture.
    if os.environ.get("MEGATRON_EXT_KERNEL_DIR"):
        return os.environ["MEGATRON_EXT_KERNEL_DIR"]
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache_home, "megatron_ext")


def compile_library(directory: str, compiler: str | None = None) -> str:
    """Compiles the kernel into ``directory`` unless already there; returns the library path.

    Called only when an index is built (a cache miss); later processes only ``dlopen`` it.

    Raises:
        OSError: No compiler, an unwritable directory, or a failed compile (stderr included).
    """
    path = os.path.join(directory, library_name())
    if os.path.isfile(path):
        return path
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler {cc!r} on PATH")
    os.makedirs(directory, exist_ok=True)
    # Renamed into place from a temporary file beside it, named for this process: concurrent
    # ranks each publish a complete library, a killed compile is cleaned.
    fd, tmp = create_temp(path)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *_FLAGS, "-x", "c", "-", "-o", tmp],
            input=_SOURCE.encode(),
            capture_output=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.decode(errors='replace')[-2000:]}")
        os.chmod(tmp, 0o755)
        put_in_place(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_library(path: str) -> ctypes.CDLL:
    """Opens a library made by :func:`compile_library` and declares its functions' types."""
    lib = ctypes.CDLL(path)
    i64 = ctypes.c_int64
    lib.mx_tree_words.argtypes, lib.mx_tree_words.restype = [i64], i64
    lib.mx_best_fit.argtypes = [_I64, i64, i64, i64, _I64, _I64, _I64, _I64, _U64]
    lib.mx_best_fit.restype = i64
    lib.mx_next_fit.argtypes, lib.mx_next_fit.restype = [_I64, i64, i64, _I64], i64
    lib.mx_gather_packs.argtypes = [_BYTES, _I64, _I64, i64, i64, _BYTES]
    lib.mx_gather_packs.restype = None
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on the first call of a machine), or None without a compiler.

    Cached per process: one compile attempt, one warning.
    """
    try:
        return load_library(compile_library(default_kernel_dir()))
    except (OSError, subprocess.SubprocessError) as err:
        logger.warning(
            "pack planning: C kernel unavailable (%s); using the Python loops (same packs; "
            "planning ~40x slower, a cache miss at 1M documents takes seconds). Set CC to a C "
            "compiler or MEGATRON_EXT_KERNEL_DIR to a writable directory.",
            err,
        )
        return None


def best_fit(
    lib: ctypes.CDLL, piece_len_Q: np.ndarray, capacity: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(order_Q, pack_offsets_P1)`` of windowed best-fit-decreasing (lengths in 1..capacity)."""
    len_Q = np.ascontiguousarray(piece_len_Q, dtype=np.int64)
    n = len_Q.size
    order_Q = np.empty(n, dtype=np.int64)
    offsets_P1 = np.empty(n + 1, dtype=np.int64)
    scratch = np.empty(8 * max(min(window, n), 1), dtype=np.int64)
    bucket = np.full(capacity + 1, -1, dtype=np.int64)
    bits = np.zeros(lib.mx_tree_words(capacity), dtype=np.uint64)
    packs = lib.mx_best_fit(len_Q, n, capacity, window, order_Q, offsets_P1, scratch, bucket, bits)
    return order_Q, offsets_P1[: packs + 1].copy()


def next_fit(lib: ctypes.CDLL, piece_len_Q: np.ndarray, capacity: int) -> np.ndarray:
    """Pack offsets of next-fit in the given order (lengths in 1..capacity)."""
    len_Q = np.ascontiguousarray(piece_len_Q, dtype=np.int64)
    offsets_P1 = np.empty(len_Q.size + 1, dtype=np.int64)
    packs = lib.mx_next_fit(len_Q, len_Q.size, capacity, offsets_P1)
    return offsets_P1[: packs + 1].copy()


def gather_packs(
    lib: ctypes.CDLL, values_Q: np.ndarray, pack_offsets_P1: np.ndarray, order_P: np.ndarray
) -> np.ndarray:
    """Per-piece ``values_Q`` regrouped pack by pack in the order ``order_P`` (a permutation of
    the packs; the caller checks it)."""
    values_Q = np.ascontiguousarray(values_Q)
    out_Q = np.empty_like(values_Q)
    lib.mx_gather_packs(
        values_Q,
        np.ascontiguousarray(pack_offsets_P1, dtype=np.int64),
        np.ascontiguousarray(order_P, dtype=np.int64),
        order_P.size,
        values_Q.itemsize,
        out_Q,
    )
    return out_Q
