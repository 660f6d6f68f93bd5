//! The kernel sources and their names.
//!
//! `kernels.cu` and `moe.cu` are the CUDA C source of every kernel; [`Kernel`] names them (no string
//! look-ups at call sites). The source is compiled at start-up by NVRTC for the device's
//! architecture after [`NVRTC_PRELUDE`], which maps the portability macros the source
//! uses onto CUDA; the CPU emulator maps the same macros onto C++ threads (see
//! `emulator.cpp`).

/// The CUDA C source of every kernel: the dense model's, then the mixture of experts'.
pub const SOURCE: &str = concat!(include_str!("kernels.cu"), "\n", include_str!("moe.cu"));

/// Macro definitions that make [`SOURCE`] CUDA C for NVRTC.
pub const NVRTC_PRELUDE: &str = r#"
#define KERNEL extern "C" __global__
#define DEVICE __device__ __forceinline__
#define SHARED __shared__
#define DYN_SHARED(T, name) extern __shared__ T name[]
#define SYNC() __syncthreads()
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"#;

/// The full source NVRTC compiles.
pub fn nvrtc_source() -> String {
    format!("{NVRTC_PRELUDE}\n{SOURCE}")
}

/// Every kernel of [`SOURCE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    CastBf16,
    AddBias,
    Add,
    SiluMul,
    GeluTanhMul,
    ClampedSwigluMul,
    Pointwise,
    ScatterAddRows,
    RmsNorm,
    AddRmsNorm,
    Rope,
    RopeWriteKv,
    Embed,
    WriteKv,
    GatherRows,
    CopyBlock,
    UnshardRows,
    MaskLogits,
    GreedyPick,
    TopLogits,
    DrawTokens,
    PagedAttention,
    TiledAttention,
    MoeRoute,
    MoeAlign,
    MoeGemm,
    MoeCombine,
}

impl Kernel {
    pub const ALL: [Kernel; 27] = [
        Kernel::CastBf16,
        Kernel::AddBias,
        Kernel::Add,
        Kernel::SiluMul,
        Kernel::GeluTanhMul,
        Kernel::ClampedSwigluMul,
        Kernel::Pointwise,
        Kernel::ScatterAddRows,
        Kernel::RmsNorm,
        Kernel::AddRmsNorm,
        Kernel::Rope,
        Kernel::RopeWriteKv,
        Kernel::Embed,
        Kernel::WriteKv,
        Kernel::GatherRows,
        Kernel::CopyBlock,
        Kernel::UnshardRows,
        Kernel::MaskLogits,
        Kernel::GreedyPick,
        Kernel::TopLogits,
        Kernel::DrawTokens,
        Kernel::PagedAttention,
        Kernel::TiledAttention,
        Kernel::MoeRoute,
        Kernel::MoeAlign,
        Kernel::MoeGemm,
        Kernel::MoeCombine,
    ];

    /// The `extern "C"` name in the source.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::CastBf16 => "cast_bf16",
            Kernel::AddBias => "add_bias",
            Kernel::Add => "add",
            Kernel::SiluMul => "silu_mul",
            Kernel::GeluTanhMul => "gelu_tanh_mul",
            Kernel::ClampedSwigluMul => "clamped_swiglu_mul",
            Kernel::Pointwise => "pointwise",
            Kernel::ScatterAddRows => "scatter_add_rows",
            Kernel::RmsNorm => "rms_norm",
            Kernel::AddRmsNorm => "add_rms_norm",
            Kernel::Rope => "rope",
            Kernel::RopeWriteKv => "rope_write_kv",
            Kernel::Embed => "embed",
            Kernel::WriteKv => "write_kv",
            Kernel::GatherRows => "gather_rows",
            Kernel::CopyBlock => "copy_block",
            Kernel::UnshardRows => "unshard_rows",
            Kernel::MaskLogits => "mask_logits",
            Kernel::GreedyPick => "greedy_pick",
            Kernel::TopLogits => "top_logits",
            Kernel::DrawTokens => "draw_tokens",
            Kernel::PagedAttention => "paged_attention",
            Kernel::TiledAttention => "tiled_attention",
            Kernel::MoeRoute => "moe_route",
            Kernel::MoeAlign => "moe_align",
            Kernel::MoeGemm => "moe_gemm",
            Kernel::MoeCombine => "moe_combine",
        }
    }
}

/// The NVRTC architecture option for compute capability `major.minor` (PTX, which the
/// driver compiles for the exact device when the module loads).
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("compute_{major}{minor}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_in_the_source() {
        for k in Kernel::ALL {
            let decl = format!("KERNEL void {}(", k.name());
            assert!(SOURCE.contains(&decl), "{} is not defined in kernels.cu", k.name());
        }
        assert_eq!(
            SOURCE.matches("KERNEL void ").count(),
            Kernel::ALL.len(),
            "a kernel has no Kernel variant"
        );
    }

    /// Every kernel compiles to PTX for sm_80 and sm_90 with the NVRTC library found on
    /// `LD_LIBRARY_PATH` (`make test` installs PyPI's nvidia-cuda-nvrtc); no GPU needed.
    #[cfg(feature = "cuda")]
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
        crate::backend::cuda::driver::probe(&[crate::backend::cuda::driver::NVRTC])
            .expect("NVRTC must be present for this test (make prerequisites installs it)");
        for arch in ["compute_80", "compute_90"] {
            let ptx = crate::backend::cuda::driver::compile(arch)
                .unwrap_or_else(|e| panic!("kernels.cu does not compile for {arch}: {e}"));
            let text = ptx.to_src();
            for k in Kernel::ALL {
                assert!(text.contains(&format!(".entry {}(", k.name())), "{arch}: no entry for {}", k.name());
            }
        }
    }
}
