// A CPU emulation of the CUDA execution model, just enough for kernels.cu: a block runs
// with one OS thread per CUDA thread (threads kept across launches; they run every block
// of a launch, one block after another), SYNC() is a barrier across the block, SHARED variables are
// statics (blocks run one after another, and launches are serialised by the caller), dynamic shared memory is a buffer per block. Device pointers are host
// pointers. Used by the tests of the CUDA backend on machines without a GPU: the kernels
// compiled here are the very source NVRTC compiles for the GPU.

#include <math.h>

#include <barrier>
#include <condition_variable>
#include <functional>
#include <mutex>
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

// The OS threads that stand for a block's CUDA threads, kept across launches (starting
// hundreds of threads per launch cost more than the kernels). A launch hands every one of
// its first `active` threads the same job, with its thread index, and waits for them all.
class EmuPool {
  public:
    void run(unsigned active, const std::function<void(unsigned)>& job) {
        std::unique_lock<std::mutex> lock(mutex_);
        while (workers_.size() < active) {
            unsigned index = workers_.size();
            workers_.emplace_back([this, index] { work(index); });
        }
        job_ = &job;
        active_ = active;
        remaining_ = active;
        generation_++;
        wake_.notify_all();
        done_.wait(lock, [this] { return remaining_ == 0; });
        job_ = nullptr;
    }

  private:
    void work(unsigned index) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(unsigned)>* job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return generation_ != seen && index < active_; });
                seen = generation_;
                job = job_;
            }
            (*job)(index);
            std::lock_guard<std::mutex> lock(mutex_);
            if (--remaining_ == 0) {
                done_.notify_one();
            }
        }
    }

    std::mutex mutex_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    const std::function<void(unsigned)>* job_ = nullptr;
    unsigned active_ = 0, remaining_ = 0;
    uint64_t generation_ = 0;
};

// Launches are serialised by the caller, so one pool serves them all. Its threads live as
// long as the process (detached at exit: they only ever wait for the next launch).
static EmuPool& emu_pool() {
    static EmuPool* pool = new EmuPool();
    return *pool;
}

// Every block of the grid in order, run by the pool's threads: a barrier after each block
// keeps the blocks one after another (SHARED variables are statics, one copy for the
// whole grid).
template <typename... A>
static void emu_run(void (*kernel)(A...), dim3 grid, dim3 block, unsigned shared, void** args) {
    unsigned threads = block.x * block.y * block.z;
    std::vector<unsigned char> dyn(shared > 0 ? shared : 1);
    std::barrier<> bar(threads);
    std::function<void(unsigned)> job = [&](unsigned t) {
        threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        blockDim = block;
        gridDim = grid;
        emu_block_barrier = &bar;
        emu_dynamic_shared = dyn.data();
        for (unsigned bz = 0; bz < grid.z; bz++) {
            for (unsigned by = 0; by < grid.y; by++) {
                for (unsigned bx = 0; bx < grid.x; bx++) {
                    blockIdx = dim3{bx, by, bz};
                    emu_call(kernel, args, std::index_sequence_for<A...>{});
                    bar.arrive_and_wait();
                }
            }
        }
    };
    emu_pool().run(threads, job);
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
    EMU_KERNEL(mask_logits)
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
