//! A step's batch layout as the kernels read it: host arrays, and their device copy.
//!
//! Eager steps upload the arrays once per step (the first op that needs them) and every
//! layer reuses them. A captured decode graph keeps a layout of fixed capacity instead —
//! block tables at a fixed stride per sequence — whose contents are rewritten before each
//! replay, so the addresses baked into the graph stay valid.

use strata_common::{Error, Result};

use super::device::Gpu;
use super::{dim, i32_bytes, to_i32, TILE_Q};
use crate::backend::BatchLayout;

/// The arrays the attention, RoPE and KV kernels take, in the kernels' i32.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct LayoutArrays {
    pub positions: Vec<i32>,
    pub slots: Vec<i32>,
    /// The sequence each token row belongs to.
    pub tok_seq: Vec<i32>,
    pub seq_start: Vec<i32>,
    /// Tokens each sequence had in the cache before the step.
    pub seq_ctx: Vec<i32>,
    /// Where each sequence's block table starts in `tables`.
    pub bt_offset: Vec<i32>,
    pub tables: Vec<i32>,
    /// Prefill chunks in tiles for tiled_attention: each tile's first token row and rows.
    pub tiles: Vec<i32>,
    pub tile_len: Vec<i32>,
    /// Rows of the decoding sequences (one new token each), for paged_attention.
    pub decode_rows: Vec<i32>,
}

impl LayoutArrays {
    /// The arrays of `layout`; block tables back to back, or each at `table_stride`
    /// entries from the last (a fixed-capacity layout).
    pub fn of(layout: &BatchLayout, table_stride: Option<usize>) -> Result<Self> {
        let mut a = LayoutArrays {
            positions: to_i32(layout.positions.iter().map(|&p| p as usize))?,
            slots: to_i32(layout.slots.iter().map(|&s| s as usize))?,
            tok_seq: vec![0; layout.num_tokens()],
            ..Default::default()
        };
        for (s, seq) in layout.seqs.iter().enumerate() {
            a.tok_seq
                .get_mut(seq.token_start..seq.token_start + seq.num_tokens)
                .ok_or_else(|| Error::Internal("a sequence's rows lie outside the step".into()))?
                .fill(s as i32);
            a.seq_start.push(dim(seq.token_start)?);
            a.seq_ctx.push(dim(seq.context_before)?);
            let offset = match table_stride {
                Some(stride) if seq.block_table.len() > stride => {
                    return Err(Error::Internal(format!(
                        "a block table of {} blocks in a layout of {stride}",
                        seq.block_table.len()
                    )))
                }
                Some(stride) => s * stride,
                None => a.tables.len(),
            };
            a.bt_offset.push(dim(offset)?);
            a.tables.resize(offset, 0);
            a.tables.extend(to_i32(seq.block_table.iter().map(|&b| b as usize))?);
            if seq.num_tokens == 1 {
                a.decode_rows.push(dim(seq.token_start)?);
                continue;
            }
            for first in (0..seq.num_tokens).step_by(TILE_Q) {
                a.tiles.push(dim(seq.token_start + first)?);
                a.tile_len.push(dim(TILE_Q.min(seq.num_tokens - first))?);
            }
        }
        if let Some(stride) = table_stride {
            a.tables.resize(layout.seqs.len() * stride, 0);
        }
        Ok(a)
    }
}

/// A step's batch layout in device memory.
pub(super) struct DeviceLayout<B> {
    /// The arrays it was made from, back to back (an op of the same step finds it by them).
    pub key: LayoutArrays,
    pub positions: B,
    pub slots: B,
    pub tok_seq: B,
    pub seq_start: B,
    pub seq_ctx: B,
    pub bt_offset: B,
    pub block_tables: B,
    pub tiles: B,
    pub tile_len: B,
    pub num_tiles: usize,
    pub decode_rows: B,
    pub num_decode_rows: usize,
}

impl<B> DeviceLayout<B> {
    /// Uploads `layout` with its block tables at `table_stride` (None: back to back).
    pub fn upload<G: Gpu<Buf = B>>(
        gpu: &G,
        layout: &BatchLayout,
        table_stride: Option<usize>,
    ) -> Result<Self> {
        let key = LayoutArrays::of(layout, None)?;
        let a = if table_stride.is_some() { LayoutArrays::of(layout, table_stride)? } else { key.clone() };
        let up = |v: &[i32]| gpu.upload(i32_bytes(if v.is_empty() { &[0] } else { v }));
        Ok(DeviceLayout {
            positions: up(&a.positions)?,
            slots: up(&a.slots)?,
            tok_seq: up(&a.tok_seq)?,
            seq_start: up(&a.seq_start)?,
            seq_ctx: up(&a.seq_ctx)?,
            bt_offset: up(&a.bt_offset)?,
            block_tables: up(&a.tables)?,
            tiles: up(&a.tiles)?,
            tile_len: up(&a.tile_len)?,
            num_tiles: a.tiles.len(),
            decode_rows: up(&a.decode_rows)?,
            num_decode_rows: a.decode_rows.len(),
            key,
        })
    }

    /// Rewrites a fixed-capacity layout (from [`DeviceLayout::upload`] with the same
    /// stride) for the next step of the same shape: what a decode step changes —
    /// positions, slots, contexts and block tables. Errors if the shape differs. The key
    /// stays the captured step's: only its shape is read once the graph is captured.
    pub fn refill<G: Gpu<Buf = B>>(
        &mut self,
        gpu: &G,
        layout: &BatchLayout,
        table_stride: usize,
    ) -> Result<()> {
        let a = LayoutArrays::of(layout, Some(table_stride))?;
        let same_shape = a.tok_seq == self.key.tok_seq
            && a.seq_start == self.key.seq_start
            && a.decode_rows == self.key.decode_rows
            && a.tiles.is_empty()
            && self.num_tiles == 0;
        if !same_shape {
            return Err(Error::Internal("a graph's layout refilled with a step of another shape".into()));
        }
        gpu.write(&mut self.positions, i32_bytes(&a.positions))?;
        gpu.write(&mut self.slots, i32_bytes(&a.slots))?;
        gpu.write(&mut self.seq_ctx, i32_bytes(&a.seq_ctx))?;
        gpu.write(&mut self.block_tables, i32_bytes(&a.tables))?;
        Ok(())
    }
}
