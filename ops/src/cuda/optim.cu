// The optimizer tail's batched kernels, compiled with kernels.cu (appended to it, so
// ov_skip, ov_f2bf and ov_block_sum are in scope; see optim.rs).
//
// AdamW over many tensors in one launch (ov_adamw_multi), and Muon over a batch of
// matrices of one shape (ov_mb_*: the momentum, the per-matrix norm, the working
// matrices in the Newton-Schulz precision, and the update). The element-wise math is
// ops::math::adamw's and ops::math::muon's momentum and update, operation for operation
// (double, one float rounding per stored value, --fmad=false), so the results are the
// reference's bits; only the schedule over the elements differs.

// One tensor of a multi-tensor AdamW launch: p, g, m, v hold n floats; the tensor's
// chunks are blocks block0 .. next tensor's block0 - 1 of the grid.
struct AdamwTensor {
    float* p;
    float* g;
    float* m;
    float* v;
    u64 n;
    u64 block0;
};

#define OV_ADAMW_TENSORS 256
#define OV_ADAMW_UNROLL 4
// Elements per block: every thread takes OV_ADAMW_UNROLL float4s of each operand.
#define OV_ADAMW_CHUNK (OV_REDUCE_THREADS * 4 * OV_ADAMW_UNROLL)

// AdamW's scalars, computed on the host in double exactly as ops::math::adamw does:
// decay = 1 - lr*wd, bc1 = 1 - b1^step, bc2 = 1 - b2^step. They sit in device memory
// (uploaded before each flush), so a launch captured in a graph reads the current
// step's values when it is replayed.
struct AdamwScalars {
    double b1, b2, eps, lr, decay, bc1, bc2;
};

// Up to OV_ADAMW_TENSORS tensors sharing their hyper-parameters and guard; `sc`: their
// AdamwScalars. `guard`: ov_skip. `clip_norm`, `max_norm`: ov_fused_clip. The table sits
// in device memory, uploaded with the flush's scalars (only its first `count` tensors),
// so a launch captured in a graph takes this step's buffers when it is replayed.
struct AdamwTable {
    const AdamwScalars* sc;
    const float* guard;
    u64 count;
    const float* clip_norm;
    float max_norm;
    AdamwTensor t[OV_ADAMW_TENSORS];
};

// Kernel::Clip fused into an optimizer that reads the gradient anyway (defer.rs): with
// the squared global norm at `norm` (null: no clip), the factor of ov_clip
// (ops::math::clip_factor) into *f, and whether it applies (a finite norm and a factor
// below 1). The optimizer then multiplies each gradient element by *f in float, as
// ov_clip would have, uses it, and stores it back, so the gradient buffer ends as the
// separate clip leaves it.
__device__ __forceinline__ bool ov_fused_clip(const float* norm, float max_norm, float* f) {
    if (norm == nullptr) return false;
    const float sq = norm[0];
    if (!ov_finite(sq)) return false;
    const double d = (double)max_norm / (sqrt((double)sq) + 1e-6);
    if (!(d < 1.0)) return false;
    *f = (float)d;
    return true;
}

__device__ __forceinline__ void ov_scale4(float4& g, float f) {
    g.x = g.x * f;
    g.y = g.y * f;
    g.z = g.z * f;
    g.w = g.w * f;
}

// ops::math::adamw's arithmetic on one element.
__device__ __forceinline__ void ov_adamw_elem(float& p, float g, float& m, float& v,
                                              const AdamwScalars& t) {
    double gd = (double)g;
    double m_new = t.b1 * (double)m + (1.0 - t.b1) * gd;
    double v_new = t.b2 * (double)v + (1.0 - t.b2) * gd * gd;
    m = (float)m_new;
    v = (float)v_new;
    double update = t.lr * (m_new / t.bc1) / (sqrt(v_new / t.bc2) + t.eps);
    p = (float)((double)p * t.decay - update);
}

__device__ __forceinline__ void ov_adamw_elem4(float4& p, float4 g, float4& m, float4& v,
                                               const AdamwScalars& t) {
    ov_adamw_elem(p.x, g.x, m.x, v.x, t);
    ov_adamw_elem(p.y, g.y, m.y, v.y, t);
    ov_adamw_elem(p.z, g.z, m.z, v.z, t);
    ov_adamw_elem(p.w, g.w, m.w, v.w, t);
}

// Block b updates chunk (b - block0) of the tensor whose blocks hold b: moments and
// parameter in one pass, 16-byte loads and stores when the four operands are aligned
// and the chunk is whole (every load of the chunk issued before any is used), one float
// at a time otherwise. Every block reads the guard first (ov_skip).
extern "C" __global__ void ov_adamw_multi(const AdamwTable* __restrict__ table) {
    const AdamwTable& t = *table;
    if (ov_skip(t.guard)) return;
    const AdamwScalars sc = *t.sc;
    float cf = 1.0f;
    const bool clip = ov_fused_clip(t.clip_norm, t.max_norm, &cf);
    const u64 b = blockIdx.x;
    u32 lo = 0, hi = (u32)t.count;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (t.t[mid].block0 <= b) lo = mid; else hi = mid;
    }
    const AdamwTensor& s = t.t[lo];
    const u64 start = (b - s.block0) * OV_ADAMW_CHUNK;
    if (start >= s.n) return;
    const u64 end = min(start + (u64)OV_ADAMW_CHUNK, s.n);
    const u64 aligned = ((u64)s.p | (u64)s.g | (u64)s.m | (u64)s.v) & 15;
    if (aligned == 0 && end - start == OV_ADAMW_CHUNK) {
        float4* p4 = (float4*)(s.p + start);
        float4* g4 = (float4*)(s.g + start);
        float4* m4 = (float4*)(s.m + start);
        float4* v4 = (float4*)(s.v + start);
        float4 p[OV_ADAMW_UNROLL], g[OV_ADAMW_UNROLL], m[OV_ADAMW_UNROLL], v[OV_ADAMW_UNROLL];
#pragma unroll
        for (int u = 0; u < OV_ADAMW_UNROLL; ++u) {
            const u32 e = u * OV_REDUCE_THREADS + threadIdx.x;
            g[u] = g4[e];
            m[u] = m4[e];
            v[u] = v4[e];
            p[u] = p4[e];
        }
        if (clip) {
#pragma unroll
            for (int u = 0; u < OV_ADAMW_UNROLL; ++u) ov_scale4(g[u], cf);
        }
#pragma unroll
        for (int u = 0; u < OV_ADAMW_UNROLL; ++u) ov_adamw_elem4(p[u], g[u], m[u], v[u], sc);
#pragma unroll
        for (int u = 0; u < OV_ADAMW_UNROLL; ++u) {
            const u32 e = u * OV_REDUCE_THREADS + threadIdx.x;
            if (clip) g4[e] = g[u];
            m4[e] = m[u];
            v4[e] = v[u];
            p4[e] = p[u];
        }
    } else {
        for (u64 i = start + threadIdx.x; i < end; i += OV_REDUCE_THREADS) {
            float p = s.p[i], m = s.m[i], v = s.v[i], g = s.g[i];
            if (clip) {
                g = g * cf;
                s.g[i] = g;
            }
            ov_adamw_elem(p, g, m, v, sc);
            s.m[i] = m;
            s.v[i] = v;
            s.p[i] = p;
        }
    }
}

#define OV_MUON_MATS 64

// The matrices of a batched Muon launch: parameter, momentum buffer and gradient of
// each, `count` of them, all rows x cols; `clip_norm`, `max_norm`: ov_fused_clip, in
// ov_mb_momentum (the one kernel that reads the gradients); `guard`: ov_skip. In device
// memory, uploaded with the flush's scalars (as AdamwTable).
struct MuonMats {
    u64 count;
    const float* clip_norm;
    float max_norm;
    const float* guard;
    float* p[OV_MUON_MATS];
    float* buf[OV_MUON_MATS];
    float* g[OV_MUON_MATS];
};

// Matrix blockIdx.y: buf = mu*buf + g (stored as float), u = g + mu*buf
// (ops::math::muon), stored as the unnormalised working matrix at element y*stride of
// x: float, or with bf16 rounded to bfloat16 (as torch.optim.Muon's G.bfloat16()).
// Each block also writes the sum of squares of the values it stored (in double) to
// partial[y * gridDim.x + blockIdx.x], for ov_mb_norm. sc: the batch's scalars in
// device memory (mu, decay, scale; see AdamwScalars). `t.guard`: ov_skip (a skipped step
// writes nothing: Newton-Schulz then runs on stale scratch, and its result is
// discarded by ov_mb_update's own guard).
// One element of ov_mb_momentum: g scaled by the fused clip (stored back), buf and the
// working value u (as stored: rounded to bfloat16 with bf16) from ops::math::muon's
// arithmetic.
__device__ __forceinline__ float ov_muon_elem(float& g, float& b, double mu, bool clip,
                                              float cf, int bf16, u16* h) {
    if (clip) g = g * cf;
    const double gd = (double)g;
    b = (float)(mu * (double)b + gd);
    float u = (float)(gd + mu * (double)b);
    if (bf16) {
        *h = ov_f2bf(u);
        u = __uint_as_float(((u32)*h) << 16);
    }
    return u;
}

extern "C" __global__ void ov_mb_momentum(const MuonMats* __restrict__ mats, void* x,
                                          u64 numel, u64 stride, const double* sc, int bf16,
                                          double* partial) {
    const MuonMats& t = *mats;
    if (ov_skip(t.guard)) return;
    const double mu = sc[0];
    float cf = 1.0f;
    const bool clip = ov_fused_clip(t.clip_norm, t.max_norm, &cf);
    const u32 y = blockIdx.y;
    float* buf = t.buf[y];
    float* g = t.g[y];
    const u64 base = (u64)y * stride;
    double acc = 0.0;
    // Four elements a thread with 16-byte loads when the gradient and the momentum are
    // aligned (x + base always is), the rest one at a time.
    const bool vec = (((u64)buf | (u64)g) & 15) == 0;
    const u64 quads = vec ? numel / 4 : 0;
    GRID_STRIDE(q, quads) {
        float4 g4 = ((float4*)g)[q];
        float4 b4 = ((float4*)buf)[q];
        float gs[4] = {g4.x, g4.y, g4.z, g4.w};
        float bs[4] = {b4.x, b4.y, b4.z, b4.w};
        float us[4];
        u16 hs[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            us[j] = ov_muon_elem(gs[j], bs[j], mu, clip, cf, bf16, &hs[j]);
            acc += (double)us[j] * (double)us[j];
        }
        if (clip) ((float4*)g)[q] = make_float4(gs[0], gs[1], gs[2], gs[3]);
        ((float4*)buf)[q] = make_float4(bs[0], bs[1], bs[2], bs[3]);
        if (bf16) {
            const uint2 w = make_uint2((u32)hs[0] | ((u32)hs[1] << 16),
                                       (u32)hs[2] | ((u32)hs[3] << 16));
            ((uint2*)((u16*)x + base))[q] = w;
        } else {
            ((float4*)((float*)x + base))[q] = make_float4(us[0], us[1], us[2], us[3]);
        }
    }
    GRID_STRIDE(k, numel - quads * 4) {
        const u64 i = quads * 4 + k;
        float gf = g[i], b = buf[i];
        u16 h = 0;
        const float u = ov_muon_elem(gf, b, mu, clip, cf, bf16, &h);
        if (clip) g[i] = gf;
        buf[i] = b;
        if (bf16) {
            ((u16*)x)[base + i] = h;
        } else {
            ((float*)x)[base + i] = u;
        }
        acc += (double)u * (double)u;
    }
    double sum = ov_block_sum(acc);
    if (threadIdx.x == 0) partial[(u64)y * gridDim.x + blockIdx.x] = sum;
}

// Block y: norms[y] = sqrt(sum of partial[y*count .. y*count + count]) + 1e-7.
extern "C" __global__ void ov_mb_norm(const double* partial, u32 count, double* norms) {
    const double* py = partial + (u64)blockIdx.y * count;
    double acc = 0.0;
    for (u32 i = threadIdx.x; i < count; i += OV_REDUCE_THREADS) acc += py[i];
    double sum = ov_block_sum(acc);
    if (threadIdx.x == 0) norms[blockIdx.y] = sqrt(sum) + 1e-7;
}

// Two bfloat16 in one word, each times f, rounded again.
__device__ __forceinline__ u32 ov_scale_bf2(u32 w, float f) {
    const u32 lo = ov_f2bf(__uint_as_float(w << 16) * f);
    const u32 hi = ov_f2bf(__uint_as_float(w & 0xffff0000u) * f);
    return lo | (hi << 16);
}

// Matrix y's working matrix, in place: X_y = U_y * (1 / norms[y]) in float, element by
// element in U's own (row-major) layout at element y*stride of x, float or bfloat16
// (rounded again). 16-byte loads and stores (x + y*stride is 256-byte aligned), the
// last numel % 8 (bf16) or % 4 (float) elements one at a time. (A tall matrix is not
// transposed: muon.rs reads the same buffer as the column-major transpose.)
extern "C" __global__ void ov_mb_scale(void* x, u64 numel, u64 stride, const double* norms,
                                       int bf16) {
    const u32 y = blockIdx.y;
    const float f = (float)(1.0 / norms[y]);
    if (bf16) {
        u16* p = (u16*)x + (u64)y * stride;
        const u64 vecs = numel / 8;
        uint4* p8 = (uint4*)p;
        GRID_STRIDE(k, vecs) {
            uint4 v = p8[k];
            v.x = ov_scale_bf2(v.x, f);
            v.y = ov_scale_bf2(v.y, f);
            v.z = ov_scale_bf2(v.z, f);
            v.w = ov_scale_bf2(v.w, f);
            p8[k] = v;
        }
        GRID_STRIDE(k, numel - vecs * 8) {
            const u64 i = vecs * 8 + k;
            p[i] = ov_f2bf(__uint_as_float(((u32)p[i]) << 16) * f);
        }
    } else {
        float* p = (float*)x + (u64)y * stride;
        const u64 vecs = numel / 4;
        float4* p4 = (float4*)p;
        GRID_STRIDE(k, vecs) {
            float4 v = p4[k];
            ov_scale4(v, f);
            p4[k] = v;
        }
        GRID_STRIDE(k, numel - vecs * 4) {
            const u64 i = vecs * 4 + k;
            p[i] = p[i] * f;
        }
    }
}

// Matrix y's m x m block of b (float or bf16, blocks `astride` elements apart): every
// diagonal element plus `shift` (the a*I of the Gram iteration's Z = a*I + b*R + c*R*R,
// muon.rs).
extern "C" __global__ void ov_mb_diag(void* b, u64 m, u64 astride, float shift, int bf16) {
    const u64 base = (u64)blockIdx.y * astride;
    GRID_STRIDE(i, m) {
        const u64 at = base + i * m + i;
        if (bf16) {
            u16* p = (u16*)b;
            p[at] = ov_f2bf(__uint_as_float(((u32)p[at]) << 16) + shift);
        } else {
            float* p = (float*)b;
            p[at] = p[at] + shift;
        }
    }
}

// Matrix y: p = p*decay - scale*O, O the working matrix at element y*stride of x (float
// or bf16), in the parameter's layout; decay = sc[1], scale = sc[2]. `t.guard`: ov_skip.
extern "C" __global__ void ov_mb_update(const MuonMats* __restrict__ mats, const void* x,
                                        u64 numel, u64 stride, const double* sc, int bf16) {
    const MuonMats& t = *mats;
    if (ov_skip(t.guard)) return;
    const double decay = sc[1], scale = sc[2];
    const u32 y = blockIdx.y;
    float* p = t.p[y];
    const u64 base = (u64)y * stride;
    // Four elements a thread with 16-byte parameter loads when the parameter is aligned
    // (x + base always is), the rest one at a time.
    const u64 quads = (((u64)p & 15) == 0) ? numel / 4 : 0;
    GRID_STRIDE(q, quads) {
        float os[4];
        if (bf16) {
            const uint2 w = ((const uint2*)((const u16*)x + base))[q];
            os[0] = __uint_as_float(w.x << 16);
            os[1] = __uint_as_float(w.x & 0xffff0000u);
            os[2] = __uint_as_float(w.y << 16);
            os[3] = __uint_as_float(w.y & 0xffff0000u);
        } else {
            const float4 o4 = ((const float4*)((const float*)x + base))[q];
            os[0] = o4.x;
            os[1] = o4.y;
            os[2] = o4.z;
            os[3] = o4.w;
        }
        float4 p4 = ((float4*)p)[q];
        p4.x = (float)((double)p4.x * decay - scale * (double)os[0]);
        p4.y = (float)((double)p4.y * decay - scale * (double)os[1]);
        p4.z = (float)((double)p4.z * decay - scale * (double)os[2]);
        p4.w = (float)((double)p4.w * decay - scale * (double)os[3]);
        ((float4*)p)[q] = p4;
    }
    GRID_STRIDE(k, numel - quads * 4) {
        const u64 i = quads * 4 + k;
        const float o = bf16 ? __uint_as_float(((u32)((const u16*)x)[base + i]) << 16)
                             : ((const float*)x)[base + i];
        p[i] = (float)((double)p[i] * decay - scale * (double)o);
    }
}
