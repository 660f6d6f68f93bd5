//! With feature `cuda-emulator`, compiles the CUDA kernels (kernels.cu, moe.cu) as C++ against a
//! CPU emulation of the CUDA execution model (emulator.cpp), for the CUDA backend's tests.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda-emulator")]
    {
        println!("cargo:rerun-if-changed=src/backend/cuda/kernels.cu");
        println!("cargo:rerun-if-changed=src/backend/cuda/moe.cu");
        println!("cargo:rerun-if-changed=src/backend/cuda/emulator.cpp");
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file("src/backend/cuda/emulator.cpp")
            .include("src/backend/cuda")
            .opt_level(2)
            .warnings(false)
            .compile("strata_cuda_emulator");
    }
}
