//! Multi-head latent attention (DeepSeek-V3), with the KV cache holding the latent.
//!
//! transformers computes it expanded: each position's `kv_lora_rank`-wide latent `c`
//! (normed) goes through `kv_b_proj` into every head's key (`qk_nope_head_dim` wide, plus
//! the `qk_rope_head_dim` rotated key shared by the heads) and value (`v_head_dim`). That
//! costs a cache of `heads · (qk + v)` values a position. Here the cache holds only what
//! the latent needs — `c` and the rotated key, `kv_lora_rank + qk_rope_head_dim` values a
//! position, stored once (keys are values: [`AttentionOps::alloc_kv_shared`]) — and
//! `kv_b_proj` is absorbed into the queries and the outputs instead, which is the same
//! arithmetic reordered:
//!
//! - `q_nope · (W_UKₕ c) = (W_UKₕᵀ q_nope) · c`: each head's query is taken into the
//!   latent space, `[q_latent ‖ q_rope]`, and attends to `[c ‖ k_rope]` as one KV head
//!   shared by all query heads (MQA of width `kv_lora_rank + qk_rope_head_dim`);
//! - `Σ p · (W_UVₕ c) = W_UVₕ (Σ p · c)`: the head's output is the weighted latent (the
//!   attention's first `kv_lora_rank` columns) through `W_UVₕ`.
//!
//! Rope dims stored interleaved (`rope_interleave`) are de-interleaved in the weights at
//! load, which is what transformers' interleaved rotation computes. YaRN's attention factor
//! scales the rotated dims (the rope table's scale); the softmax scale carries
//! `mscale_all_dim`'s. Tensor parallelism splits the heads; every rank
//! computes and caches the latent (it is shared by all heads).
//!
//! [`AttentionOps::alloc_kv_shared`]: crate::backend::AttentionOps::alloc_kv_shared

use std::ops::Range;

use strata_common::{Error, Latent, Result};

use super::loader::ShardLoader;
use super::parts::{Linear, Norm, NormKind, PartCx};
use crate::backend::{AttentionShape, Backend};
use crate::tensor::HostTensor;

/// A layer's latent attention, this rank's heads of it.
pub(super) struct LatentAttention<B: Backend> {
    pub dims: Latent,
    pub heads: usize,
    /// The queries' low-rank first half and its norm (`q_a_proj`, `q_a_layernorm`).
    pub q_a: Option<(Linear<B>, Norm<B>)>,
    /// This rank's heads' query parts: `[heads · qk_nope, in]` and `[heads · qk_rope, in]`.
    pub q_nope: Linear<B>,
    pub q_rope: Linear<B>,
    /// The latent and the rotated key (`kv_a_proj_with_mqa`'s two parts), the latent's norm.
    pub kv_latent: Linear<B>,
    pub k_rope: Linear<B>,
    pub kv_norm: Norm<B>,
    /// Per head: `W_UKₕᵀ` as `[kv_lora, qk_nope]` and `W_UVₕ` as `[v, kv_lora]`.
    pub absorb_k: Vec<B::Weight>,
    pub absorb_v: Vec<B::Weight>,
    pub o: Linear<B>,
    pub shape: AttentionShape,
}

impl<B: Backend> LatentAttention<B> {
    pub fn forward(
        &self,
        cx: &mut PartCx<'_, B>,
        normed: &B::Tensor,
        cache: &mut B::KvLayer,
    ) -> Result<B::Tensor> {
        let b = cx.b;
        let (l, r, nope) = (self.dims.kv_lora_rank, self.dims.qk_rope_head_dim, self.dims.qk_nope_head_dim);
        let rope = cx.ropes.first().ok_or_else(|| Error::Internal("no rope table".into()))?;
        let positions = &cx.layout.positions;
        let low;
        let q_in = match &self.q_a {
            Some((a, norm)) => {
                low = norm.apply(b, &a.apply(b, normed)?)?;
                &low
            }
            None => normed,
        };
        let [q_nope, mut q_rope] = Linear::apply_many(b, q_in, [&self.q_nope, &self.q_rope])?;
        let [c, mut k_rope] = Linear::apply_many(b, normed, [&self.kv_latent, &self.k_rope])?;
        let c = self.kv_norm.apply(b, &c)?;
        let (q_rope, k_rope) = match cx.mixed_ropes {
            Some(_) => (cx.rope(q_rope, r, 0)?, cx.rope(k_rope, r, 0)?),
            None => {
                b.rope(&mut q_rope, r, positions, rope)?;
                b.rope(&mut k_rope, r, positions, rope)?;
                (q_rope, k_rope)
            }
        };
        let latent = b.concat_columns(&[&c, &k_rope])?;
        b.write_kv(cache, &latent, &latent, cx.layout.for_group(cx.kv_group))?;
        let mut parts = Vec::with_capacity(2 * self.heads);
        for h in 0..self.heads {
            let qn = b.columns(&q_nope, h * nope..(h + 1) * nope)?;
            parts.push(b.matmul(&qn, &self.absorb_k[h])?);
            parts.push(b.columns(&q_rope, h * r..(h + 1) * r)?);
        }
        let q = b.concat_columns(&parts.iter().collect::<Vec<_>>())?;
        let attn = b.attention(&q, cache, cx.layout.for_group(cx.kv_group), self.shape, None)?;
        let width = l + r;
        let mut outs = Vec::with_capacity(self.heads);
        for h in 0..self.heads {
            let weighted = b.columns(&attn, h * width..h * width + l)?;
            outs.push(b.matmul(&weighted, &self.absorb_v[h])?);
        }
        let mut o = self.o.apply(b, &b.concat_columns(&outs.iter().collect::<Vec<_>>())?)?;
        cx.reduce(&mut o)?;
        Ok(o)
    }
}

/// The order in which a head's rope dims are read: interleaved pairs `(0, 1), (2, 3), …`
/// become halves `0, 2, … | 1, 3, …` (the layout rotate-half rope expects).
fn rope_order(r: usize, interleave: bool) -> Vec<usize> {
    match interleave {
        true => (0..r).step_by(2).chain((1..r).step_by(2)).collect(),
        false => (0..r).collect(),
    }
}

impl<B: Backend> ShardLoader<'_, B> {
    /// Latent attention's matrices are read in pieces of rows (and transposed), which an
    /// int8 checkpoint's per-row scales do not follow: such a checkpoint is refused.
    fn refuse_int8(&self, weight: &str) -> Result<()> {
        match self.ckpt.contains(&format!("{weight}_scale")) {
            true => Err(Error::Unsupported(format!(
                "{weight}: an int8 checkpoint of latent attention (load the bf16 one, with --quantize int8)"
            ))),
            false => Ok(()),
        }
    }

    /// Rows `rows` (in that order) of the `[out, in]` matrix `name` as a weight, with the
    /// same rows of its bias where `bias`.
    fn picked(&mut self, name: &str, shape: [usize; 2], rows: &[usize], bias: bool) -> Result<Linear<B>> {
        let weight = format!("{name}.weight");
        self.refuse_int8(&weight)?;
        let full = self.ckpt.get(&weight, &shape)?;
        let picked = full.select_rows(rows)?;
        let w = self.weight(&weight, picked, rows.len(), 0..rows.len())?;
        let bias = match bias {
            true => {
                let all = self.ckpt.get(&format!("{name}.bias"), &[shape[0]])?.to_f32_vec();
                let mine: Vec<f32> = rows.iter().map(|&i| all[i]).collect();
                Some(self.backend.load_vector(&HostTensor::from_f32(name, &[mine.len()], &mine))?)
            }
            false => None,
        };
        Ok(Linear { weight: w, bias })
    }

    /// This rank's heads of layer `p`'s latent attention.
    pub(super) fn latent_attention(
        &mut self,
        p: &str,
        dims: Latent,
        norm: NormKind,
    ) -> Result<LatentAttention<B>> {
        let (c, heads) = (self.config, self.shard.q_heads.clone());
        let (h, n) = (c.hidden_size, c.num_heads);
        let (l, r, nope, v) =
            (dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim);
        let (bias, qk) = (c.qkv_bias, nope + r);
        let order = rope_order(r, dims.rope_interleave);
        let a = format!("{p}.self_attn");
        // The config's dims against the checkpoint first: the row lists below are sized by
        // them (a kv_lora_rank of 10⁹ once allocated gigabytes before any shape check).
        let q_in = dims.q_lora_rank.unwrap_or(h);
        let (q_checked, qk_rows) = match dims.q_lora_rank {
            Some(rank) => {
                self.ckpt.check_shape(&format!("{a}.q_a_proj.weight"), &[rank, h])?;
                (format!("{a}.q_b_proj.weight"), n.saturating_mul(qk))
            }
            None => (format!("{a}.q_proj.weight"), n.saturating_mul(qk)),
        };
        self.ckpt.check_shape(&q_checked, &[qk_rows, q_in])?;
        self.ckpt.check_shape(&format!("{a}.kv_a_proj_with_mqa.weight"), &[l.saturating_add(r), h])?;
        self.ckpt
            .check_shape(&format!("{a}.kv_b_proj.weight"), &[n.saturating_mul(nope.saturating_add(v)), l])?;
        let (q_a, q_name, q_in) = match dims.q_lora_rank {
            Some(rank) => {
                let proj =
                    self.picked(&format!("{a}.q_a_proj"), [rank, h], &(0..rank).collect::<Vec<_>>(), bias)?;
                let norm = self.norm_of(&format!("{a}.q_a_layernorm.weight"), rank, norm)?;
                (Some((proj, norm)), format!("{a}.q_b_proj"), rank)
            }
            None => (None, format!("{a}.q_proj"), h),
        };
        let rows_of = |part: Range<usize>, order: &[usize]| -> Vec<usize> {
            heads.clone().flat_map(|hd| order.iter().map(move |&i| hd * qk + part.start + i)).collect()
        };
        let nope_rows = rows_of(0..nope, &(0..nope).collect::<Vec<_>>());
        let rope_rows = rows_of(nope..qk, &order);
        let q_nope = self.picked(&q_name, [n * qk, q_in], &nope_rows, false)?;
        let q_rope = self.picked(&q_name, [n * qk, q_in], &rope_rows, false)?;
        let kv_a = format!("{a}.kv_a_proj_with_mqa");
        let kv_latent = self.picked(&kv_a, [l + r, h], &(0..l).collect::<Vec<_>>(), bias)?;
        let k_rope =
            self.picked(&kv_a, [l + r, h], &order.iter().map(|i| l + i).collect::<Vec<_>>(), bias)?;
        let kv_norm = self.norm_of(&format!("{a}.kv_a_layernorm.weight"), l, norm)?;
        let kv_b_name = format!("{a}.kv_b_proj.weight");
        self.refuse_int8(&kv_b_name)?;
        let kv_b = self.ckpt.get(&kv_b_name, &[n * (nope + v), l])?;
        let (mut absorb_k, mut absorb_v) = (Vec::new(), Vec::new());
        for hd in heads.clone() {
            let at = hd * (nope + v);
            let uk = kv_b.rows(at..at + nope)?.transposed_columns(&(0..l).collect::<Vec<_>>())?;
            absorb_k.push(self.weight(&format!("{a}.kv_b_proj.k{hd}"), uk, l, 0..l)?);
            let uv = kv_b.rows(at + nope..at + nope + v)?;
            absorb_v.push(self.weight(&format!("{a}.kv_b_proj.v{hd}"), uv, v, 0..v)?);
        }
        let o = self.row(&format!("{a}.o_proj"), n * v, heads.start * v..heads.end * v, c.o_bias)?;
        Ok(LatentAttention {
            dims,
            heads: heads.len(),
            q_a,
            q_nope,
            q_rope,
            kv_latent,
            k_rope,
            kv_norm,
            absorb_k,
            absorb_v,
            o,
            shape: AttentionShape {
                num_heads: heads.len(),
                num_kv_heads: 1,
                head_dim: l + r,
                scale: dims.scale,
                sliding_window: None,
                softcap: None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn interleaved_rope_dims_are_read_as_halves() {
        assert_eq!(super::rope_order(6, true), [0, 2, 4, 1, 3, 5]);
        assert_eq!(super::rope_order(4, false), [0, 1, 2, 3]);
    }
}
