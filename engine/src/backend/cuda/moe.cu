// Mixture-of-experts kernels: a layer's routed experts run without leaving the device.
//
//   moe_route    router logits (f32) and each token's top-k experts and weights;
//   moe_align    the step's token-expert pairs grouped by expert into tiles of MOE_TM rows;
//   moe_gemm     one launch for every expert's projection over its tiles (a grouped GEMM);
//   moe_combine  each token's k outputs, weighted, summed in expert order.
//
// Nothing goes back to the host between them, so a decode step with experts is captured
// in a graph like any other. The routing mirrors the host's (backend/routing.rs) choice
// for choice: ties go to the lower expert id, a token's weights are summed in the order
// the host sums them, and the combine adds experts in id order from zero, as the host's
// scatter_add_rows does.
//
// Same rules as kernels.cu (this file is compiled after it, by NVRTC and the emulator):
// block-level shared memory, SYNC() reached by every thread, no warp intrinsics. Dynamic
// shared memory has a name of its own per element type (CUDA allows one type a name).

#define MOE_TM 16
#define MOE_KC 256
#define MOE_LANES 32
#define MOE_CPG 4
#define MOE_THREADS 256
#define MOE_COLS (MOE_THREADS / MOE_LANES * MOE_CPG)

DEVICE float moe_sigmoid(float l) {
    return 1.0f / (1.0f + expf(-l));
}

// The index of the largest of v[0..n) not yet taken (taken[i] != 0), the lower on ties;
// -1 when every one is taken.
DEVICE int moe_best(const float* v, const int* taken, int n) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (!taken[i] && (best < 0 || v[i] > v[best])) {
            best = i;
        }
    }
    return best;
}

// Softmax routing of one token (host: routing.rs `route`). `p` holds the logits on entry.
DEVICE void moe_pick_softmax(float* p, int* taken, int experts, int k, int norm, int* ids, float* w) {
    float mx = -INFINITY;
    for (int e = 0; e < experts; e++) {
        mx = fmaxf(mx, p[e]);
    }
    float sum = 0.0f;
    for (int e = 0; e < experts; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
        taken[e] = 0;
    }
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        int e = moe_best(p, taken, experts);
        taken[e] = 1;
        ids[j] = e;
        w[j] = p[e] / sum;
        total += w[j];
    }
    if (norm) {
        for (int j = 0; j < k; j++) {
            w[j] = w[j] / total;
        }
    }
}

// DeepSeek-V3's grouped routing of one token (host: routing.rs `route_grouped`). `s` holds
// the logits on entry; `c` and `taken` are scratch of `experts` each. n_group ≤ 64, k ≤ 64.
DEVICE void moe_pick_grouped(float* s, float* c, int* taken, const float* correction, int experts, int k,
                             int norm, int n_group, int topk_group, float scale, int* ids, float* w) {
    int per = experts / (n_group > 0 ? n_group : 1);
    int best_of_group = per < 2 ? per : 2;
    for (int e = 0; e < experts; e++) {
        s[e] = moe_sigmoid(s[e]);
        c[e] = s[e] + correction[e];
        taken[e] = 0;
    }
    // Each group's score: the sum of its two best biased scores, the best first.
    float group_score[64];
    int kept[64];
    for (int g = 0; g < n_group; g++) {
        float sum = 0.0f;
        for (int j = 0; j < best_of_group; j++) {
            int b = moe_best(c + g * per, taken + g * per, per);
            taken[g * per + b] = 1;
            sum += c[g * per + b];
        }
        group_score[g] = sum;
        kept[g] = 0;
    }
    // The best topk_group groups stay in the running; the others' experts drop to -inf
    // (chosen only if too few remain, the lowest ids first, as the host's sort does).
    for (int j = 0; j < topk_group && j < n_group; j++) {
        int best = moe_best(group_score, kept, n_group);
        kept[best] = 1;
    }
    for (int e = 0; e < experts; e++) {
        taken[e] = 0;
        if (e / per >= n_group || !kept[e / per]) {
            c[e] = -INFINITY;
        }
    }
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        int e = moe_best(c, taken, experts);
        taken[e] = 1;
        ids[j] = e;
        total += s[e];
    }
    total += 1e-20f;
    for (int j = 0; j < k; j++) {
        float v = norm ? s[ids[j]] / total : s[ids[j]];
        w[j] = v * scale;
    }
}

// One block per token: logits[e] = x[t] · router[e] (+ bias[e]) in f32, then the token's
// top-k experts (`mode` 0: softmax, 1: grouped) written in ascending expert id with their
// weights. Dynamic shared memory: (3 · experts + blockDim.x) floats. k ≤ 64.
KERNEL void moe_route(const float* x, const float* router, const float* bias, int has_bias,
                      const float* correction, int mode, int norm, int n_group, int topk_group, float scale,
                      int hidden, int experts, int k, int* ids_out, float* w_out) {
    DYN_SHARED(float, moe_route_shared);
    float* logits = moe_route_shared;
    float* scratch = logits + experts;
    int* taken = (int*)(logits + 2 * experts);
    float* part = logits + 3 * experts;
    int t = threadIdx.x;
    int lane = t % MOE_LANES;
    int groups = blockDim.x / MOE_LANES;
    const float* xr = x + (long long)blockIdx.x * hidden;
    for (int e0 = 0; e0 < experts; e0 += groups) {
        int e = e0 + t / MOE_LANES;
        float s = 0.0f;
        if (e < experts) {
            const float* r = router + (long long)e * hidden;
            for (int i = lane; i < hidden; i += MOE_LANES) {
                s += xr[i] * r[i];
            }
        }
        part[t] = s;
        SYNC();
        for (int stride = MOE_LANES / 2; stride > 0; stride >>= 1) {
            if (lane < stride) {
                part[t] += part[t + stride];
            }
            SYNC();
        }
        if (lane == 0 && e < experts) {
            logits[e] = part[t] + (has_bias ? bias[e] : 0.0f);
        }
        SYNC();
    }
    if (t == 0) {
        int ids[64];
        float w[64];
        if (mode == 1) {
            moe_pick_grouped(logits, scratch, taken, correction, experts, k, norm, n_group, topk_group, scale,
                             ids, w);
        } else {
            moe_pick_softmax(logits, taken, experts, k, norm, ids, w);
        }
        // Ascending expert id: the order the combine adds them in.
        for (int i = 1; i < k; i++) {
            for (int j = i; j > 0 && ids[j - 1] > ids[j]; j--) {
                int ti = ids[j];
                ids[j] = ids[j - 1];
                ids[j - 1] = ti;
                float tw = w[j];
                w[j] = w[j - 1];
                w[j - 1] = tw;
            }
        }
        for (int j = 0; j < k; j++) {
            ids_out[blockIdx.x * k + j] = ids[j];
            w_out[blockIdx.x * k + j] = w[j];
        }
    }
}

// One block: groups the `pairs` token-expert pairs (ids, k a token) by expert. Each expert's
// pairs take a run of rows padded to MOE_TM, in token order; `pos[p]` is pair p's row,
// `src_row[r]` row r's token (-1: padding), `tile_expert[i]` the expert of tile i (rows
// i·MOE_TM..) or -1. `totals[e]` counts the pairs routed to e, step after step. Dynamic
// shared memory: 2 · experts ints.
KERNEL void moe_align(const int* ids, int pairs, int k, int experts, int max_tiles, int* pos, int* src_row,
                      int* tile_expert, long long* totals) {
    DYN_SHARED(int, moe_align_shared);
    int* count = moe_align_shared;
    int* start = count + experts;
    int t = threadIdx.x;
    for (int e = t; e < experts; e += blockDim.x) {
        int c = 0;
        for (int p = 0; p < pairs; p++) {
            c += ids[p] == e;
        }
        count[e] = c;
    }
    for (int r = t; r < max_tiles * MOE_TM; r += blockDim.x) {
        src_row[r] = -1;
    }
    for (int i = t; i < max_tiles; i += blockDim.x) {
        tile_expert[i] = -1;
    }
    SYNC();
    if (t == 0) {
        int run = 0;
        for (int e = 0; e < experts; e++) {
            start[e] = run;
            run += (count[e] + MOE_TM - 1) / MOE_TM * MOE_TM;
        }
    }
    SYNC();
    for (int e = t; e < experts; e += blockDim.x) {
        int at = start[e];
        for (int p = 0; p < pairs; p++) {
            if (ids[p] == e) {
                pos[p] = at;
                src_row[at] = p / k;
                at++;
            }
        }
        int tiles = (count[e] + MOE_TM - 1) / MOE_TM;
        for (int i = 0; i < tiles; i++) {
            tile_expert[start[e] / MOE_TM + i] = e;
        }
        totals[e] += count[e];
    }
}

// y[r] = x[row r] · W_eᵀ (+ b_e) for the rows r of every tile, e the tile's expert: a grouped
// GEMM over experts whose weights `weights[e]` ([n, kdim] bf16) and biases `biases[e]`
// ([n] f32) are device pointers. The input row of r is src_row[r] when `gathered` (the
// step's tokens), else r itself (an earlier projection's output); padding rows are
// skipped. Grid: (⌈n / MOE_COLS⌉, tiles), MOE_THREADS threads: each group of MOE_LANES
// threads computes MOE_CPG columns for the tile's rows, every weight read once a tile.
KERNEL void moe_gemm(const float* x, const int* src_row, int gathered, const unsigned long long* weights,
                     const unsigned long long* biases, int has_bias, const int* tile_expert, float* y, int kdim,
                     int n) {
    SHARED float xs[MOE_TM * MOE_KC];
    SHARED float red[MOE_THREADS * MOE_CPG];
    SHARED int rows[MOE_TM];
    int tile = blockIdx.y;
    int e = tile_expert[tile];
    if (e < 0) {
        return;  // the whole block: every thread reads the same tile
    }
    int t = threadIdx.x;
    int lane = t % MOE_LANES;
    int n0 = blockIdx.x * MOE_COLS + (t / MOE_LANES) * MOE_CPG;
    int r0 = tile * MOE_TM;
    if (t < MOE_TM) {
        int s = src_row[r0 + t];
        rows[t] = s < 0 ? -1 : (gathered ? s : r0 + t);
    }
    SYNC();
    int live = 0;
    while (live < MOE_TM && rows[live] >= 0) {
        live++;
    }
    const bf16_t* w = (const bf16_t*)weights[e];
    float acc[MOE_TM][MOE_CPG];
    for (int r = 0; r < MOE_TM; r++) {
        for (int c = 0; c < MOE_CPG; c++) {
            acc[r][c] = 0.0f;
        }
    }
    for (int k0 = 0; k0 < kdim; k0 += MOE_KC) {
        int kc = kdim - k0 < MOE_KC ? kdim - k0 : MOE_KC;
        for (int i = t; i < live * MOE_KC; i += blockDim.x) {
            int r = i / MOE_KC;
            int kk = i % MOE_KC;
            xs[i] = kk < kc ? x[(long long)rows[r] * kdim + k0 + kk] : 0.0f;
        }
        SYNC();
        for (int kk = lane; kk < kc; kk += MOE_LANES) {
            for (int c = 0; c < MOE_CPG; c++) {
                int col = n0 + c;
                float wv = col < n ? bf16_to_f32(w[(long long)col * kdim + k0 + kk]) : 0.0f;
                for (int r = 0; r < MOE_TM; r++) {
                    if (r < live) {
                        acc[r][c] += wv * xs[r * MOE_KC + kk];
                    }
                }
            }
        }
        SYNC();
    }
    const float* b = has_bias ? (const float*)biases[e] : 0;
    for (int r = 0; r < live; r++) {
        for (int c = 0; c < MOE_CPG; c++) {
            red[t * MOE_CPG + c] = acc[r][c];
        }
        SYNC();
        for (int stride = MOE_LANES / 2; stride > 0; stride >>= 1) {
            if (lane < stride) {
                for (int c = 0; c < MOE_CPG; c++) {
                    red[t * MOE_CPG + c] += red[(t + stride) * MOE_CPG + c];
                }
            }
            SYNC();
        }
        if (lane < MOE_CPG) {
            int col = n0 + lane;
            if (col < n) {
                float v = red[(t - lane) * MOE_CPG + lane];
                y[(long long)(r0 + r) * n + col] = b ? v + b[col] : v;
            }
        }
        SYNC();
    }
}

// One block per token: out[t] = Σ_j w[t, j] · y[pos[t, j]], j in ascending expert id,
// from zero.
KERNEL void moe_combine(const float* y, const int* pos, const float* w, float* out, int k, int cols) {
    int tok = blockIdx.x;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            acc += w[tok * k + j] * y[(long long)pos[tok * k + j] * cols + c];
        }
        out[(long long)tok * cols + c] = acc;
    }
}
