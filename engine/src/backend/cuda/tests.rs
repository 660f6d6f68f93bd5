//! The CUDA backend's host code and kernels on the CPU emulator (feature
//! `cuda-emulator`): every op against the CPU backend, and graph capture and replay.
//! Whole models, replicas and the emulated NCCL run in `engine/tests/cuda_emulator.rs`.

use std::sync::Arc;

use super::emulator::EmulatedGpu;
use super::CudaBackend;
use crate::backend::check::{check_ops, CheckSizes};

fn backend() -> CudaBackend<EmulatedGpu> {
    CudaBackend::new(Arc::new(EmulatedGpu::new()))
}

#[test]
fn every_op_matches_the_cpu_backend() {
    // Tiny shapes, then a long context (several attention chunks), MQA and a head wider
    // than the attention block (several output dimensions per thread).
    // Prefills of 37 and 20 tokens take several query tiles and key chunks of the tiled
    // kernel (16-position chunks; 8 for the wide head).
    let wide = CheckSizes {
        heads: 2,
        kv_heads: 1,
        head_dim: 160,
        context: 300,
        hidden: 40,
        rows: 20,
        ..CheckSizes::tiny()
    };
    let long = CheckSizes { rows: 37, context: 45, ..CheckSizes::tiny() };
    let mut report = check_ops(&backend(), &CheckSizes::tiny(), 7).unwrap();
    report.extend(check_ops(&backend(), &wide, 8).unwrap());
    report.extend(check_ops(&backend(), &long, 9).unwrap());
    for r in &report {
        eprintln!("{:<34} {:<50} rel err {:.2e} (tolerance {:.0e})", r.op, r.shape, r.rel_err, r.tolerance);
    }
    assert!(report.len() >= 12, "{} ops checked", report.len());
    let bad: Vec<_> = report.iter().filter(|r| !r.ok).collect();
    assert!(bad.is_empty(), "ops beyond tolerance: {bad:?}");
}

/// A step whose ops cannot be captured (here an upload, which a capture refuses) runs
/// eagerly, and its batch size is not captured again.
#[test]
fn a_step_that_cannot_be_captured_runs_eagerly_from_then_on() {
    use crate::backend::{AttentionOps, BatchLayout, GraphOutput, SeqSlice, StepGraphs, Tensors};
    use crate::logits::LogitsWanted;
    use crate::step::Step;
    let gpu = Arc::new(EmulatedGpu::new());
    let b = CudaBackend::with_graphs(gpu.clone(), true);
    b.alloc_kv(4, 2, 8).unwrap();
    let seq = SeqSlice { token_start: 0, num_tokens: 1, context_before: 3, block_table: vec![0, 1] };
    let layout = BatchLayout {
        positions: vec![3],
        slots: vec![3],
        seqs: vec![seq],
        block_size: 2,
        groups: Vec::new(),
    };
    let step = Step::full_logits(vec![1], layout, vec![0]);
    let output = GraphOutput { wanted: LogitsWanted::Full, draw: false, vocab: 4, first_id: 0 };
    let mut calls = 0;
    let mut body = |s: &Step| {
        calls += 1;
        let rows = s.logit_rows.len();
        b.upload(vec![0.5; rows * 4], rows, 4)
    };
    // Warm-up (the caller runs it), the failed capture, then no more attempts.
    for _ in 0..3 {
        assert!(b.replay_decode(&step, output, &mut body).unwrap().is_none());
    }
    assert_eq!(calls, 1, "the body runs once, in the failed capture");
    assert_eq!((gpu.captures(), gpu.replays()), (1, 0));
    // The device runs work as it is queued again.
    let x = b.upload(vec![1.0, 2.0], 1, 2).unwrap();
    assert_eq!(b.to_host(&x).unwrap(), vec![1.0, 2.0]);
}

/// A captured step returns the rows the body computes for the real sequences (three,
/// padded to four), replays with new inputs, and a graph that fails to run leaves its
/// batch size to eager steps.
#[test]
fn a_graph_replays_new_inputs_and_a_failing_one_leaves_its_batch_size_eager() {
    use crate::backend::{AttentionOps, BatchLayout, GraphOutput, SeqSlice, StepGraphs, TensorOps, Tensors};
    use crate::logits::LogitsWanted;
    use crate::step::Step;
    use crate::tensor::HostTensor;
    let gpu = Arc::new(EmulatedGpu::new());
    let b = CudaBackend::with_graphs(gpu.clone(), true);
    b.alloc_kv(8, 2, 4).unwrap();
    // The "model": an embedding lookup of 6 tokens × 3 columns (bf16-exact values).
    let values: Vec<f32> = (0..18).map(|i| i as f32 - 4.0).collect();
    let table = b.load_weight(&HostTensor::from_f32("embed", &[6, 3], &values)).unwrap();
    let step_of = |ids: &[u32]| {
        let seqs = (0..ids.len())
            .map(|i| SeqSlice {
                token_start: i,
                num_tokens: 1,
                context_before: 2,
                block_table: vec![i as u32],
            })
            .collect();
        BatchLayout {
            positions: vec![2; ids.len()],
            slots: (0..ids.len() as u32).collect(),
            seqs,
            block_size: 2,
            groups: Vec::new(),
        }
    };
    let run = |ids: &[u32]| {
        let step = Step::full_logits(ids.to_vec(), step_of(ids), (0..ids.len()).collect());
        let output = GraphOutput { wanted: LogitsWanted::Full, draw: false, vocab: 3, first_id: 0 };
        b.replay_decode(&step, output, &mut |s: &Step| b.embed(&table, &s.ids, 0)).unwrap()
    };
    let rows_of = |ids: &[u32]| {
        ids.iter().flat_map(|&t| values[t as usize * 3..t as usize * 3 + 3].to_vec()).collect::<Vec<_>>()
    };
    assert_eq!(run(&[1, 2, 3]), None, "the first step of a batch size runs eagerly");
    assert_eq!(run(&[4, 0, 5]), Some(rows_of(&[4, 0, 5])), "captured, then replayed");
    assert_eq!(run(&[5, 5, 1]), Some(rows_of(&[5, 5, 1])), "replayed with new ids");
    assert_eq!((gpu.captures(), gpu.replays()), (1, 2));
    gpu.fail_replays.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(run(&[2, 2, 2]), None, "a failing graph: this step runs eagerly");
    gpu.fail_replays.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(run(&[3, 1, 0]), None, "and every later one of this batch size");
    assert_eq!((gpu.captures(), gpu.replays()), (1, 2));
}
