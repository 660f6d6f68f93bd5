//! A layer's routed experts on the device (`moe.cu`): route, group by expert, one grouped
//! GEMM per projection, combine — no host round trip, so decode steps with experts are
//! captured in graphs like dense ones.
//!
//! The grouped GEMM reads each chosen expert's weights once per tile of up to
//! `MOE_TM` (16) of its rows: at decode, once a step however many tokens chose the expert.
//! It is a plain f32-FMA kernel, not a tensor-core one: prefill of a long prompt is
//! compute-bound there, where cuBLAS would be faster per expert but needs the counts on the
//! host.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use strata_common::{Error, Result};

use super::device::{Arg, Gpu, Launch};
use super::kernels::Kernel;
use super::{dim, CudaBackend, GpuTensor};
use crate::backend::routing::Routing;
use crate::backend::{Activation, ExpertLayer, ExpertProjection, TensorOps};

/// Rows of a tile (`MOE_TM` in moe.cu).
const TILE_ROWS: usize = 16;
/// Output columns of one grouped-GEMM block (`MOE_COLS`) and its threads (`MOE_THREADS`).
const GEMM_COLS: usize = 32;
const GEMM_THREADS: u32 = 256;
const ROUTE_THREADS: u32 = 256;
/// The most experts a token picks, and groups a grouped router has, that the routing
/// kernel holds (its arrays in registers).
const MAX_PICKS: usize = 64;
/// How often routed counts come back to the host for the metrics.
const COUNTS_EVERY: Duration = Duration::from_secs(1);

/// One projection of every expert: a table of the weights' device addresses (and of the
/// biases'), `[rows, cols]` each.
pub struct DeviceProjection<B> {
    weights: B,
    biases: Option<B>,
    rows: usize,
    cols: usize,
}

/// A layer's routed experts, ready for [`CudaBackend::run_device_experts`].
pub struct DeviceExperts<B> {
    router: B,
    router_bias: Option<B>,
    /// Grouped routing: `(n_group, topk_group, scale, correction bias)`.
    grouped: Option<(usize, usize, f32, B)>,
    norm: bool,
    experts: usize,
    hidden: usize,
    top_k: usize,
    act: Activation,
    gate: DeviceProjection<B>,
    up: DeviceProjection<B>,
    down: DeviceProjection<B>,
    /// Pairs routed to each expert so far (i64, on the device), and what the host last
    /// read of them and when.
    totals: B,
    read: Mutex<(Instant, Vec<u64>)>,
}

/// Why a layer keeps to the host's routing on this backend, if it must.
fn unsupported(layer: &ExpertLayer<'_, impl TensorOps + ?Sized>, experts: usize) -> Option<String> {
    let k = layer.top_k;
    if k == 0 || k > MAX_PICKS || k > experts {
        return Some(format!("top-{k} of {experts} experts"));
    }
    if let Routing::Grouped { groups, .. } = layer.routing {
        let g = groups.n_group;
        if g == 0 || g > MAX_PICKS || !experts.is_multiple_of(g) || groups.topk_group > g {
            return Some(format!("{experts} experts in {g} groups, {} kept", groups.topk_group));
        }
    }
    None
}

impl<G: Gpu> CudaBackend<G> {
    fn upload_f32(&self, v: &[f32]) -> Result<G::Buf> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
        self.gpu.upload(&bytes)
    }

    fn projection(&self, p: &ExpertProjection<'_, Self>, experts: usize) -> Result<DeviceProjection<G::Buf>> {
        let first = p.weights.first().ok_or_else(|| Error::Internal("a layer without experts".into()))?;
        let (rows, cols) = (first.rows, first.cols);
        if p.weights.len() != experts || p.weights.iter().any(|w| (w.rows, w.cols) != (rows, cols)) {
            return Err(Error::Internal(format!("{} expert weights of unequal shapes", p.weights.len())));
        }
        let bufs: Vec<&G::Buf> = p.weights.iter().map(|w| &w.buf).collect();
        let biases = match &p.biases {
            Some(b) if b.len() != experts || b.iter().any(|t| t.rows * t.cols != rows) => {
                return Err(Error::Internal(format!("{} expert biases for {experts} experts", b.len())));
            }
            Some(b) => Some(self.gpu.pointer_table(&b.iter().map(|t| &t.buf).collect::<Vec<_>>())?),
            None => None,
        };
        Ok(DeviceProjection { weights: self.gpu.pointer_table(&bufs)?, biases, rows, cols })
    }

    pub(super) fn prepare_device_experts(
        &self,
        layer: ExpertLayer<'_, Self>,
    ) -> Result<Option<DeviceExperts<G::Buf>>> {
        let experts = layer.gate.weights.len();
        let hidden = layer.router.len() / experts.max(1);
        if let Some(why) = unsupported(&layer, experts) {
            tracing::info!(%why, "experts route on the host");
            return Ok(None);
        }
        let (gate, up, down) = (
            self.projection(&layer.gate, experts)?,
            self.projection(&layer.up, experts)?,
            self.projection(&layer.down, experts)?,
        );
        if hidden * experts != layer.router.len()
            || gate.cols != hidden
            || (up.rows, up.cols) != (gate.rows, hidden)
            || (down.rows, down.cols) != (hidden, gate.rows)
        {
            return Err(Error::Internal(format!(
                "experts of [{}, {}] / [{}, {}] for a router of {} values",
                gate.rows,
                gate.cols,
                down.rows,
                down.cols,
                layer.router.len()
            )));
        }
        let (norm, grouped) = match layer.routing {
            Routing::Softmax { norm } => (*norm, None),
            Routing::Grouped { norm, groups, correction } => (
                *norm,
                Some((
                    groups.n_group,
                    groups.topk_group,
                    groups.routed_scaling_factor,
                    self.upload_f32(correction)?,
                )),
            ),
        };
        Ok(Some(DeviceExperts {
            router: self.upload_f32(layer.router)?,
            router_bias: layer.router_bias.map(|b| self.upload_f32(b)).transpose()?,
            grouped,
            norm,
            experts,
            hidden,
            top_k: layer.top_k,
            act: layer.act,
            gate,
            up,
            down,
            totals: self.gpu.alloc(experts * 8)?,
            read: Mutex::new((Instant::now(), vec![0; experts])),
        }))
    }

    pub(super) fn run_device_experts(
        &self,
        x: &GpuTensor<G::Buf>,
        d: &DeviceExperts<G::Buf>,
    ) -> Result<GpuTensor<G::Buf>> {
        let tokens = x.rows;
        if x.cols != d.hidden {
            return Err(Error::Internal(format!(
                "experts of width {} over [{tokens}, {}]",
                d.hidden, x.cols
            )));
        }
        if tokens == 0 {
            return self.output(0, d.hidden);
        }
        let (k, experts) = (d.top_k, d.experts);
        let pairs = tokens * k;
        let ids = self.gpu.alloc_output(pairs * 4)?;
        let weights = self.gpu.alloc_output(pairs * 4)?;
        self.route_tokens(x, d, &ids, &weights)?;
        // Every expert's run of rows is padded to whole tiles: at most one part-filled
        // tile per expert that any pair chose.
        let tiles = pairs.div_ceil(TILE_ROWS) + pairs.min(experts);
        let pos = self.gpu.alloc_output(pairs * 4)?;
        let src_row = self.gpu.alloc_output(tiles * TILE_ROWS * 4)?;
        let tile_expert = self.gpu.alloc_output(tiles * 4)?;
        let args = [
            Arg::Buf(&ids),
            Arg::I32(dim(pairs)?),
            Arg::I32(dim(k)?),
            Arg::I32(dim(experts)?),
            Arg::I32(dim(tiles)?),
            Arg::Buf(&pos),
            Arg::Buf(&src_row),
            Arg::Buf(&tile_expert),
            Arg::Buf(&d.totals),
        ];
        let shared =
            u32::try_from(2 * experts * 4).map_err(|_| Error::Internal("too many experts".into()))?;
        self.launch(
            Kernel::MoeAlign,
            Launch { grid: (1, 1, 1), block: ROUTE_THREADS, shared_bytes: shared },
            &args,
        )?;
        let rows = tiles * TILE_ROWS;
        let g = self.grouped_gemm(x, &src_row, true, &tile_expert, tiles, &d.gate)?;
        let u = self.grouped_gemm(x, &src_row, true, &tile_expert, tiles, &d.up)?;
        debug_assert_eq!(g.rows, rows);
        let h = self.gated(d.act, &g, &u)?;
        let y = self.grouped_gemm(&h, &src_row, false, &tile_expert, tiles, &d.down)?;
        let out = self.output(tokens, d.hidden)?;
        let args = [
            Arg::Buf(&y.buf),
            Arg::Buf(&pos),
            Arg::Buf(&weights),
            Arg::Buf(&out.buf),
            Arg::I32(dim(k)?),
            Arg::I32(dim(d.hidden)?),
        ];
        self.launch(Kernel::MoeCombine, Launch::rows(tokens, ROUTE_THREADS), &args)?;
        Ok(out)
    }

    /// Each token's experts (ascending ids) and weights, into `ids` and `weights`.
    fn route_tokens(
        &self,
        x: &GpuTensor<G::Buf>,
        d: &DeviceExperts<G::Buf>,
        ids: &G::Buf,
        w: &G::Buf,
    ) -> Result<()> {
        let (mode, n_group, topk_group, scale, correction) = match &d.grouped {
            Some((g, kept, scale, bias)) => (1, *g, *kept, *scale, bias),
            None => (0, 0, 0, 1.0, &d.router),
        };
        let shared = (3 * d.experts + ROUTE_THREADS as usize) * 4;
        let launch = Launch {
            grid: (dim(x.rows)? as u32, 1, 1),
            block: ROUTE_THREADS,
            shared_bytes: u32::try_from(shared).map_err(|_| Error::Internal("too many experts".into()))?,
        };
        let args = [
            Arg::Buf(&x.buf),
            Arg::Buf(&d.router),
            Arg::Buf(d.router_bias.as_ref().unwrap_or(&d.router)),
            Arg::I32(d.router_bias.is_some() as i32),
            Arg::Buf(correction),
            Arg::I32(mode),
            Arg::I32(d.norm as i32),
            Arg::I32(dim(n_group)?),
            Arg::I32(dim(topk_group)?),
            Arg::F32(scale),
            Arg::I32(dim(d.hidden)?),
            Arg::I32(dim(d.experts)?),
            Arg::I32(dim(d.top_k)?),
            Arg::Buf(ids),
            Arg::Buf(w),
        ];
        self.launch(Kernel::MoeRoute, launch, &args)
    }

    /// `p` over the tiles' rows of `x` (gathered by token, or row for row).
    fn grouped_gemm(
        &self,
        x: &GpuTensor<G::Buf>,
        src_row: &G::Buf,
        gathered: bool,
        tile_expert: &G::Buf,
        tiles: usize,
        p: &DeviceProjection<G::Buf>,
    ) -> Result<GpuTensor<G::Buf>> {
        if x.cols != p.cols {
            return Err(Error::Internal(format!(
                "experts of [{}, {}] over [{}, {}]",
                p.rows, p.cols, x.rows, x.cols
            )));
        }
        let y = self.output(tiles * TILE_ROWS, p.rows)?;
        let launch = Launch {
            grid: (dim(p.rows.div_ceil(GEMM_COLS))? as u32, dim(tiles)? as u32, 1),
            block: GEMM_THREADS,
            shared_bytes: 0,
        };
        let args = [
            Arg::Buf(&x.buf),
            Arg::Buf(src_row),
            Arg::I32(gathered as i32),
            Arg::Buf(&p.weights),
            Arg::Buf(p.biases.as_ref().unwrap_or(&p.weights)),
            Arg::I32(p.biases.is_some() as i32),
            Arg::Buf(tile_expert),
            Arg::Buf(&y.buf),
            Arg::I32(dim(p.cols)?),
            Arg::I32(dim(p.rows)?),
        ];
        self.launch(Kernel::MoeGemm, launch, &args)?;
        Ok(y)
    }

    pub(super) fn device_routed_counts(&self, d: &DeviceExperts<G::Buf>) -> Result<Option<Vec<u64>>> {
        let mut read = d.read.lock().unwrap_or_else(|p| p.into_inner());
        let capturing = self.pinned.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        if capturing || read.0.elapsed() < COUNTS_EVERY {
            return Ok(None);
        }
        let mut bytes = vec![0u8; d.experts * 8];
        self.gpu.download(&d.totals, &mut bytes)?;
        let totals: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| i64::from_ne_bytes(c.try_into().unwrap_or_default()) as u64)
            .collect();
        let delta = totals.iter().zip(&read.1).map(|(t, r)| t.saturating_sub(*r)).collect();
        *read = (Instant::now(), totals);
        Ok(Some(delta))
    }
}
