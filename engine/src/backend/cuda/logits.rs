//! The CUDA backend's reductions of a step's logits on the device: greedy picks, the top
//! candidates and tokens drawn from the nucleus, each a kernel whose few floats a row are
//! all that reaches the host (see [`crate::logits`]).

use strata_common::{Error, Result};

use super::device::{Arg, Gpu, Launch};
use super::kernels::Kernel;
use super::{dim, CudaBackend, GpuTensor, ROW_THREADS};
use crate::backend::host_logits::{host_draws, host_top};
use crate::backend::{LogitsOps, Tensors};
use crate::logits::draw::draws_to_f32s;
use crate::logits::late::RowMasks;
use crate::logits::top::top_from_f32s;
use crate::logits::{picks_from_f32s, Candidates, Draw, Pick, MAX_TOP};

impl<G: Gpu> CudaBackend<G> {
    /// Each row's greedy pick on the device: `[rows, 3]` (token, logit, log-sum-exp).
    pub(super) fn greedy_tensor(
        &self,
        logits: &GpuTensor<G::Buf>,
        first_id: u32,
    ) -> Result<GpuTensor<G::Buf>> {
        let out = self.output(logits.rows, 3)?;
        self.launch(
            Kernel::GreedyPick,
            Launch::rows(logits.rows, ROW_THREADS),
            &[
                Arg::Buf(&logits.buf),
                Arg::Buf(&out.buf),
                Arg::I32(dim(logits.cols)?),
                Arg::I32(dim(first_id as usize)?),
            ],
        )?;
        Ok(out)
    }

    /// Each row's `k` most likely tokens on the device: `[rows, 2k + 1]` (see
    /// [`crate::logits::top::top_to_f32s`]).
    pub(super) fn top_tensor(
        &self,
        logits: &GpuTensor<G::Buf>,
        k: usize,
        first_id: u32,
    ) -> Result<GpuTensor<G::Buf>> {
        if k == 0 || k > MAX_TOP {
            return Err(Error::Internal(format!("{k} candidates asked; 1..={MAX_TOP} are returned")));
        }
        let out = self.output(logits.rows, 2 * k + 1)?;
        self.launch(
            Kernel::TopLogits,
            Launch::rows(logits.rows, ROW_THREADS),
            &[
                Arg::Buf(&logits.buf),
                Arg::Buf(&out.buf),
                Arg::I32(dim(logits.cols)?),
                Arg::I32(dim(k)?),
                Arg::I32(dim(first_id as usize)?),
            ],
        )?;
        Ok(out)
    }

    /// Each row's token drawn on the device as its parameters in `params` say
    /// ([`crate::logits::DRAW_PARAMS`] floats per row, see [`crate::logits::draw`]): `[rows, 3]` picks.
    pub(super) fn draw_tensor(
        &self,
        logits: &GpuTensor<G::Buf>,
        params: &G::Buf,
        first_id: u32,
    ) -> Result<GpuTensor<G::Buf>> {
        let out = self.output(logits.rows, 3)?;
        self.launch(
            Kernel::DrawTokens,
            Launch::rows(logits.rows, ROW_THREADS),
            &[
                Arg::Buf(&logits.buf),
                Arg::Buf(params),
                Arg::Buf(&out.buf),
                Arg::I32(dim(logits.cols)?),
                Arg::I32(dim(first_id as usize)?),
            ],
        )?;
        Ok(out)
    }
}

impl<G: Gpu> LogitsOps for CudaBackend<G> {
    fn greedy_picks(&self, logits: &Self::Tensor, first_id: u32) -> Result<Vec<Pick>> {
        picks_from_f32s(&self.to_host(&self.greedy_tensor(logits, first_id)?)?)
    }
    fn top_logits(
        &self,
        logits: &Self::Tensor,
        rows: usize,
        k: usize,
        first_id: u32,
    ) -> Result<Vec<Candidates>> {
        if rows != logits.rows {
            return Err(Error::Internal(format!(
                "{rows} rows asked of [{}, {}] logits",
                logits.rows, logits.cols
            )));
        }
        if k == 0 || k > MAX_TOP {
            return Err(Error::Internal(format!("{k} candidates asked; 1..={MAX_TOP} are returned")));
        }
        if logits.rows == 0 || logits.cols == 0 {
            return Ok(host_top(&[], logits.rows, 0, k, first_id));
        }
        top_from_f32s(&self.to_host(&self.top_tensor(logits, k, first_id)?)?, k)
    }
    fn draws_on_device(&self) -> bool {
        true
    }
    fn masks_on_device(&self) -> bool {
        true
    }
    fn mask_logits(&self, logits: Self::Tensor, masks: &RowMasks) -> Result<Self::Tensor> {
        if masks.len() != logits.rows {
            return Err(Error::Internal(format!("{} masks for {} rows of logits", masks.len(), logits.rows)));
        }
        if masks.iter().all(Option::is_none) || logits.cols == 0 {
            return Ok(logits);
        }
        let words = logits.cols.div_ceil(32);
        let mut bits = vec![0u32; logits.rows * words];
        let mut flags = vec![0i32; logits.rows];
        for (r, mask) in masks.iter().enumerate() {
            if let Some(m) = mask {
                let n = m.len().min(words);
                bits[r * words..r * words + n].copy_from_slice(&m[..n]);
                flags[r] = 1;
            }
        }
        let bits = self.gpu.upload(bytemuck::cast_slice(&bits))?;
        let flags = self.gpu.upload(bytemuck::cast_slice(&flags))?;
        self.launch(
            Kernel::MaskLogits,
            Launch::rows(logits.rows, ROW_THREADS),
            &[
                Arg::Buf(&logits.buf),
                Arg::Buf(&bits),
                Arg::Buf(&flags),
                Arg::I32(dim(logits.cols)?),
                Arg::I32(dim(words)?),
            ],
        )?;
        Ok(logits)
    }
    fn draw_tokens(&self, logits: &Self::Tensor, draws: &[Draw], first_id: u32) -> Result<Vec<Pick>> {
        if draws.len() != logits.rows {
            return Err(Error::Internal(format!("{} draws for {} rows of logits", draws.len(), logits.rows)));
        }
        if logits.rows == 0 || logits.cols == 0 {
            return Ok(host_draws(&[], logits.cols, draws, first_id));
        }
        let params = self.gpu.upload(bytemuck::cast_slice(&draws_to_f32s(draws)))?;
        picks_from_f32s(&self.to_host(&self.draw_tensor(logits, &params, first_id)?)?)
    }
}
