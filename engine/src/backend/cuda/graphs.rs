//! Decode steps as captured graphs (CUDA graphs), one per batch-size bucket.
//!
//! A decode step launches ~17 kernels and GEMMs per layer; at small batches the GPU
//! finishes each faster than the host can queue the next, so the step is bound by launch
//! overhead. A graph queues the whole step — embedding, every layer, the LM head and the
//! greedy or top-k reduction — as one launch.
//!
//! How: a step of `n` decoding sequences is padded to the next bucket size `B` (1, 2, 4,
//! 8, 16, 24, 32, … 256) with dummy sequences that write and read only a scratch KV block
//! the backend keeps past the engine's blocks (their rows are computed and dropped; rows
//! never mix). The first step of a bucket runs eagerly (it loads kernels and fills the
//! backend's caches); the second is captured: the step's inputs go into buffers of fixed
//! size — token ids, positions, slots, contexts, block tables at a fixed stride — the
//! model's ops run with the device recording instead of executing, and the reduced
//! result is copied into a fixed output buffer. Every later step of that bucket rewrites
//! the inputs (four small copies; a fifth with the rows' draw parameters when the step
//! draws tokens on the device), replays the graph and reads the output. A step whose
//! block tables outgrow the stride is captured again at twice the stride. Anything the
//! capture cannot hold (an op that must reach the host), or a graph whose first replay
//! fails (its memory does not fit), leaves that bucket to run eagerly from then on.
//!
//! A tensor-parallel rank (one pipeline stage) captures its steps the same way when its
//! all-reduces are device work (NCCL on the backend's stream, which a capture records like
//! any kernel): every rank of the group sees the same steps, so every rank warms, captures
//! and replays the same buckets, and their graphs' collectives meet in the same order. The
//! graph ends at the rank's reduction of its vocabulary shard; the ranks then merge those
//! (picks, candidates or whole rows) across the group on the host. Pipeline stages
//! capture theirs too when they hand hidden states over on the device (NCCL's send and
//! receive): a stage's graph starts with the receive from the previous stage and, before
//! the last, ends with the send to the next (its step has no output; `vocab` 0).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use strata_common::{Error, Result};
use tracing::{debug, warn};

use super::device::Gpu;
use super::layout::DeviceLayout;
use super::{i32_bytes, to_i32, CudaBackend, GpuTensor};
use crate::backend::{BatchLayout, GraphOutput, SeqSlice, StepBody as Body};
use crate::logits::draw::draws_to_f32s;
use crate::logits::{Draw, LogitsWanted};
use crate::step::Step;

/// Batch sizes a graph is captured for; larger decode batches run eagerly (their launch
/// overhead is small beside their GEMMs).
pub const BUCKETS: [usize; 13] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256];
/// Block-table entries per sequence of a first capture (doubles as contexts grow).
const MIN_TABLE_STRIDE: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    rows: usize,
    wanted: LogitsWanted,
    /// Whether the step also draws its rows' tokens ([`crate::logits::draw`]).
    drawn: bool,
}

struct Captured<G: Gpu> {
    graph: G::Graph,
    layout: Arc<DeviceLayout<G::Buf>>,
    /// The layouts of KV groups 1, 2, …, where the model has them.
    groups: Vec<Arc<DeviceLayout<G::Buf>>>,
    ids: Arc<G::Buf>,
    _rows: Arc<G::Buf>,
    table_stride: usize,
    out: G::Buf,
    out_cols: usize,
    /// The draws' parameters and the drawn picks, when the step draws.
    draw: Option<(G::Buf, G::Buf)>,
}

/// The step inputs an op finds while a graph is captured instead of uploading its own.
pub(super) struct Pinned<B> {
    pub ids: Indices<B>,
    pub rows: Indices<B>,
}

/// Indices (token ids, logit rows), as the kernels' i32, and their device copy.
pub(super) struct Indices<B> {
    pub values: Vec<i32>,
    pub buf: Arc<B>,
}

pub(super) struct Graphs<G: Gpu> {
    enabled: bool,
    captured: HashMap<Key, Captured<G>>,
    /// Buckets whose first step ran eagerly.
    warm: HashSet<Key>,
    refused: HashSet<Key>,
}

impl<G: Gpu> Graphs<G> {
    pub fn new(enabled: bool) -> Self {
        Graphs { enabled, captured: HashMap::new(), warm: HashSet::new(), refused: HashSet::new() }
    }
}

/// The step padded to `rows` sequences.
struct Padded {
    step: Step,
    /// The draws' parameters as the kernel reads them (empty when the step draws none).
    draws: Vec<f32>,
}

/// Rows of a pure decode step (every sequence one new token, in order, each sampled), or
/// None for any other step.
fn decode_rows(step: &Step) -> Option<usize> {
    let n = step.layout.seqs.len();
    let in_order = step.layout.seqs.iter().enumerate().all(|(i, s)| s.token_start == i && s.num_tokens == 1);
    let sampled = step.logit_rows.iter().enumerate().all(|(i, &r)| r == i);
    (n > 0
        && in_order
        && sampled
        && step.hidden_rows.is_empty()
        && step.masks.is_none()
        && step.ids.len() == n
        && step.layout.positions.len() == n
        && step.layout.slots.len() == n
        && step.logit_rows.len() == n)
        .then_some(n)
}

/// `layout` padded to `rows` sequences with dummies that write and read `scratch_block`.
fn pad_layout(layout: &mut BatchLayout, rows: usize, scratch_block: u32) {
    let scratch_slot = scratch_block * layout.block_size as u32;
    for i in layout.positions.len()..rows {
        layout.positions.push(0);
        layout.slots.push(scratch_slot);
        layout.seqs.push(SeqSlice {
            token_start: i,
            num_tokens: 1,
            context_before: 0,
            block_table: vec![scratch_block],
        });
    }
}

/// `step` padded to `rows` sequences, drawing (`draw`) or not.
fn pad(step: &Step, draw: bool, rows: usize, scratch_block: u32) -> Padded {
    let mut draws = if draw { step.draws.clone() } else { Vec::new() };
    if !draws.is_empty() {
        draws.resize(rows, Draw::NONE);
    }
    let params = draws_to_f32s(&draws);
    let mut p = Padded {
        step: Step {
            ids: step.ids.clone(),
            layout: step.layout.clone(),
            logit_rows: (0..rows).collect(),
            wanted: step.wanted,
            draws,
            trace: None,
            hidden_rows: Vec::new(),
            masks: None,
        },
        draws: params,
    };
    p.step.ids.resize(rows, 0);
    pad_layout(&mut p.step.layout, rows, scratch_block);
    for g in &mut p.step.layout.groups {
        pad_layout(g, rows, scratch_block);
    }
    p
}

/// Columns of the reduced output: a pick (token, logit, log-sum-exp), `k` candidates and
/// their log-sum-exp, or the whole row.
fn out_cols(wanted: LogitsWanted, vocab: usize) -> usize {
    match wanted {
        LogitsWanted::Greedy => 3,
        LogitsWanted::Top(k) => 2 * k + 1,
        LogitsWanted::Full => vocab,
    }
}

impl<G: Gpu> CudaBackend<G> {
    /// See [`crate::backend::Backend::replay_decode`].
    pub(super) fn replay_decode_step(
        &self,
        step: &Step,
        output: GraphOutput,
        body: &mut Body<'_, GpuTensor<G::Buf>>,
    ) -> Result<Option<Vec<f32>>> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let (Some(n), Some(scratch)) = (decode_rows(step), self.scratch_block()) else { return Ok(None) };
        let Some(&rows) = BUCKETS.iter().find(|&&b| b >= n) else { return Ok(None) };
        let drawn = output.draw && !step.draws.is_empty();
        let key = Key { rows, wanted: output.wanted, drawn };
        if !graphs.enabled || graphs.refused.contains(&key) {
            return Ok(None);
        }
        let padded = pad(step, drawn, rows, scratch);
        let layouts = std::iter::once(&padded.step.layout).chain(&padded.step.layout.groups);
        let longest = layouts.flat_map(|l| l.seqs.iter().map(|s| s.block_table.len())).max().unwrap_or(0);
        if let Some(c) = graphs.captured.get_mut(&key).filter(|c| c.table_stride >= longest) {
            match self.replay(c, &padded, n) {
                Ok(out) => return Ok(Some(out)),
                // Rerunning the step eagerly is safe: it rewrites the same KV slots with
                // the same values.
                Err(e) => {
                    warn!(rows, wanted = ?output.wanted, error = %e, "a graph failed; decode steps of this batch size run without one");
                    graphs.captured.remove(&key);
                    graphs.refused.insert(key);
                    return Ok(None);
                }
            }
        }
        if graphs.warm.insert(key) {
            return Ok(None); // the bucket's first step runs eagerly
        }
        let stride = longest.next_power_of_two().max(MIN_TABLE_STRIDE);
        // The first replay belongs to the capture: a graph the device cannot run (its
        // memory does not fit beside the KV cache) leaves the step to run eagerly.
        let captured = self.capture(output, &padded, stride, body).and_then(|mut c| {
            let out = self.replay(&mut c, &padded, n)?;
            Ok((c, out))
        });
        match captured {
            Ok((c, out)) => {
                debug!(rows, wanted = ?output.wanted, table_stride = stride, "decode step captured as a graph");
                graphs.captured.insert(key, c);
                Ok(Some(out))
            }
            Err(e) => {
                warn!(rows, wanted = ?output.wanted, error = %e, "decode steps of this batch size run without a graph");
                graphs.refused.insert(key);
                graphs.captured.remove(&key);
                Ok(None)
            }
        }
    }

    fn capture(
        &self,
        output: GraphOutput,
        padded: &Padded,
        table_stride: usize,
        body: &mut Body<'_, GpuTensor<G::Buf>>,
    ) -> Result<Captured<G>> {
        let gpu = &*self.gpu;
        let p = &padded.step;
        let layout = Arc::new(DeviceLayout::upload(gpu, &p.layout, Some(table_stride))?);
        let groups = p
            .layout
            .groups
            .iter()
            .map(|g| DeviceLayout::upload(gpu, g, Some(table_stride)).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let ids_i = to_i32(p.ids.iter().map(|&i| i as usize))?;
        let rows_i = to_i32(p.logit_rows.iter().copied())?;
        let ids = Arc::new(gpu.upload(i32_bytes(&ids_i))?);
        let row_buf = Arc::new(gpu.upload(i32_bytes(&rows_i))?);
        // A step without output (`vocab` 0: a stage before the last, or a TP rank that
        // only joins a drawing step's gather) reduces and draws nothing.
        let out_cols = if output.vocab == 0 { 0 } else { out_cols(output.wanted, output.vocab) };
        let rows = p.logit_rows.len();
        let mut out = gpu.alloc(rows * out_cols * 4)?;
        let mut draw = None;
        if !padded.draws.is_empty() && out_cols > 0 {
            draw = Some((gpu.upload(bytemuck::cast_slice(&padded.draws))?, gpu.alloc(rows * 3 * 4)?));
        }
        // The ops of the captured step find these instead of uploading their own.
        *self.layout.lock().unwrap_or_else(|p| p.into_inner()) =
            std::iter::once(layout.clone()).chain(groups.iter().cloned()).collect();
        *self.pinned.lock().unwrap_or_else(|p| p.into_inner()) = Some(Pinned {
            ids: Indices { values: ids_i, buf: ids.clone() },
            rows: Indices { values: rows_i, buf: row_buf.clone() },
        });
        gpu.begin_capture()?;
        let recorded = (|| {
            let logits = body(p)?;
            if let Some((params, drawn)) = draw.as_mut() {
                let picks = self.draw_tensor(&logits, params, output.first_id)?;
                gpu.copy(&picks.buf, drawn, rows * 3 * 4)?;
            }
            if out_cols == 0 {
                return Ok(());
            }
            let reduced = self.reduce(logits, output.wanted, output.first_id)?;
            gpu.copy(&reduced.buf, &mut out, rows * out_cols * 4)
        })();
        let graph = gpu.end_capture();
        *self.pinned.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.layout.lock().unwrap_or_else(|p| p.into_inner()).clear();
        recorded?;
        Ok(Captured { graph: graph?, layout, groups, ids, _rows: row_buf, table_stride, out, out_cols, draw })
    }

    /// The step's logits reduced as `wanted` says, on the device.
    fn reduce(
        &self,
        logits: GpuTensor<G::Buf>,
        wanted: LogitsWanted,
        first_id: u32,
    ) -> Result<GpuTensor<G::Buf>> {
        match wanted {
            LogitsWanted::Greedy => self.greedy_tensor(&logits, first_id),
            LogitsWanted::Top(k) => self.top_tensor(&logits, k, first_id),
            LogitsWanted::Full => Ok(logits),
        }
    }

    /// Writes the step's inputs into the graph's buffers, replays it and reads the first
    /// `n` rows of its output.
    fn replay(&self, c: &mut Captured<G>, padded: &Padded, n: usize) -> Result<Vec<f32>> {
        let gpu = &*self.gpu;
        let stale = || Error::Internal("a graph's inputs are still shared".into());
        Arc::get_mut(&mut c.layout).ok_or_else(stale)?.refill(gpu, &padded.step.layout, c.table_stride)?;
        if c.groups.len() != padded.step.layout.groups.len() {
            return Err(Error::Internal("a graph replayed with another number of KV groups".into()));
        }
        for (d, g) in c.groups.iter_mut().zip(&padded.step.layout.groups) {
            Arc::get_mut(d).ok_or_else(stale)?.refill(gpu, g, c.table_stride)?;
        }
        let ids = to_i32(padded.step.ids.iter().map(|&i| i as usize))?;
        gpu.write(Arc::get_mut(&mut c.ids).ok_or_else(stale)?, i32_bytes(&ids))?;
        if let Some((params, _)) = c.draw.as_mut() {
            gpu.write(params, bytemuck::cast_slice(&padded.draws))?;
        }
        gpu.replay(&c.graph)?;
        let mut host = vec![0f32; n * c.out_cols];
        gpu.download(&c.out, bytemuck::cast_slice_mut(&mut host))?;
        if let Some((_, drawn)) = &c.draw {
            let mut picks = vec![0f32; n * 3];
            gpu.download(drawn, bytemuck::cast_slice_mut(&mut picks))?;
            host.extend(picks);
        }
        Ok(host)
    }
}
