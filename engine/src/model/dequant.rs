//! Weights published in quantized formats, dequantized at load to the model's dtype (what
//! transformers computes with when it loads them with `dequantize=True`): memory is then
//! the dtype's, and `--quantize int8` shrinks it again.
//!
//! - **FP8** (`quant_method: "fp8"`, DeepSeek-V3/R1, Qwen3-FP8): E4M3 values, one f32
//!   `weight_scale_inv` per `weight_block_size` block of the `[out, in]` matrix;
//!   `w = fp8 · scale`.
//! - **MXFP4** (`quant_method: "mxfp4"`, gpt-oss experts): for each output row, groups of
//!   32 input values as 16 bytes of FP4 (E2M1) pairs, low nibble first, and one E8M0
//!   scale byte per group; `w = fp4 · 2^(scale − 127)`.

use rayon::prelude::*;
use strata_common::{Error, Result};

use crate::tensor::{DType, HostTensor};

/// E2M1 values by nibble: sign in bit 3.
const FP4: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// An E4M3 byte's value (bias 7, no infinities; `S.1111.111` is NaN).
pub fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = ((b >> 3) & 0xf, (b & 7) as f32);
    match (exp, b & 7) {
        (0xf, 7) => f32::NAN,
        (0, _) => sign * man / 8.0 * (-6f32).exp2(),
        _ => sign * (1.0 + man / 8.0) * (exp as f32 - 7.0).exp2(),
    }
}

/// `weight` (`[out, in]` E4M3 bytes) times its `scales` (`[⌈out / b₀⌉, ⌈in / b₁⌉]`).
pub fn fp8_blocks(
    weight: &HostTensor,
    scales: &HostTensor,
    block: [usize; 2],
    dtype: DType,
) -> Result<HostTensor> {
    let bad = |why: String| {
        Err(Error::model_file(weight.file.as_path(), format!("tensor {:?}: {why}", weight.name)))
    };
    let [rows, cols] = weight.shape[..] else {
        return bad(format!("an FP8 weight of shape {:?} (expected 2-D)", weight.shape));
    };
    let [b0, b1] = block;
    let want = [rows.div_ceil(b0.max(1)), cols.div_ceil(b1.max(1))];
    if b0 == 0 || b1 == 0 || scales.shape != want {
        return bad(format!("scales of shape {:?} for blocks {block:?} (expected {want:?})", scales.shape));
    }
    let (s, bytes) = (scales.to_f32_vec(), weight.bytes());
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols.max(1)).zip(bytes.par_chunks(cols.max(1))).enumerate().for_each(|(r, (o, w))| {
        let row_scales = &s[(r / b0) * want[1]..(r / b0 + 1) * want[1]];
        for (c, (o, &b)) in o.iter_mut().zip(w).enumerate() {
            *o = e4m3(b) * row_scales[c / b1];
        }
    });
    Ok(HostTensor::from_f32(&weight.name, &[rows, cols], &out).cast(dtype))
}

/// One expert of MXFP4 blocks (`[rows, ⌈cols / 32⌉, 16]` bytes) and scales (`[rows,
/// ⌈cols / 32⌉]`) as a `[rows, cols]` matrix.
pub fn mxfp4(
    name: &str,
    blocks: &HostTensor,
    scales: &HostTensor,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<HostTensor> {
    let groups = cols.div_ceil(32);
    let (b, s) = (blocks.bytes(), scales.bytes());
    if b.len() != rows * groups * 16 || s.len() != rows * groups {
        return Err(Error::model_file(
            blocks.file.as_path(),
            format!("{name}: MXFP4 blocks of {} bytes and {} scales for [{rows}, {cols}]", b.len(), s.len()),
        ));
    }
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols.max(1)).enumerate().for_each(|(r, o)| {
        for (g, chunk) in o.chunks_mut(32).enumerate() {
            let scale = (s[r * groups + g] as i32 - 127) as f32;
            let bytes = &b[(r * groups + g) * 16..(r * groups + g + 1) * 16];
            for (i, v) in chunk.iter_mut().enumerate() {
                let nibble = (bytes[i / 2] >> (4 * (i % 2))) & 0xf;
                *v = FP4[nibble as usize] * scale.exp2();
            }
        }
    });
    Ok(HostTensor::from_f32(name, &[rows, cols], &out).cast(dtype))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(name: &str, shape: &[usize], data: &[u8]) -> HostTensor {
        HostTensor::from_f32(name, shape, &data.iter().map(|&b| b as i8 as f32).collect::<Vec<_>>())
            .cast(DType::I8)
    }

    #[test]
    fn e4m3_bytes_decode_as_the_format_defines() {
        assert_eq!(e4m3(0x00), 0.0);
        assert_eq!(e4m3(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(e4m3(0x7e), 448.0); // the largest: 1.75 · 2^8
        assert_eq!(e4m3(0xfe), -448.0);
        assert_eq!(e4m3(0x01), (-9f32).exp2()); // the smallest subnormal
        assert_eq!(e4m3(0x3c), 1.5);
        assert!(e4m3(0x7f).is_nan() && e4m3(0xff).is_nan());
    }

    #[test]
    fn fp8_weights_take_their_blocks_scales() {
        // [3, 3] weights of 1.0 (and one 1.5), blocks of 1 row × 2 columns: scales [3, 2].
        let mut ones = [0x38u8; 9];
        ones[4] = 0x3c;
        let w = bytes("w", &[3, 3], &ones);
        let s = HostTensor::from_f32("w_scale_inv", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let d = fp8_blocks(&w, &s, [1, 2], DType::F32).unwrap();
        assert_eq!(d.to_f32_vec(), [1.0, 1.0, 2.0, 3.0, 4.5, 4.0, 5.0, 5.0, 6.0]);
        let e = fp8_blocks(&w, &s, [2, 1], DType::F32).unwrap_err().to_string();
        assert!(e.contains("scales of shape"), "{e}");
    }

    #[test]
    fn mxfp4_nibbles_low_first_times_two_to_the_scale() {
        // One row of 34 values: a full group and a partial one.
        let mut blocks = vec![0u8; 2 * 16];
        blocks[0] = 0x2f; // values 0, 1: nibbles f (-6) and 2 (1.0)
        blocks[16] = 0x97; // values 32, 33: nibbles 7 (6.0) and 9 (-0.5)
        let b = bytes("x_blocks", &[1, 2, 16], &blocks);
        let s = bytes("x_scales", &[1, 2], &[128, 125]); // 2^1 and 2^-2
        let d = mxfp4("x", &b, &s, 1, 34, DType::F32).unwrap().to_f32_vec();
        assert_eq!((d[0], d[1], d[2]), (-12.0, 2.0, 0.0));
        assert_eq!((d[32], d[33]), (1.5, -0.125));
        assert!(mxfp4("x", &b, &s, 2, 34, DType::F32).is_err());
    }
}
