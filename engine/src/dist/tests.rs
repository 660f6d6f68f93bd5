//! The executors' state without processes: a one-rank replica, and a leader whose
//! follower is a thread of the test over loopback TCP, on a tiny random model.

use std::thread::JoinHandle;
use std::time::Duration;

use strata_common::{Architecture, ErrorClass};

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::comm::tcp::{local_group, TcpComm};
use crate::comm::HostStaged;
use crate::logits::{Draw, LogitsWanted, StepLogits};
use crate::model::random::RandomModelSpec;
use crate::step::{BatchLayout, SeqSlice};

fn tiny() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    RandomModelSpec::tiny(Architecture::Llama).write(dir.path(), |_, _| {}).unwrap();
    dir
}

/// A prefill of `ids` as one sequence in blocks 0.. of `block_size` 4, every row's logits.
fn prefill(ids: &[u32]) -> Step {
    let n = ids.len();
    let layout = BatchLayout {
        positions: (0..n as u32).collect(),
        slots: (0..n as u32).collect(),
        seqs: vec![SeqSlice {
            token_start: 0,
            num_tokens: n,
            context_before: 0,
            block_table: (0..n.div_ceil(4) as u32).collect(),
        }],
        block_size: 4,
        groups: Vec::new(),
    };
    Step::full_logits(ids.to_vec(), layout, (0..n).collect())
}

fn staged(mesh: TcpComm) -> Box<dyn DeviceCollectives<CpuBackend>> {
    Box::new(HostStaged::new(Box::new(mesh)))
}

/// A `par` replica of the model in `dir`: the leader here, every other rank's follower
/// loop on a thread of its own (its result returned when it ends). Ranks of one process
/// each get a thread pool of their own, as `replica::local_replica` gives them: a rank
/// blocked in a collective must not hold a worker its peer needs.
fn replica(
    dir: &std::path::Path,
    par: Parallelism,
) -> (LeaderExecutor<CpuBackend>, Vec<JoinHandle<Result<()>>>) {
    let mut meshes = local_group(par.world(), Duration::from_secs(20)).unwrap().into_iter();
    let leader = meshes.next().unwrap();
    let followers = meshes
        .enumerate()
        .map(|(i, mesh)| {
            let dir = dir.to_owned();
            std::thread::spawn(move || {
                let model = Model::load_shard(&dir, CpuBackend::new(), par, i + 1)?;
                follower_loop(model, staged(mesh), Some(rank_pool(i + 1, par.world())?))
            })
        })
        .collect();
    let model = Model::load_shard(dir, CpuBackend::new(), par, 0).unwrap();
    let pool = rank_pool(0, par.world()).unwrap();
    (LeaderExecutor::new(model, staged(leader), Some(pool)), followers)
}

#[test]
fn a_one_rank_step_is_the_many_rank_step_with_solo_collectives() {
    let dir = tiny();
    let mut solo = LeaderExecutor::solo(Model::load(dir.path(), CpuBackend::new()).unwrap());
    solo.alloc_kv(KvBlocks { num_blocks: 16, block_size: 4 }).unwrap();
    let step = prefill(&[1, 7, 300, 42, 5]);
    let want = solo.execute(&step).unwrap().logits.into_full().unwrap();
    assert_eq!(solo.comm_stats().map(|c| c.bytes_sent), None, "one rank: nothing to count");
    for par in [Parallelism::new(2, 1), Parallelism::new(1, 2), Parallelism::new(2, 2)] {
        let (mut leader, followers) = replica(dir.path(), par);
        leader.alloc_kv(KvBlocks { num_blocks: 16, block_size: 4 }).unwrap();
        let got = leader.execute(&step).unwrap().logits.into_full().unwrap();
        assert_eq!(got.len(), want.len());
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "{par:?}: logits differ by {worst}");
        // Greedy picks of the same step reach the leader from the last stage's rank 0.
        let greedy = Step { wanted: LogitsWanted::Greedy, ..step.clone() };
        let StepLogits::Greedy(picks) = leader.execute(&greedy).unwrap().logits else { panic!("picks") };
        assert_eq!(picks.len(), 5);
        assert!(leader.comm_stats().is_some_and(|c| c.bytes_sent > 0), "{par:?}");
        drop(leader); // tells the followers to stop
        for f in followers {
            f.join().unwrap().unwrap();
        }
    }
}

#[test]
fn steps_out_of_their_own_rows_or_asking_to_draw_are_refused() {
    let dir = tiny();
    let mut solo = LeaderExecutor::solo(Model::load(dir.path(), CpuBackend::new()).unwrap());
    solo.alloc_kv(KvBlocks { num_blocks: 16, block_size: 4 }).unwrap();
    let mut bad = prefill(&[1, 2, 3]);
    bad.logit_rows.push(3);
    assert!(solo.execute(&bad).unwrap_err().to_string().contains("logit row 3"));
    // The CPU reduces logits on the host: a step that draws on the device is a caller bug.
    assert!(!solo.draws_on_device());
    let drawing = Step { draws: vec![Draw::NONE; 3], ..prefill(&[1, 2, 3]) };
    assert_eq!(solo.execute(&drawing).unwrap_err().class(), ErrorClass::Internal);
    // Nothing was half-run: the next step is fine.
    assert!(solo.execute(&prefill(&[4, 5])).is_ok());
}

#[test]
fn a_follower_refuses_malformed_messages_and_a_leader_sees_a_lost_follower() {
    let dir = tiny();
    let par = Parallelism::new(2, 1);
    let mut meshes = local_group(2, Duration::from_secs(20)).unwrap().into_iter();
    let (mut leader, mesh) = (meshes.next().unwrap(), meshes.next().unwrap());
    let path = dir.path().to_owned();
    let follower = std::thread::spawn(move || {
        let model = Model::load_shard(&path, CpuBackend::new(), par, 1)?;
        follower_loop(model, staged(mesh), Some(rank_pool(1, 2)?))
    });
    use crate::comm::StepChannel;
    leader.send(1, &LeaderMessage::Init(KvBlocks { num_blocks: 4, block_size: 4 }).encode()).unwrap();
    // A step whose KV slot lies outside the cache the follower allocated.
    let mut step = prefill(&[1, 2]);
    step.layout.slots[1] = 4 * 4;
    leader.send(1, &encode_step(&step)).unwrap();
    let e = follower.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("KV slot"), "{e}");

    // A leader whose follower is gone fails the step, as a lost rank.
    let (mut exec, followers) = replica(dir.path(), par);
    exec.alloc_kv(KvBlocks { num_blocks: 16, block_size: 4 }).unwrap();
    drop(exec.rank.comm.host().send(1, &LeaderMessage::Shutdown.encode()));
    for f in followers {
        f.join().unwrap().unwrap();
    }
    let e = exec.execute(&prefill(&[1, 2])).unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
}

/// Latent attention's cache holds the latent and the rotated key once a position: the
/// KV budget buys blocks at `layers · (kv_lora_rank + qk_rope_head_dim)` values a
/// position, not the `2 · layers · heads · head_dim` of grouped attention.
#[test]
fn latent_attention_budgets_the_latent_per_position() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/deepseek_v3_mla");
    let config = strata_common::ModelConfig::from_dir(&dir).unwrap();
    let latent = config.latent.unwrap();
    let (bytes, block) = (1 << 20, 16);
    let per_position = config.num_layers * latent.cached_width() * 2;
    let want = bytes / (per_position * block);
    assert_eq!(kv_blocks(&config, Parallelism::NONE, bytes, block, 2).unwrap(), want);
    // Under TP every rank caches the whole latent (it is shared by the heads).
    let tp2 = Parallelism::new(2, 1);
    assert_eq!(kv_blocks(&config, tp2, bytes, block, 2).unwrap(), want);
    let expanded = config.num_layers
        * config.num_heads
        * (latent.qk_nope_head_dim + latent.qk_rope_head_dim + latent.v_head_dim)
        * 2;
    assert!(expanded > 4 * per_position, "{expanded} vs {per_position}");
}

/// A model mixing windowed and global layers (Gemma 3's fixture: windowed, global,
/// windowed): three KV groups of one layer, sharing one storage — every block the budget
/// buys is a block any group's table can take, three times as many as a storage a layer.
#[test]
fn kv_groups_of_a_mixed_model_share_their_storage() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/gemma3_window");
    let config = strata_common::ModelConfig::from_dir(&dir).unwrap();
    let groups = config.kv_groups();
    assert_eq!(groups.windows, [None, Some(8), Some(8)]);
    let (bytes, block, element) = (1 << 20, 16, 2);
    let layer_block = 2 * config.num_kv_heads * config.head_dim * element * block;
    assert_eq!(kv_blocks(&config, Parallelism::NONE, bytes, block, element).unwrap(), bytes / layer_block);
    // Split in two stages, each rank still holds one storage.
    let pp2 = Parallelism::new(1, 2);
    assert_eq!(kv_blocks(&config, pp2, bytes, block, element).unwrap(), bytes / layer_block);
}
