// Strata's CUDA kernels: everything of the Llama forward pass but the GEMMs (cuBLAS).
//
// Compiled at start-up by NVRTC for the device's architecture, after a prelude that
// defines the portability macros below (see kernels.rs). The same source also compiles
// as C++ against a CPU emulation of the CUDA execution model (emulator.cpp), which is how
// the tests run these kernels on machines without a GPU. So the kernels keep to what both
// can do: blockIdx/threadIdx/blockDim, block-level shared memory, SYNC() reached by every
// thread of the block, no warp intrinsics.
//
//   KERNEL          extern "C" __global__
//   DEVICE          __device__ inline helper
//   SHARED          __shared__
//   DYN_SHARED(T,n) extern __shared__ T n[]   (the launch's dynamic shared memory)
//   SYNC()          __syncthreads()
//
// Layout conventions (as the Backend trait's): activations are row-major f32
// [rows, cols]; weights are bf16 stored as 16-bit patterns; the KV cache is bf16 (half the
// memory of f32, twice the sequences; HF transformers keeps a bf16 model's cache in bf16
// too), one [slots, kv_dim] array each for K and V, where slot = block * block_size +
// offset; attention widens it to f32 and accumulates in f32.

typedef unsigned short bf16_t;

DEVICE float bf16_to_f32(bf16_t h) {
    return __int_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, as torch does; NaN stays NaN.
DEVICE bf16_t f32_to_bf16(float f) {
    unsigned int u = (unsigned int)__float_as_int(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    unsigned int rounding = 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)((u + rounding) >> 16);
}

// y[i] = bf16(x[i]): GEMM inputs.
KERNEL void cast_bf16(const float* x, bf16_t* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = f32_to_bf16(x[i]);
    }
}

// x[r, c] += b[c].
KERNEL void add_bias(float* x, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        x[i] += b[i % cols];
    }
}

// x[i] += y[i]: residual connections.
KERNEL void add(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] += y[i];
    }
}

// y[i] = silu(g[i]) * u[i].
KERNEL void silu_mul(const float* g, const float* u, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = g[i];
        y[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// gelu(g) · u, GELU in its tanh form (`gelu_pytorch_tanh`: Gemma's MLP), in the order
// PyTorch computes it.
KERNEL void gelu_tanh_mul(const float* g, const float* u, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = g[i];
        float inner = 0.7978845608028654f * (v + 0.044715f * (v * v * v));
        y[i] = 0.5f * v * (1.0f + tanhf(inner)) * u[i];
    }
}

// gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// y = (u + 1) · g · sigmoid(alpha · g), in the order transformers computes it.
KERNEL void clamped_swiglu_mul(const float* g, const float* u, float* y, int n, float alpha, float limit) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float gv = fminf(g[i], limit);
        float uv = fminf(fmaxf(u[i], -limit), limit);
        float glu = gv * (1.0f / (1.0f + expf(-(gv * alpha))));
        y[i] = (uv + 1.0f) * glu;
    }
}

// out[rows[b]] += weights[b] · y[b], one block a row of `y` (each row of `out` at most once
// a launch): an expert's outputs added back to the tokens that chose it.
KERNEL void scatter_add_rows(float* out, const float* y, const int* rows, const float* weights, int cols) {
    float* o = out + (long)rows[blockIdx.x] * cols;
    const float* src = y + (long)blockIdx.x * cols;
    float w = weights[blockIdx.x];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        o[c] += src[c] * w;
    }
}

// In place, elementwise: `x · a` (mode 0: a scale, Gemma's embeddings) or
// `a · tanh(x / a)` (mode 1: soft-capping at `a`, Gemma's final logits).
KERNEL void pointwise(float* x, int n, int mode, float a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        x[i] = mode == 0 ? v * a : tanhf(v / a) * a;
    }
}

// 1 / sqrt(mean + eps) of a row of `cols` whose squares the block's threads summed into
// `sum` each; `partial` is blockDim.x floats of shared memory. Every thread gets it.
DEVICE float block_inv_rms(float* partial, float sum, int cols, float eps) {
    partial[threadIdx.x] = sum;
    SYNC();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) {
            partial[threadIdx.x] += partial[threadIdx.x + stride];
        }
        SYNC();
    }
    return 1.0f / sqrtf(partial[0] / (float)cols + eps);
}

// One block per row: y = w * x / sqrt(mean(x²) + eps). blockDim.x is a power of two ≤ 1024.
KERNEL void rms_norm(const float* x, const float* w, float* y, int cols, float eps) {
    SHARED float partial[1024];
    const float* row = x + (long long)blockIdx.x * cols;
    float* out = y + (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        sum += row[c] * row[c];
    }
    float inv = block_inv_rms(partial, sum, cols, eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        out[c] = w[c] * (row[c] * inv);
    }
}

// One block per row, fusing a residual connection with the norm after it:
// x += d, then y = w * x / sqrt(mean(x²) + eps) — the same arithmetic as add then
// rms_norm, in one pass. blockDim.x is a power of two ≤ 1024.
KERNEL void add_rms_norm(float* x, const float* d, const float* w, float* y, int cols, float eps) {
    SHARED float partial[1024];
    float* row = x + (long long)blockIdx.x * cols;
    const float* delta = d + (long long)blockIdx.x * cols;
    float* out = y + (long long)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = row[c] + delta[c];
        row[c] = v;
        sum += v * v;
    }
    float inv = block_inv_rms(partial, sum, cols, eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        out[c] = w[c] * (row[c] * inv);
    }
}

// Rotates pair i of one head (elements i and i + half) by angle pos × inv_freq[i],
// scaled by mscale (YaRN's and LongRoPE's attention factor; 1 for the others).
DEVICE void rotate_pair(float* head, int i, int half, float pos, const float* inv_freq, float mscale) {
    float angle = pos * inv_freq[i];
    float c = cosf(angle) * mscale;
    float s = sinf(angle) * mscale;
    float x1 = head[i];
    float x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
}

// One block per new token, fusing RoPE with the KV write: rotates the token's q and k
// heads in place (the first 2 × half dims of each), then stores k and v, rounded to
// bf16, at its cache slot.
KERNEL void rope_write_kv(float* q, float* k, const float* v, bf16_t* k_cache, bf16_t* v_cache,
                          const int* positions, const int* slots, const float* inv_freq, int q_cols,
                          int kv_dim, int head_dim, int half, float mscale) {
    int t = blockIdx.x;
    float pos = (float)positions[t];
    float* q_row = q + (long long)t * q_cols;
    for (int j = threadIdx.x; j < q_cols / head_dim * half; j += blockDim.x) {
        rotate_pair(q_row + (j / half) * head_dim, j % half, half, pos, inv_freq, mscale);
    }
    float* k_row = k + (long long)t * kv_dim;
    const float* v_row = v + (long long)t * kv_dim;
    long long dst = (long long)slots[t] * kv_dim;
    for (int j = threadIdx.x; j < kv_dim / head_dim * half; j += blockDim.x) {
        int head = (j / half) * head_dim;
        int i = j % half;
        rotate_pair(k_row + head, i, half, pos, inv_freq, mscale);
        k_cache[dst + head + i] = f32_to_bf16(k_row[head + i]);
        k_cache[dst + head + i + half] = f32_to_bf16(k_row[head + i + half]);
    }
    for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
        // The dims rope passes over (partial rotary), as they are.
        if (c % head_dim >= 2 * half) {
            k_cache[dst + c] = f32_to_bf16(k_row[c]);
        }
        v_cache[dst + c] = f32_to_bf16(v_row[c]);
    }
}

// One block per row: rotates the first 2 × half dims of each head by the token's position
// (HF's rotate_half form: dim i with dim i + half). inv_freq holds half frequencies,
// already rescaled.
KERNEL void rope(float* x, const int* positions, const float* inv_freq, int cols, int head_dim, int half,
                 float mscale) {
    float* row = x + (long long)blockIdx.x * cols;
    float pos = (float)positions[blockIdx.x];
    int pairs = cols / head_dim * half;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
        rotate_pair(row + (j / half) * head_dim, j % half, half, pos, inv_freq, mscale);
    }
}

// One block per token: the embedding row of ids[t] from a bf16 table holding ids
// first_id .. first_id + table_rows (a vocabulary shard); other ids get zeros.
KERNEL void embed(const bf16_t* table, const int* ids, float* out, int cols, int first_id, int table_rows) {
    int local = ids[blockIdx.x] - first_id;
    float* dst = out + (long long)blockIdx.x * cols;
    bool inside = local >= 0 && local < table_rows;
    const bf16_t* src = table + (long long)(inside ? local : 0) * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        dst[c] = inside ? bf16_to_f32(src[c]) : 0.0f;
    }
}

// One block per new token: its K and V rows, rounded to bf16, into its cache slot.
KERNEL void write_kv(bf16_t* k_cache, bf16_t* v_cache, const float* k, const float* v, const int* slots, int kv_dim) {
    long long dst = (long long)slots[blockIdx.x] * kv_dim;
    long long src = (long long)blockIdx.x * kv_dim;
    for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
        k_cache[dst + c] = f32_to_bf16(k[src + c]);
        v_cache[dst + c] = f32_to_bf16(v[src + c]);
    }
}

// y[i, :] = x[rows[i], :].
KERNEL void gather_rows(const float* x, const int* rows, float* y, int cols) {
    const float* src = x + (long long)rows[blockIdx.x] * cols;
    float* dst = y + (long long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        dst[c] = src[c];
    }
}

// dst[dst_row + r, dst_col + c] = src[r, src_col + c] for c < width, one block per row of
// src: a column slice (one head of per-head activations), or one part of a concatenation
// by columns or by rows.
KERNEL void copy_block(const float* src, float* dst, int src_cols, int src_col, int dst_cols, int dst_col,
                       int dst_row, int width) {
    const float* s = src + (long long)blockIdx.x * src_cols + src_col;
    float* d = dst + ((long long)blockIdx.x + dst_row) * dst_cols + dst_col;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        d[c] = s[c];
    }
}

// y[t, r*w + c] = x[r, t, c]: whole rows of `ranks` vocabulary shards of width w gathered
// rank after rank ([ranks][rows][w], an all-gather's order). One block per row.
KERNEL void unshard_rows(const float* x, float* y, int rows, int w, int ranks) {
    float* dst = y + (long long)blockIdx.x * w * ranks;
    for (int i = threadIdx.x; i < w * ranks; i += blockDim.x) {
        dst[i] = x[((long long)(i / w) * rows + blockIdx.x) * w + i % w];
    }
}

// Block-wide argmax of each thread's (best[tid], where[tid]) into slot 0: the larger
// value, the smaller column on ties; a column < 0 is "none". Every thread of the block
// calls it; on return all may read slot 0.
DEVICE void block_argmax(float* best, int* where, int tid) {
    SYNC();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) {
            int a2 = where[tid + stride];
            float m2 = best[tid + stride];
            int a1 = where[tid];
            if (a1 < 0 || (a2 >= 0 && (m2 > best[tid] || (m2 == best[tid] && a2 < a1)))) {
                best[tid] = m2;
                where[tid] = a2;
            }
        }
        SYNC();
    }
}

// The row's largest value and its column (the first on ties) into best[0] and where[0]
// (-1 for an empty row); every thread calls it.
DEVICE void block_row_argmax(const float* row, int cols, float* best, int* where, int tid) {
    float m = -INFINITY;
    int at = -1;
    for (int c = tid; c < cols; c += blockDim.x) {
        if (at < 0 || row[c] > m) {
            m = row[c];
            at = c;
        }
    }
    best[tid] = m;
    where[tid] = at;
    block_argmax(best, where, tid);
}

// Block-wide sum (or, with `smallest`, minimum) of each thread's v, combined in a fixed
// order; every thread gets it.
DEVICE float block_reduce(float v, bool smallest, float* scratch, int tid) {
    SYNC();  // scratch may still be read by the caller's previous reduction
    scratch[tid] = v;
    SYNC();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) {
            float other = scratch[tid + stride];
            scratch[tid] = smallest ? (other < scratch[tid] ? other : scratch[tid]) : scratch[tid] + other;
        }
        SYNC();
    }
    float r = scratch[0];
    SYNC();
    return r;
}

// log(sum(exp(row))) of a row whose largest value is `top`, summed across the block with
// `scratch` (blockDim.x floats). Every thread calls it and gets the value.
DEVICE float block_log_sum_exp(const float* row, int cols, float top, float* scratch, int tid) {
    float sum = 0.0f;
    if (top != -INFINITY) {
        for (int c = tid; c < cols; c += blockDim.x) {
            sum += expf(row[c] - top);
        }
    }
    float total = block_reduce(sum, false, scratch, tid);
    return top == -INFINITY ? top : top + logf(total);
}

// One block per row of a whole vocabulary's logits: every token the row's mask does not
// allow becomes -infinity (constrained decoding, before the row is reduced or drawn from).
// masks holds `words` u32s per row (token t is bit t % 32 of word t / 32); a row whose
// flag is 0 has no constraint and is left alone.
KERNEL void mask_logits(float* x, const unsigned* masks, const int* masked, int cols, int words) {
    if (masked[blockIdx.x] == 0) {
        return;
    }
    float* row = x + (long long)blockIdx.x * cols;
    const unsigned* mask = masks + (long long)blockIdx.x * words;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        int w = c >> 5;
        if (w >= words || ((mask[w] >> (c & 31)) & 1u) == 0u) {
            row[c] = -INFINITY;
        }
    }
}

// One block per row of a vocabulary shard's logits whose first column is token first_id:
// out[row] = {token of the largest logit (the first on ties), that logit, the row's
// log-sum-exp}, the token as a float (exact below 2^24). Greedy decoding needs nothing
// more, so the logits stay on the device. blockDim.x is a power of two <= 1024.
KERNEL void greedy_pick(const float* x, float* out, int cols, int first_id) {
    SHARED float best[1024];
    SHARED int where[1024];
    const float* row = x + (long long)blockIdx.x * cols;
    int tid = threadIdx.x;
    block_row_argmax(row, cols, best, where, tid);
    float top = best[0];
    int top_at = where[0];
    float log_z = block_log_sum_exp(row, cols, top, best, tid);
    if (tid == 0) {
        float* o = out + (long long)blockIdx.x * 3;
        o[0] = (float)(first_id + (top_at < 0 ? 0 : top_at));
        o[1] = top;
        o[2] = log_z;
    }
}

// Whether (l, c) comes after (pl, pc) in the sampler's order: logit descending, the
// smaller column first on ties.
DEVICE bool ranks_after(float l, int c, float pl, int pc) {
    return l < pl || (l == pl && c > pc);
}

// One block per row of a vocabulary shard's logits whose first column is token first_id:
// the row's k most likely tokens in the sampler's order and its log-sum-exp, out[row] =
// {log_z, token0, logit0, token1, logit1, ...} (2k + 1 floats; tokens as floats, exact
// below 2^24; a row narrower than k ends with token -1). Top-k sampling and top logprobs
// need nothing more, so 2k + 1 floats of a row cross to the host instead of the row.
// Round r takes the block-wide best of what ranks after round r - 1's choice (round 0's
// is the row's largest logit, which also anchors the log-sum-exp).
// blockDim.x is a power of two <= 1024.
KERNEL void top_logits(const float* x, float* out, int cols, int k, int first_id) {
    SHARED float best[1024];
    SHARED int where[1024];
    const float* row = x + (long long)blockIdx.x * cols;
    float* o = out + (long long)blockIdx.x * (2 * k + 1);
    int tid = threadIdx.x;
    float pl = 0.0f;
    int pc = -1;  // no choice yet: everything ranks after it
    for (int r = 0; r < k; r++) {
        float bm = -INFINITY;
        int at = -1;
        if (r == 0 || pc >= 0) {
            for (int c = tid; c < cols; c += blockDim.x) {
                float l = row[c];
                if ((r == 0 || ranks_after(l, c, pl, pc)) && (at < 0 || l > bm)) {
                    bm = l;
                    at = c;
                }
            }
        }
        best[tid] = bm;
        where[tid] = at;
        block_argmax(best, where, tid);
        pl = best[0];
        pc = where[0];
        if (tid == 0) {
            o[1 + 2 * r] = pc < 0 ? -1.0f : (float)(first_id + pc);
            o[2 + 2 * r] = pc < 0 ? -INFINITY : pl;
        }
        if (r == 0) {
            float log_z = block_log_sum_exp(row, cols, pc < 0 ? -INFINITY : pl, best, tid);
            if (tid == 0) {
                o[0] = log_z;
            }
        }
        SYNC();
    }
}

// Sampling parameters of one row of draw_tokens: temperature, top_p, min_p and the row's
// uniform draw u in [0, 1) (from the sequence's own seeded stream, on the host).
#define DRAW_PARAMS 4

// Key of a float in its order: a < b exactly when float_key(a) < float_key(b).
DEVICE unsigned int float_key(float f) {
    unsigned int u = (unsigned int)__float_as_int(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The sum of v over the threads before this one, in thread order.
DEVICE float block_exclusive_sum(float v, float* scratch, int tid) {
    SYNC();
    scratch[tid] = v;
    SYNC();
    if (tid == 0) {
        float run = 0.0f;
        for (int t = 0; t < (int)blockDim.x; t++) {
            float x = scratch[t];
            scratch[t] = run;
            run += x;
        }
    }
    SYNC();
    float before = scratch[tid];
    SYNC();
    return before;
}

// A row's tempered weights: exp(l/T - top/T), the largest weighing 1.
struct Tempered {
    float top_t, temperature;
};

DEVICE float weight_of(Tempered t, float l) {
    return expf(l / t.temperature - t.top_t);
}

// Block-wide tempered weight of the row's columns whose logit's key is >= key (each
// thread sums its run [c0, c1)).
DEVICE float mass_from(const float* row, int c0, int c1, unsigned int key, Tempered t, float* scratch, int tid) {
    float s = 0.0f;
    for (int c = c0; c < c1; c++) {
        if (float_key(row[c]) >= key) {
            s += weight_of(t, row[c]);
        }
    }
    return block_reduce(s, false, scratch, tid);
}

// Which tokens a nucleus keeps: those above the logit b, and the first `ties` of those
// equal to it (in id order). Without a nucleus (top_p >= 1), every token.
struct Nucleus {
    unsigned int b_key;
    float ties;
    bool cut;
};

// The nucleus of top_p: b is the largest logit whose tokens at or above it weigh top_p of
// the row (bisection on the order keys: mass(lo) >= need > mass(hi)); of the tokens equal
// to b, the fewest that reach it.
DEVICE Nucleus find_nucleus(const float* row, int c0, int c1, float top, Tempered t, float top_p, float* scratch,
                            int tid) {
    Nucleus n = {0u, 0.0f, false};
    if (top_p >= 1.0f) {
        return n;
    }
    float need = top_p * mass_from(row, c0, c1, 0u, t, scratch, tid);
    n.cut = true;
    n.b_key = float_key(top);
    n.ties = 1.0f;
    if (!(need > 0.0f)) {
        return n;
    }
    unsigned int lo = 0u, hi = float_key(top) + 1u;
    while (hi - lo > 1u) {
        unsigned int mid = lo + (hi - lo) / 2u;
        if (mass_from(row, c0, c1, mid, t, scratch, tid) >= need) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    float local = INFINITY;
    for (int c = c0; c < c1; c++) {
        if (float_key(row[c]) >= lo && row[c] < local) {
            local = row[c];
        }
    }
    float b = block_reduce(local, true, scratch, tid);
    float above = mass_from(row, c0, c1, float_key(b) + 1u, t, scratch, tid);
    float ties = ceilf((need - above) / weight_of(t, b));
    n.b_key = float_key(b);
    n.ties = ties < 1.0f ? 1.0f : ties;
    return n;
}

// The weight column c keeps under the nucleus and min-p (0 if dropped); `rank` counts the
// ties at the boundary seen so far in id order, and advances past c if it is one.
DEVICE float kept_weight(const float* row, int c, Nucleus n, Tempered t, float min_p, float* rank) {
    unsigned int k = float_key(row[c]);
    bool in_nucleus = !n.cut || k > n.b_key || (k == n.b_key && *rank < n.ties);
    if (n.cut && k == n.b_key) {
        *rank += 1.0f;
    }
    float w = weight_of(t, row[c]);
    return in_nucleus && w >= min_p && w > 0.0f ? w : 0.0f;
}

// The kept token of the row's columns at u times their kept weight, walking them in id
// order (each thread its run, the runs in thread order); if rounding leaves the target
// past every run, the last kept token. -1 if none is kept.
DEVICE int walk_kept(const float* row, int c0, int c1, Nucleus n, Tempered t, float min_p, float u, float* best,
                     int* where, int tid) {
    float ties = 0.0f;
    for (int c = c0; c < c1; c++) {
        ties += n.cut && float_key(row[c]) == n.b_key ? 1.0f : 0.0f;
    }
    float first_rank = block_exclusive_sum(ties, best, tid);
    float rank = first_rank, kept = 0.0f;
    for (int c = c0; c < c1; c++) {
        kept += kept_weight(row, c, n, t, min_p, &rank);
    }
    float acc = block_exclusive_sum(kept, best, tid);
    float target = u * block_reduce(kept, false, best, tid);
    int found = -1, last = -1;
    rank = first_rank;
    for (int c = c0; c < c1; c++) {
        float w = kept_weight(row, c, n, t, min_p, &rank);
        if (w > 0.0f) {
            last = c;
            if (found < 0 && target < acc + w) {
                found = c;
            }
            acc += w;
        }
    }
    // The first thread that found it; else the last kept column of any.
    best[tid] = found >= 0 ? 1.0f : 0.0f;
    where[tid] = found >= 0 ? found : last;
    SYNC();
    if (tid == 0) {
        int f = -1, l = -1;
        for (int i = 0; i < (int)blockDim.x; i++) {
            if (best[i] > 0.0f && f < 0) {
                f = where[i];
            }
            if (best[i] == 0.0f && where[i] > l) {
                l = where[i];
            }
        }
        where[0] = f >= 0 ? f : l;
    }
    SYNC();
    int chosen = where[0];
    SYNC();
    return chosen;
}

// One block per row of a whole vocabulary's logits: draws the row's next token as the
// sampler defines it (temperature, then top-p and min-p over the tempered softmax, then a
// draw with the row's u), so only the token crosses to the host. out[row] = {token, the
// row's largest logit, its log-sum-exp} (as greedy_pick's: the host checks the row was
// finite). A row with temperature <= 0 or non-finite logits gets its greedy pick.
//
// The kept tokens are those the sampler's sorted walk keeps, found without sorting: the
// nucleus boundary by bisection (find_nucleus); the tokens above it are kept and, of
// those equal to it, the first by id (the sampler's order on ties) that reach top_p;
// min-p keeps weights >= min_p (the largest weighs 1); a weight of 0 is never kept. The
// draw walks the kept tokens in id order to u times their weight (walk_kept), as the host
// sampler does for such requests. Each thread owns a contiguous run of columns.
// blockDim.x is a power of two <= 1024.
KERNEL void draw_tokens(const float* x, const float* params, float* out, int cols, int first_id) {
    SHARED float best[1024];
    SHARED int where[1024];
    const float* row = x + (long long)blockIdx.x * cols;
    const float* p = params + (long long)blockIdx.x * DRAW_PARAMS;
    float temperature = p[0], top_p = p[1], min_p = p[2], u = p[3];
    int tid = threadIdx.x;
    int chunk = (cols + (int)blockDim.x - 1) / (int)blockDim.x;
    int c0 = tid * chunk < cols ? tid * chunk : cols;
    int c1 = c0 + chunk < cols ? c0 + chunk : cols;
    block_row_argmax(row, cols, best, where, tid);
    float top = best[0];
    int chosen = where[0];
    float log_z = block_log_sum_exp(row, cols, top, best, tid);
    if (log_z - log_z == 0.0f && temperature > 0.0f) {  // finite, and drawn
        Tempered t = {top / temperature, temperature};
        Nucleus n = find_nucleus(row, c0, c1, top, t, top_p, best, tid);
        int drawn = walk_kept(row, c0, c1, n, t, min_p, u, best, where, tid);
        chosen = drawn >= 0 ? drawn : chosen;
    }
    if (tid == 0) {
        float* o = out + (long long)blockIdx.x * 3;
        o[0] = (float)(first_id + (chosen < 0 ? 0 : chosen));
        o[1] = top;
        o[2] = log_z;
    }
}

// Largest number of output dimensions one attention thread accumulates:
// head_dim ≤ ATTN_MAX_DIMS × blockDim.x.
#define ATTN_MAX_DIMS 5

// Paged causal attention, one block per (new token, query head), for prefill chunks and
// decode alike: the token attends to its own sequence's positions lo..=pos, read through
// the sequence's block table (no padding between sequences of different lengths; lo > 0
// only under a sliding window). Positions are taken blockDim.x at a time: each thread
// scores one position, the block reduces max and sum, and an online softmax (running
// max m and sum l, rescaled as the max grows) accumulates the output, each thread
// owning head_dim / blockDim.x of its dimensions.
//
// Per token t: its sequence s = tok_seq[t]; the sequence's first row seq_start[s], the
// positions already cached before this step seq_ctx[s], and its block table at
// block_tables[bt_offset[s] ..]. GQA: query head h reads KV head h / (heads / kv_heads).
// Dynamic shared memory: (head_dim + 3 × blockDim.x) floats. blockDim.x is a power of two.
//
// With use_rows, block x serves token rows[x] (the decoding tokens of a step whose prefill
// chunks go to tiled_attention); else token x. softcap > 0 caps each scaled score at
// softcap · tanh(s / softcap) (Gemma 2); with use_sinks, sinks[h] joins the softmax's
// denominator as a logit that takes no value (gpt-oss).
KERNEL void paged_attention(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, float* out,
                            const int* tok_seq, const int* seq_start, const int* seq_ctx,
                            const int* bt_offset, const int* block_tables, int num_heads, int num_kv_heads,
                            int head_dim, int kv_dim, int block_size, float scale, int window,
                            const int* rows, int use_rows, float softcap, const float* sinks,
                            int use_sinks) {
    DYN_SHARED(float, smem);
    int nt = blockDim.x;
    int tid = threadIdx.x;
    float* qs = smem;                    // head_dim: the scaled query
    float* probs = qs + head_dim;        // nt: this chunk's exp(score - m)
    float* red = probs + nt;             // nt: reduction scratch
    int* slot_of = (int*)(red + nt);     // nt: this chunk's cache slots

    int t = use_rows ? rows[blockIdx.x] : (int)blockIdx.x;
    int h = blockIdx.y;
    int s = tok_seq[t];
    int pos = seq_ctx[s] + (t - seq_start[s]);
    int lo = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
    int kv_off = (h / (num_heads / num_kv_heads)) * head_dim;
    const int* table = block_tables + bt_offset[s];
    const float* q_row = q + ((long long)t * num_heads + h) * head_dim;
    for (int d = tid; d < head_dim; d += nt) {
        qs[d] = q_row[d] * scale;
    }
    SYNC();

    float acc[ATTN_MAX_DIMS];
    for (int i = 0; i < ATTN_MAX_DIMS; i++) {
        acc[i] = 0.0f;
    }
    float m = -INFINITY;
    float l = 0.0f;
    for (int base = lo; base <= pos; base += nt) {
        int p = base + tid;
        bool valid = p <= pos;
        float score = -INFINITY;
        if (valid) {
            int slot = table[p / block_size] * block_size + p % block_size;
            slot_of[tid] = slot;
            const bf16_t* k = k_cache + (long long)slot * kv_dim + kv_off;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) {
                dot += qs[d] * bf16_to_f32(k[d]);
            }
            score = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
        }
        red[tid] = score;
        SYNC();
        for (int stride = nt / 2; stride > 0; stride >>= 1) {
            if (tid < stride) {
                red[tid] = fmaxf(red[tid], red[tid + stride]);
            }
            SYNC();
        }
        float m_new = fmaxf(m, red[0]);
        SYNC();
        float e = valid ? expf(score - m_new) : 0.0f;
        probs[tid] = e;
        red[tid] = e;
        SYNC();
        for (int stride = nt / 2; stride > 0; stride >>= 1) {
            if (tid < stride) {
                red[tid] += red[tid + stride];
            }
            SYNC();
        }
        float correction = expf(m - m_new);
        l = l * correction + red[0];
        int count = pos - base + 1 < nt ? pos - base + 1 : nt;
        for (int i = 0; i < ATTN_MAX_DIMS; i++) {
            int d = tid + i * nt;
            if (d < head_dim) {
                float a = acc[i] * correction;
                for (int j = 0; j < count; j++) {
                    a += probs[j] * bf16_to_f32(v_cache[(long long)slot_of[j] * kv_dim + kv_off + d]);
                }
                acc[i] = a;
            }
        }
        m = m_new;
        SYNC();
    }
    // m is finite: the token's own position is always seen.
    float denom = use_sinks ? l + expf(sinks[h] - m) : l;
    float* o = out + ((long long)t * num_heads + h) * head_dim;
    for (int i = 0; i < ATTN_MAX_DIMS; i++) {
        int d = tid + i * nt;
        if (d < head_dim) {
            o[d] = acc[i] / denom;
        }
    }
}

// Queries per tile of tiled_attention, and the most (query, dimension) pairs one thread
// accumulates: TILE_Q × head_dim ≤ TILE_MAX_ACC × blockDim.x.
#define TILE_Q 16
#define TILE_MAX_ACC 32

// Tiled (flash-style) causal attention for prefill chunks, one block per (tile of up to
// TILE_Q consecutive tokens of one sequence, query head): each K/V chunk of tile_k
// positions is read from the paged cache once into shared memory and used by every query
// of the tile (the per-token kernel reads it once per query). Per chunk: scores of every
// (query, key) pair the causal mask and window allow, an online-softmax update per query
// (running max and sum, rescaling what was accumulated), then probabilities × V into the
// accumulators, which each thread keeps in registers for its (query, dimension) pairs.
//
// Tile x starts at token row tiles[x] and holds tile_len[x] rows; the sequence layout is
// paged_attention's, and so are softcap and the sinks. Dynamic shared memory: (TILE_Q ×
// head_dim + 2 × tile_k × head_dim + TILE_Q × tile_k + 3 × TILE_Q) floats.
KERNEL void tiled_attention(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, float* out,
                            const int* tiles, const int* tile_len, const int* tok_seq, const int* seq_start,
                            const int* seq_ctx, const int* bt_offset, const int* block_tables, int num_heads,
                            int num_kv_heads, int head_dim, int kv_dim, int block_size, float scale,
                            int window, int tile_k, float softcap, const float* sinks, int use_sinks) {
    DYN_SHARED(float, smem);
    int nt = blockDim.x;
    int tid = threadIdx.x;
    int t0 = tiles[blockIdx.x];
    int nq = tile_len[blockIdx.x];
    int h = blockIdx.y;
    int s = tok_seq[t0];
    int pos0 = seq_ctx[s] + (t0 - seq_start[s]);
    int kv_off = (h / (num_heads / num_kv_heads)) * head_dim;
    const int* table = block_tables + bt_offset[s];
    float* qs = smem;                        // TILE_Q × head_dim: the scaled queries
    float* ks = qs + TILE_Q * head_dim;      // tile_k × head_dim: this chunk's keys
    float* vs = ks + tile_k * head_dim;      // tile_k × head_dim: this chunk's values
    float* sc = vs + tile_k * head_dim;      // TILE_Q × tile_k: scores, then probabilities
    float* m_run = sc + TILE_Q * tile_k;     // TILE_Q: running max
    float* l_run = m_run + TILE_Q;           // TILE_Q: running sum
    float* rescale = l_run + TILE_Q;         // TILE_Q: this chunk's rescale of the sums
    int pairs = TILE_Q * head_dim;
    for (int p = tid; p < pairs; p += nt) {
        int i = p / head_dim;
        qs[p] = i < nq ? q[((long long)(t0 + i) * num_heads + h) * head_dim + p % head_dim] * scale : 0.0f;
    }
    for (int i = tid; i < TILE_Q; i += nt) {
        m_run[i] = -INFINITY;
        l_run[i] = 0.0f;
    }
    float acc[TILE_MAX_ACC];
    for (int a = 0; a < TILE_MAX_ACC; a++) {
        acc[a] = 0.0f;
    }
    int last = pos0 + nq - 1;
    int lo = window > 0 && pos0 + 1 - window > 0 ? pos0 + 1 - window : 0;
    SYNC();
    for (int base = lo; base <= last; base += tile_k) {
        int nk = last - base + 1 < tile_k ? last - base + 1 : tile_k;
        for (int p = tid; p < tile_k * head_dim; p += nt) {
            int j = p / head_dim;
            float kx = 0.0f;
            float vx = 0.0f;
            if (j < nk) {
                int kpos = base + j;
                long long slot = (long long)table[kpos / block_size] * block_size + kpos % block_size;
                kx = bf16_to_f32(k_cache[slot * kv_dim + kv_off + p % head_dim]);
                vx = bf16_to_f32(v_cache[slot * kv_dim + kv_off + p % head_dim]);
            }
            ks[p] = kx;
            vs[p] = vx;
        }
        SYNC();
        for (int p = tid; p < TILE_Q * tile_k; p += nt) {
            int i = p / tile_k;
            int j = p % tile_k;
            int qpos = pos0 + i;
            int kpos = base + j;
            bool seen = i < nq && j < nk && kpos <= qpos && (window <= 0 || kpos > qpos - window);
            float dot = -INFINITY;
            if (seen) {
                dot = 0.0f;
                for (int d = 0; d < head_dim; d++) {
                    dot += qs[i * head_dim + d] * ks[j * head_dim + d];
                }
                if (softcap > 0.0f) {
                    dot = softcap * tanhf(dot / softcap);
                }
            }
            sc[p] = dot;
        }
        SYNC();
        for (int i = tid; i < TILE_Q; i += nt) {
            float m = m_run[i];
            float m_new = m;
            for (int j = 0; j < nk; j++) {
                m_new = fmaxf(m_new, sc[i * tile_k + j]);
            }
            float c = 1.0f;
            float sum = 0.0f;
            for (int j = 0; j < nk; j++) {
                // Nothing seen yet (m_new = -inf): every probability is 0.
                float e = m_new == -INFINITY ? 0.0f : expf(sc[i * tile_k + j] - m_new);
                sc[i * tile_k + j] = e;
                sum += e;
            }
            if (m_new != -INFINITY) {
                c = expf(m - m_new);
            }
            m_run[i] = m_new;
            l_run[i] = l_run[i] * c + sum;
            rescale[i] = c;
        }
        SYNC();
        for (int a = 0; a < TILE_MAX_ACC; a++) {
            int p = tid + a * nt;
            if (p < pairs) {
                int i = p / head_dim;
                int d = p % head_dim;
                float v = acc[a] * rescale[i];
                for (int j = 0; j < nk; j++) {
                    v += sc[i * tile_k + j] * vs[j * head_dim + d];
                }
                acc[a] = v;
            }
        }
        SYNC();
    }
    for (int a = 0; a < TILE_MAX_ACC; a++) {
        int p = tid + a * nt;
        int i = p / head_dim;
        if (p < pairs && i < nq) {
            float denom = use_sinks ? l_run[i] + expf(sinks[h] - m_run[i]) : l_run[i];
            out[((long long)(t0 + i) * num_heads + h) * head_dim + p % head_dim] = acc[a] / denom;
        }
    }
}
