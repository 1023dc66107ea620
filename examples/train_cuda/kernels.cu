// The trainer's own kernels for `examples/train.rs --backend cuda` (compiled at run time
// with NVRTC, fused multiply-add off so that each expression rounds as the CPU model's
// does). Matrices are row major, one sample per row; every loop over samples or features
// runs in the CPU model's order, so only the GEMMs (cuBLAS) sum in another order.

// z = tanh(z + b[col]) over a rows x cols matrix.
extern "C" __global__ void bias_tanh(float* z, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        z[i] = tanhf(z[i] + b[i % cols]);
    }
}

// inv[s] = 1 / sqrt(mean(a[s]^2) + eps), per row.
extern "C" __global__ void rms_inv(const float* a, float* inv, int rows, int cols, float eps) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= rows) {
        return;
    }
    float ms = 0.0f;
    for (int i = 0; i < cols; i++) {
        float v = a[s * cols + i];
        ms += v * v;
    }
    ms = ms / (float)cols;
    inv[s] = 1.0f / sqrtf(ms + eps);
}

// n = g[col] * a * inv[row].
extern "C" __global__ void norm_apply(const float* a, const float* inv, const float* g, float* n,
                                      int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        n[i] = g[i % cols] * a[i] * inv[i / cols];
    }
}

// Per row: logits += b; loss[s] = logsumexp(logits) - logits[label] (in double, from the
// f32 logits); then the row becomes softmax(logits).
extern "C" __global__ void softmax_ce(float* logits, const float* b, const int* labels,
                                      double* loss, int rows, int classes) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= rows) {
        return;
    }
    float* l = logits + s * classes;
    float mx = __int_as_float(0xff800000);  // -infinity (NVRTC has no math headers)
    for (int c = 0; c < classes; c++) {
        l[c] = l[c] + b[c];
        mx = fmaxf(mx, l[c]);
    }
    double sum = 0.0;
    for (int c = 0; c < classes; c++) {
        sum += exp((double)l[c] - (double)mx);
    }
    loss[s] = ((double)mx + log(sum)) - (double)l[labels[s]];
    float z = 0.0f;
    for (int c = 0; c < classes; c++) {
        float e = expf(l[c] - mx);
        l[c] = e;
        z += e;
    }
    for (int c = 0; c < classes; c++) {
        l[c] = l[c] / z;
    }
}

// d = (probs - onehot(label)) * scale.
extern "C" __global__ void ce_grad(const float* probs, const int* labels, float* d, int rows,
                                   int classes, float scale) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * classes) {
        float p = probs[i];
        if (i % classes == labels[i / classes]) {
            p = p - 1.0f;
        }
        d[i] = p * scale;
    }
}

// out[i] = sum over rows s of dy[s][i] (the bias gradient), rows in order.
extern "C" __global__ void col_sum(const float* dy, float* out, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= cols) {
        return;
    }
    float acc = 0.0f;
    for (int s = 0; s < rows; s++) {
        acc += dy[s * cols + i];
    }
    out[i] = acc;
}

// d *= 1 - a^2 (through tanh).
extern "C" __global__ void tanh_grad(float* d, const float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        d[i] = d[i] * (1.0f - a[i] * a[i]);
    }
}

// The norm's gain gradient: gain[i] = sum over rows s of dn[s][i] * a[s][i] * inv[s].
extern "C" __global__ void norm_gain_grad(const float* dn, const float* a, const float* inv,
                                          float* gain, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= cols) {
        return;
    }
    float acc = 0.0f;
    for (int s = 0; s < rows; s++) {
        acc += dn[s * cols + i] * a[s * cols + i] * inv[s];
    }
    gain[i] = acc;
}

// The norm's input gradient, per row: k = (sum_i dn_i g_i a_i) inv^3 / cols,
// da_i = dn_i g_i inv - a_i k.
extern "C" __global__ void norm_input_grad(const float* dn, const float* a, const float* inv,
                                           const float* g, float* da, int rows, int cols) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= rows) {
        return;
    }
    const float* dr = dn + s * cols;
    const float* ar = a + s * cols;
    float r = inv[s];
    float dot = 0.0f;
    for (int i = 0; i < cols; i++) {
        dot += dr[i] * g[i] * ar[i];
    }
    float k = dot * r * r * r / (float)cols;
    for (int i = 0; i < cols; i++) {
        da[s * cols + i] = dr[i] * g[i] * r - ar[i] * k;
    }
}
