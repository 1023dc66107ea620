// The CUDA backend's kernels, compiled at start with NVRTC (see kernels.rs).
//
// Every kernel matches the CPU reference (ops/src/cpu/kernels.rs, ops/src/math.rs)
// operation for operation: it is compiled with --fmad=false so no multiply-add is
// contracted, element-wise optimizer math runs in double and rounds each stored value to
// float once, and sums are taken in the reference's order. Every kernel uses a
// grid-stride loop, so any grid size covers any length.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); \
         i += (u64)gridDim.x * blockDim.x)

// dst = src, or dst += src. dst and src may be the same buffer.
extern "C" __global__ void ov_add(float* dst, const float* src, u64 n, int accumulate) {
    GRID_STRIDE(i, n) {
        float v = src[i];
        dst[i] = accumulate ? dst[i] + v : v;
    }
}

// One copy of a pack or unpack: dst[i] = (accumulate ? dst[i] + a[i] : a[i]) (+ b[i]).
struct Seg {
    const float* a;
    const float* b;  // null: no second source
    float* dst;
    u64 len;
};

#define OV_MAX_SEGS 32

// Up to OV_MAX_SEGS copies with disjoint destinations, one per blockIdx.y.
struct Segs {
    Seg s[OV_MAX_SEGS];
    u64 count;
    int accumulate;
    int pad;
};

extern "C" __global__ void ov_segments(const Segs p) {
    if ((u64)blockIdx.y >= p.count) return;
    const Seg s = p.s[blockIdx.y];
    GRID_STRIDE(i, s.len) {
        float v = p.accumulate ? s.dst[i] + s.a[i] : s.a[i];
        if (s.b != 0) v = v + s.b[i];
        s.dst[i] = v;
    }
}

// Round to nearest bfloat16, ties to even (ops::math::round_bf16); NaN stays a quiet NaN.
__device__ __forceinline__ u16 ov_f2bf(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

extern "C" __global__ void ov_to_bf16(u16* dst, const float* src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = ov_f2bf(src[i]); }
}

extern "C" __global__ void ov_from_bf16(float* dst, const u16* src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = __uint_as_float(((u32)src[i]) << 16); }
}

// The arithmetic half of a copy-transport stage (Kernel::Combine, the CPU's
// kernels::combine): dst[e] = sum over members j = 0..size in order of x_j[e], where
// x_index = own[e] (own is already offset to the member's chunk) and x_j =
// recv[slot(j) * stride + e] for the others (slot: the other members in order, skipping
// index; stride is n for a receive buffer, the distance between the peers' slots when
// the combine reads a copy ring in place). The sum starts from member 0's value (not from 0, which would turn -0.0 into
// +0.0) and adds in float; with bf16 every x_j is first rounded to bfloat16 (ties to
// even); avg then divides by size (IEEE division: NVRTC's default -prec-div=true).
// Each element is read completely before it is written, so dst may be own, or recv
// in a group of two.
extern "C" __global__ void ov_combine(float* dst, const float* own, const float* recv,
                                      u64 n, u64 stride, u32 size, u32 index, int bf16,
                                      int avg) {
    GRID_STRIDE(e, n) {
        float acc = 0.0f;
        for (u32 j = 0; j < size; ++j) {
            float x = j == index ? own[e] : recv[(u64)(j < index ? j : j - 1) * stride + e];
            if (bf16) x = __uint_as_float(((u32)ov_f2bf(x)) << 16);
            acc = j == 0 ? x : acc + x;
        }
        if (avg) acc = acc / (float)size;
        dst[e] = acc;
    }
}

// ov_combine on float4s: the same operations, element by element, in the same order;
// n4 = n / 4, stride4 = stride / 4, and every pointer and the stride are multiples of 4
// elements (checked by the host). Used for the copy transport's combines, which are memory-bound:
// one 16-byte load per operand per thread instead of four 4-byte ones.
__device__ __forceinline__ float ov_combine_round(float x, int bf16) {
    return bf16 ? __uint_as_float(((u32)ov_f2bf(x)) << 16) : x;
}
// The element-wise steps of the vector combines, one float at a time as the scalar one.
__device__ __forceinline__ float4 ov_round4(float4 x, int bf16) {
    x.x = ov_combine_round(x.x, bf16);
    x.y = ov_combine_round(x.y, bf16);
    x.z = ov_combine_round(x.z, bf16);
    x.w = ov_combine_round(x.w, bf16);
    return x;
}
__device__ __forceinline__ float4 ov_add4(float4 a, float4 b) {
    a.x = a.x + b.x;
    a.y = a.y + b.y;
    a.z = a.z + b.z;
    a.w = a.w + b.w;
    return a;
}
__device__ __forceinline__ float4 ov_div4(float4 a, u32 size) {
    a.x = a.x / (float)size;
    a.y = a.y / (float)size;
    a.z = a.z / (float)size;
    a.w = a.w / (float)size;
    return a;
}
extern "C" __global__ void ov_combine4(float4* dst, const float4* own, const float4* recv,
                                       u64 n4, u64 stride4, u32 size, u32 index, int bf16,
                                       int avg) {
    GRID_STRIDE(e, n4) {
        float4 acc;
        for (u32 j = 0; j < size; ++j) {
            const float4 x = ov_round4(
                j == index ? own[e] : recv[(u64)(j < index ? j : j - 1) * stride4 + e], bf16);
            acc = j == 0 ? x : ov_add4(acc, x);
        }
        dst[e] = avg ? ov_div4(acc, size) : acc;
    }
}

// Cache-streaming (evict-first) 16-byte loads and stores: what a combine reads and
// writes is touched once, so it should not push out of L2 the tiles the backward's GEMMs
// running beside it reuse.
__device__ __forceinline__ float4 ov_ld_cs(const float4* p) {
    float4 v;
    asm("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ void ov_st_cs(float4* p, float4 v) {
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
                 "f"(v.z), "f"(v.w)
                 : "memory");
}

// ov_combine4 with cache-streaming loads and stores, and for a group of two both
// operands loaded before either is used (two loads in flight per thread): the same
// operations in the same order, so the same bits.
extern "C" __global__ void ov_combine4s(float4* dst, const float4* own, const float4* recv,
                                        u64 n4, u64 stride4, u32 size, u32 index, int bf16,
                                        int avg) {
    GRID_STRIDE(e, n4) {
        float4 acc;
        if (size == 2) {
            // Member 0 and member 1; the other member's data is the first slot of recv.
            const float4 a = ov_round4(ov_ld_cs(index == 0 ? own + e : recv + e), bf16);
            const float4 b = ov_round4(ov_ld_cs(index == 1 ? own + e : recv + e), bf16);
            acc = ov_add4(a, b);
        } else {
            for (u32 j = 0; j < size; ++j) {
                const float4 x = ov_round4(
                    ov_ld_cs(j == index ? own + e
                                        : recv + (u64)(j < index ? j : j - 1) * stride4 + e),
                    bf16);
                acc = j == 0 ? x : ov_add4(acc, x);
            }
        }
        ov_st_cs(dst + e, avg ? ov_div4(acc, size) : acc);
    }
}

// ov_combine4 for a capped grid (`[overlap] combine_ctas`): the same operations in the
// same order, but each thread keeps OV_COMBINE_UNROLL vectors of one operand in flight
// (loads issued before any is used), so a few CTAs of OV_COMBINE_WIDE threads pull
// close to an SM's share of memory bandwidth instead of one 16-byte load per thread.
#define OV_COMBINE_UNROLL 8
#define OV_COMBINE_WIDE 512
extern "C" __global__ void __launch_bounds__(OV_COMBINE_WIDE)
ov_combine4n(float4* dst, const float4* own, const float4* recv, u64 n4, u64 stride4,
             u32 size, u32 index, int bf16, int avg) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 base = (u64)blockIdx.x * blockDim.x + threadIdx.x; base < n4;
         base += stride * OV_COMBINE_UNROLL) {
        float4 acc[OV_COMBINE_UNROLL];
        for (u32 j = 0; j < size; ++j) {
            const float4* src =
                j == index ? own : recv + (u64)(j < index ? j : j - 1) * stride4;
            float4 x[OV_COMBINE_UNROLL];
#pragma unroll
            for (int u = 0; u < OV_COMBINE_UNROLL; ++u) {
                const u64 e = base + (u64)u * stride;
                if (e < n4) x[u] = src[e];
            }
#pragma unroll
            for (int u = 0; u < OV_COMBINE_UNROLL; ++u) {
                const float4 r = ov_round4(x[u], bf16);
                acc[u] = j == 0 ? r : ov_add4(acc[u], r);
            }
        }
#pragma unroll
        for (int u = 0; u < OV_COMBINE_UNROLL; ++u) {
            const u64 e = base + (u64)u * stride;
            if (e < n4) dst[e] = avg ? ov_div4(acc[u], size) : acc[u];
        }
    }
}

// Whether a float is neither NaN nor infinite (exponent bits not all ones).
__device__ __forceinline__ int ov_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The guard of an optimizer wrapped in Kernel::IfFinite: null (unguarded), or the
// one-float squared global norm; a non-finite norm skips the step (the CPU backend's
// IfFinite: parameters and optimizer state untouched). Read by every thread from device
// memory: no host synchronisation, and the unguarded path only tests a null pointer.
__device__ __forceinline__ int ov_skip(const float* guard) {
    return guard != 0 && !ov_finite(guard[0]);
}

#define OV_REDUCE_THREADS 256

// The global norm's buffers (Kernel::SumSquares, Kernel::Clip): `len` floats at `p`.
struct Span {
    float* p;
    u64 len;
};

#define OV_MAX_SPANS 32

// Up to OV_MAX_SPANS buffers, one per blockIdx.y.
struct Spans {
    Span s[OV_MAX_SPANS];
    u64 count;
};

// The sum of the block's OV_REDUCE_THREADS values `v` by a fixed tree (halving strides),
// returned to thread 0. Every thread of the block must call it.
__device__ __forceinline__ double ov_block_sum(double v) {
    __shared__ double sh[OV_REDUCE_THREADS];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (u32 s = OV_REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    return sh[0];
}

// Kernel::SumSquares, pass 1, over up to OV_MAX_SPANS spans cut into chunks of
// OV_SUMSQ_CHUNK floats: span y's chunks are blocks block0[y] .. block0[y+1] - 1 of the
// grid, so every block has a chunk and the work follows the lengths. Block b writes the
// sum of squares of its chunk to partial[b], in double: thread t takes, on a whole
// 16-byte aligned chunk, the float4s t, t + 256, t + 512, t + 768 of it (all four loads
// issued first, then each float4's squares in element order), otherwise the floats t,
// t + 256, ... of the chunk (a square of a float is exact in double; only the additions
// round); then the block adds its threads' sums by ov_block_sum's fixed tree. No
// atomics: the same lengths give the same blocks and the same bits.
#define OV_SUMSQ_CHUNK (OV_REDUCE_THREADS * 16)

struct SumsqSpans {
    Span s[OV_MAX_SPANS];
    u64 block0[OV_MAX_SPANS];
    u64 count;
};

__device__ __forceinline__ void ov_sq4(double& acc, float4 v) {
    acc += (double)v.x * (double)v.x;
    acc += (double)v.y * (double)v.y;
    acc += (double)v.z * (double)v.z;
    acc += (double)v.w * (double)v.w;
}

extern "C" __global__ void ov_sumsq_spans(const SumsqSpans* __restrict__ spans, double* partial) {
    const SumsqSpans& p = *spans;
    const u64 b = blockIdx.x;
    u32 lo = 0, hi = (u32)p.count;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (p.block0[mid] <= b) lo = mid; else hi = mid;
    }
    const Span s = p.s[lo];
    const u64 start = (b - p.block0[lo]) * OV_SUMSQ_CHUNK;
    const u64 end = min(start + (u64)OV_SUMSQ_CHUNK, s.len);
    double acc = 0.0;
    if ((((u64)s.p & 15) == 0) && end - start == OV_SUMSQ_CHUNK) {
        const float4* p4 = (const float4*)(s.p + start);
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = p4[u * OV_REDUCE_THREADS + threadIdx.x];
#pragma unroll
        for (int u = 0; u < 4; ++u) ov_sq4(acc, v[u]);
    } else {
        for (u64 i = start + threadIdx.x; i < end; i += OV_REDUCE_THREADS) {
            const double x = (double)s.p[i];
            acc += x * x;
        }
    }
    double sum = ov_block_sum(acc);
    if (threadIdx.x == 0) partial[b] = sum;
}

// Kernel::SumSquares, pass 2 (one block): (*dst)[0] = the sum of partial[0..count], in
// double (thread t adds partials t, t + 256, ... in order, then ov_block_sum), rounded
// to float once (as the reference stores its f64 sum). The destination's address is
// read from device memory (uploaded with the flush, as the spans are).
extern "C" __global__ void ov_sumsq_final(const double* partial, u64 count,
                                          float* const* __restrict__ dst) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < count; i += OV_REDUCE_THREADS) acc += partial[i];
    double sum = ov_block_sum(acc);
    if (threadIdx.x == 0) (*dst)[0] = (float)sum;
}

// Kernel::Clip (ops::math::clip_factor and scale): with sq = norm[0], the squared
// global norm, f = max_norm / (sqrt(sq) + 1e-6) in double; when sq is finite and
// f < 1, every element of every span is multiplied by (float)f in float. Otherwise
// (a non-finite norm: the step is skipped; or f >= 1) nothing is written. Every thread
// reads the norm from device memory: no host synchronisation. The spans and the norm's
// address are in device memory too (uploaded with the flush).
extern "C" __global__ void ov_clip(const Spans* __restrict__ spans,
                                   const float* const* __restrict__ norm, float max_norm) {
    const Spans& p = *spans;
    if ((u64)blockIdx.y >= p.count) return;
    const float sq = (*norm)[0];
    if (!ov_finite(sq)) return;
    const double f = (double)max_norm / (sqrt((double)sq) + 1e-6);
    if (!(f < 1.0)) return;
    const float ff = (float)f;
    const Span s = p.s[blockIdx.y];
    GRID_STRIDE(i, s.len) { s.p[i] = s.p[i] * ff; }
}

// Keeps the stream busy for `nanos` nanoseconds (Kernel::Spin: stands in for device work
// such as the trainer's backward). One thread polls the global timer; it sleeps between
// polls so that it occupies one SM slot and no memory bandwidth.
extern "C" __global__ void ov_spin(u64 nanos) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanos);
}

// What a memset node of a captured graph does, as a kernel (tail_graph.rs puts it in
// the memset's place: a graph of kernels only launches in constant host time): `height`
// rows `pitch` bytes apart, each `width` elements of `esize` bytes (1, 2 or 4) set to
// the low `esize` bytes of `value`.
extern "C" __global__ void ov_fill(u64 dst, u64 pitch, u32 value, u32 esize, u64 width,
                                   u64 height) {
    GRID_STRIDE(i, width * height) {
        char* row = (char*)dst + (i / width) * pitch;
        const u64 c = i % width;
        if (esize == 4) {
            ((u32*)row)[c] = value;
        } else if (esize == 2) {
            ((u16*)row)[c] = (u16)value;
        } else {
            ((unsigned char*)row)[c] = (unsigned char)value;
        }
    }
}
