// A CPU emulation of the CUDA execution model, just enough for kernels.cu: each block
// runs with one OS thread per CUDA thread, SYNC() is a barrier across the block, SHARED
// variables are statics (blocks run one after another, and launches are serialised by
// the caller), dynamic shared memory is a buffer per block. Device pointers are host
// pointers. Used by the tests of the CUDA backend on machines without a GPU: the kernels
// compiled here are the very source NVRTC compiles for the GPU.

#include <math.h>

#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x, y, z;
};

static thread_local dim3 threadIdx;
static thread_local dim3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;
static thread_local std::barrier<>* emu_block_barrier;
static thread_local unsigned char* emu_dynamic_shared;

static inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
static inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}

#define KERNEL static
#define DEVICE static inline
#define SHARED static
#define DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(emu_dynamic_shared)
#define SYNC() emu_block_barrier->arrive_and_wait()

#include "kernels.cu"
#include "moe.cu"

template <typename... A, size_t... I>
static void emu_call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(args[I])...);
}

template <typename... A>
static void emu_run(void (*kernel)(A...), dim3 grid, dim3 block, unsigned shared, void** args) {
    unsigned threads = block.x * block.y * block.z;
    std::vector<unsigned char> dyn(shared > 0 ? shared : 1);
    for (unsigned bz = 0; bz < grid.z; bz++) {
        for (unsigned by = 0; by < grid.y; by++) {
            for (unsigned bx = 0; bx < grid.x; bx++) {
                std::barrier<> bar(threads);
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (unsigned t = 0; t < threads; t++) {
                    pool.emplace_back([&, t] {
                        threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                        blockIdx = dim3{bx, by, bz};
                        blockDim = block;
                        gridDim = grid;
                        emu_block_barrier = &bar;
                        emu_dynamic_shared = dyn.data();
                        emu_call(kernel, args, std::index_sequence_for<A...>{});
                    });
                }
                for (auto& th : pool) {
                    th.join();
                }
            }
        }
    }
}

#define EMU_KERNEL(name)                              \
    if (std::strcmp(kernel, #name) == 0) {            \
        emu_run(name, grid, block, shared, args);     \
        return 0;                                     \
    }

// Runs kernel `kernel` (its name in kernels.cu); `args[i]` points to the i-th argument's
// value, as cuLaunchKernel takes them. Returns 0, or -1 for an unknown kernel.
extern "C" int strata_emu_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned shared, void** args) {
    dim3 grid{gx, gy, gz};
    dim3 block{bx, 1, 1};
    EMU_KERNEL(cast_bf16)
    EMU_KERNEL(add_bias)
    EMU_KERNEL(add)
    EMU_KERNEL(silu_mul)
    EMU_KERNEL(gelu_tanh_mul)
    EMU_KERNEL(clamped_swiglu_mul)
    EMU_KERNEL(pointwise)
    EMU_KERNEL(scatter_add_rows)
    EMU_KERNEL(rms_norm)
    EMU_KERNEL(add_rms_norm)
    EMU_KERNEL(rope)
    EMU_KERNEL(rope_write_kv)
    EMU_KERNEL(embed)
    EMU_KERNEL(write_kv)
    EMU_KERNEL(gather_rows)
    EMU_KERNEL(copy_block)
    EMU_KERNEL(unshard_rows)
    EMU_KERNEL(greedy_pick)
    EMU_KERNEL(top_logits)
    EMU_KERNEL(draw_tokens)
    EMU_KERNEL(paged_attention)
    EMU_KERNEL(tiled_attention)
    EMU_KERNEL(moe_route)
    EMU_KERNEL(moe_align)
    EMU_KERNEL(moe_gemm)
    EMU_KERNEL(moe_combine)
    return -1;
}
