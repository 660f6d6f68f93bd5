//! Scheduler decisions on small factories; no model, no threads.

use super::*;

fn sched(
    max_num_seqs: usize,
    max_batched_tokens: usize,
    blocks: usize,
    bs: usize,
    caching: bool,
) -> Scheduler {
    Scheduler::new(
        SchedulerConfig { max_num_seqs, max_batched_tokens },
        BlockPool::with_prefix_caching(blocks, bs, caching),
    )
}

fn prompt(len: usize, first: u32) -> Vec<u32> {
    (0..len as u32).map(|i| first + i).collect()
}

/// Runs a step as the engine would: every sampled sequence gets token 7.
fn step(s: &mut Scheduler) -> Schedule {
    let plan = s.schedule();
    let sampled: Vec<(SeqId, u32)> = plan.seqs.iter().filter(|x| x.sample).map(|x| (x.id, 7)).collect();
    s.complete(&plan, &sampled);
    plan
}

#[test]
fn the_token_budget_is_respected_and_long_prompts_are_chunked() {
    let mut s = sched(8, 10, 64, 4, false);
    s.add(SeqData::new(SeqId(1), prompt(25, 0)));
    s.add(SeqData::new(SeqId(2), prompt(3, 100)));
    let p = step(&mut s);
    assert_eq!(p.seqs, vec![Scheduled { id: SeqId(1), start: 0, end: 10, sample: false }]);
    let p = step(&mut s);
    assert_eq!(p.seqs, vec![Scheduled { id: SeqId(1), start: 10, end: 20, sample: false }]);
    let p = step(&mut s);
    // The rest of seq 1's prompt, then seq 2 admitted with what the budget leaves.
    assert_eq!(p.seqs[0], Scheduled { id: SeqId(1), start: 20, end: 25, sample: true });
    assert_eq!(p.seqs[1], Scheduled { id: SeqId(2), start: 0, end: 3, sample: true });
    for _ in 0..5 {
        let p = step(&mut s);
        assert!(p.num_tokens() <= 10);
        assert_eq!(p.seqs.len(), 2, "both decode every step");
    }
}

#[test]
fn admission_is_fifo_and_limited_by_max_num_seqs() {
    let mut s = sched(2, 100, 64, 4, false);
    for id in 1..=4 {
        s.add(SeqData::new(SeqId(id), prompt(5, id as u32 * 10)));
    }
    let p = step(&mut s);
    assert_eq!(p.seqs.iter().map(|x| x.id.0).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(s.num_waiting(), 2);
    s.remove(SeqId(1));
    let p = step(&mut s);
    assert_eq!(p.seqs.iter().map(|x| x.id.0).collect::<Vec<_>>(), vec![2, 3], "3 before 4");
}

#[test]
fn a_long_prompt_at_the_head_is_not_overtaken() {
    // The cache holds the long prompt only once the short running one finishes; later
    // short prompts must not slip ahead of it (no starvation).
    let mut s = sched(8, 100, 6, 4, false); // 24 positions
    s.add(SeqData::new(SeqId(1), prompt(8, 0)));
    step(&mut s);
    s.add(SeqData::new(SeqId(2), prompt(20, 100)));
    s.add(SeqData::new(SeqId(3), prompt(2, 200)));
    let p = step(&mut s);
    assert_eq!(
        p.seqs.iter().map(|x| x.id.0).collect::<Vec<_>>(),
        vec![1],
        "2 does not fit yet and 3 waits behind it"
    );
    s.remove(SeqId(1));
    let p = step(&mut s);
    assert_eq!(p.seqs[0].id.0, 2);
}

#[test]
fn running_out_of_blocks_preempts_the_newest_and_recomputes_it() {
    let mut s = sched(8, 100, 4, 4, false); // 16 positions
    s.add(SeqData::new(SeqId(1), prompt(7, 0)));
    s.add(SeqData::new(SeqId(2), prompt(7, 50)));
    step(&mut s); // both prefill: 2 blocks each, pool full
    assert_eq!(s.pool().num_free(), 0);
    let p = step(&mut s); // both at 8 tokens: decode still fits in block 2
    assert!(p.preempted.is_empty());
    let p = step(&mut s); // seq 1 needs a third block: seq 2 is preempted
    assert_eq!(p.preempted, vec![SeqId(2)]);
    assert_eq!(p.seqs.iter().map(|x| x.id.0).collect::<Vec<_>>(), vec![1]);
    let seq2 = s.seq(SeqId(2)).unwrap();
    assert_eq!(
        (seq2.computed, seq2.tokens.len(), seq2.blocks.len()),
        (0, 9, 0),
        "keeps its 2 generated tokens"
    );
    s.remove(SeqId(1));
    let p = step(&mut s);
    assert_eq!(
        p.seqs,
        vec![Scheduled { id: SeqId(2), start: 0, end: 9, sample: true }],
        "recomputed in one chunk"
    );
}

#[test]
fn batch_sequences_wait_behind_online_ones_and_are_preempted_first() {
    let mut s = sched(2, 100, 4, 4, false); // 16 positions, two sequences at once
    let batch = |id, first| SeqData::new(SeqId(id), prompt(7, first)).with_priority(Priority::Batch);
    s.add(batch(1, 0));
    s.add(batch(2, 20));
    s.add(SeqData::new(SeqId(3), prompt(3, 40)));
    let p = step(&mut s);
    assert_eq!(p.admitted, vec![SeqId(3), SeqId(1)], "the online sequence overtakes waiting batch ones");
    s.add(SeqData::new(SeqId(4), prompt(3, 60)));
    s.remove(SeqId(3));
    let p = step(&mut s);
    assert_eq!(p.admitted, vec![SeqId(4)], "online again before batch 2");
    // Pool: batch 1 holds 2 blocks, online 4 holds 1, one free. Online 4 grows past it:
    // the batch sequence is preempted although it is older.
    for _ in 0..7 {
        let p = step(&mut s);
        if !p.preempted.is_empty() {
            assert_eq!(p.preempted, vec![SeqId(1)]);
            assert_eq!(s.seq(SeqId(1)).unwrap().computed, 0);
            assert_eq!(s.waiting.front().map(|w| w.id), Some(SeqId(1)), "back at the head of the batch line");
            return;
        }
    }
    panic!("no preemption: the pool never ran out");
}

#[test]
fn a_sequence_bigger_than_the_cache_is_aborted_not_looped() {
    let mut s = sched(8, 100, 2, 4, false);
    s.add(SeqData::new(SeqId(1), prompt(8, 0)));
    step(&mut s);
    let p = step(&mut s);
    assert_eq!(p.aborted.len(), 1);
    assert!(!s.has_work());
    assert_eq!(s.pool().num_free(), 2);
}

#[test]
fn cached_prefixes_skip_their_prefill() {
    let mut s = sched(8, 100, 16, 4, true);
    let shared = prompt(12, 0);
    let mut a = shared.clone();
    a.extend([90, 91]);
    s.add(SeqData::new(SeqId(1), a));
    step(&mut s);
    s.remove(SeqId(1));
    let mut b = shared.clone();
    b.extend([80]);
    s.add(SeqData::new(SeqId(2), b));
    let p = step(&mut s);
    assert_eq!(
        p.seqs,
        vec![Scheduled { id: SeqId(2), start: 12, end: 13, sample: true }],
        "3 cached blocks reused"
    );
    // A prompt that is entirely cached still computes its last token.
    s.add(SeqData::new(SeqId(3), shared.clone()));
    let p = step(&mut s);
    let third = p.seqs.iter().find(|x| x.id == SeqId(3)).unwrap();
    assert_eq!((third.start, third.end), (8, 12));
}

/// Probed: a prompt another tenant sent answered in milliseconds against a second unseen.
/// Cached blocks are shared only among sequences of one salt.
#[test]
fn cached_prefixes_are_shared_only_within_a_salt() {
    let salted = |id: u64, salt: Option<u64>| {
        let mut seq = SeqData::new(SeqId(id), prompt(13, 0));
        seq.root = strata_common::prefix::salt_root(salt);
        seq
    };
    let mut s = sched(8, 100, 32, 4, true);
    s.add(salted(1, Some(1)));
    step(&mut s);
    s.remove(SeqId(1));
    s.add(salted(2, Some(2)));
    let p = step(&mut s);
    assert_eq!(p.seqs[0].start, 0, "another salt's blocks were read");
    s.remove(SeqId(2));
    s.add(salted(3, Some(1)));
    let p = step(&mut s);
    assert_eq!(p.seqs[0].start, 12, "the same salt reuses its 3 cached blocks");
}

#[test]
fn every_block_returns_after_finish_cancel_and_preemption() {
    let mut s = sched(4, 16, 8, 4, true);
    for id in 0..6 {
        s.add(SeqData::new(SeqId(id), prompt(5 + id as usize * 3, id as u32 * 7)));
    }
    for round in 0..30 {
        step(&mut s);
        if round % 4 == 3 {
            let id = s.running.first().map(|x| x.id);
            if let Some(id) = id {
                s.remove(id);
            }
        }
    }
    for id in 0..6 {
        s.remove(SeqId(id));
    }
    assert!(!s.has_work());
    assert_eq!(s.pool().num_free(), 8, "all blocks free or evictable");
}

/// A model mixing windowed and global layers: the windowed group's table holds only what
/// the window needs (blocks behind it go back, and are counted), the global group's every
/// block, both from the one pool; everything goes back at the end.
#[test]
fn a_windowed_kv_group_keeps_only_its_window() {
    let (bs, window) = (4, 6);
    let mut s = sched(2, 8, 32, bs, false).with_kv_groups(&[None, Some(window)]);
    assert_eq!(s.num_kv_groups(), 2);
    s.add(SeqData::new(SeqId(1), prompt(20, 0)));
    let mut most_held = 0;
    for _ in 0..12 {
        step(&mut s);
        let seq = s.seq(SeqId(1)).unwrap();
        assert_eq!(seq.blocks.len(), seq.computed.div_ceil(bs), "the global group keeps every block");
        let windowed = &seq.group_blocks[0];
        most_held = most_held.max(windowed.len() - windowed.released());
        // The next position reads back `window - 1` positions: whole blocks before go.
        assert_eq!(windowed.released(), (seq.computed + 1 - window) / bs);
    }
    let seq = s.seq(SeqId(1)).unwrap();
    assert_eq!(seq.computed, 20 + 9, "the prompt in chunks of 8, then a token a step");
    let held = 8 + (seq.group_blocks[0].len() - seq.group_blocks[0].released());
    assert!(most_held <= window.div_ceil(bs) + 3 + 8 / bs, "held {most_held}");
    assert!(s.stats.window_released_blocks >= 5, "{:?}", s.stats);
    assert_eq!(s.pool().num_free(), 32 - held, "29 positions: 8 global blocks and the window's");
    // Room for a sequence: every block less what a windowed group holds at most.
    assert_eq!(s.max_positions(), (32 - (2 + 3 + 2)) * bs);
    s.remove(SeqId(1));
    assert_eq!(s.pool().num_free(), 32);
}

/// A cached prefix is reused only as far as every KV group still holds what its next
/// position reads; groups never take each other's cached blocks.
#[test]
fn a_cached_prefix_is_reused_as_far_as_every_group_holds_it() {
    let bs = 4;
    let mut s = sched(4, 64, 16, bs, true).with_kv_groups(&[None, Some(6), Some(6)]);
    let shared = prompt(16, 0);
    let with = |tail: u32| {
        let mut p = shared.clone();
        p.push(tail);
        p
    };
    s.add(SeqData::new(SeqId(1), with(90)));
    step(&mut s);
    s.remove(SeqId(1));
    s.add(SeqData::new(SeqId(2), with(80)));
    let p = step(&mut s);
    assert_eq!((p.seqs[0].start, p.seqs[0].end), (16, 17), "all four blocks reused");
    let seq = s.seq(SeqId(2)).unwrap();
    let tables = std::iter::once(&seq.blocks).chain(&seq.group_blocks);
    let mut all: Vec<u32> = tables.flat_map(|t| t[t.released()..].to_vec()).collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "no block in two groups' tables");
    s.remove(SeqId(2));
    // Another prompt fills the pool: the least recently used blocks — the windowed
    // groups' tails among them — are evicted, and the prefix is computed again.
    s.add(SeqData::new(SeqId(3), prompt(15, 500)));
    step(&mut s);
    s.remove(SeqId(3));
    s.add(SeqData::new(SeqId(4), with(70)));
    let p = step(&mut s);
    let start = p.seqs[0].start;
    assert!(start < 16 && start.is_multiple_of(bs), "recomputed from {start}");
    let seq = s.seq(SeqId(4)).unwrap();
    assert_eq!(seq.blocks.len(), 17usize.div_ceil(bs));
}
