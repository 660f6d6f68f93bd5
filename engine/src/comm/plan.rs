//! What the leader rank tells the others over the [`StepChannel`](super::StepChannel):
//! the KV cache to allocate, each [`Step`], and when to stop. The step a follower decodes
//! is the value the leader encoded, and goes to its model as it is.
//!
//! Wire format: `[kind: u8][version: u8]` then little-endian u32 fields; vectors are a
//! u32 count followed by their elements. Every count is checked against the bytes that
//! remain before anything is allocated, and a decoded plan is checked against the KV
//! cache the follower allocated and the model's vocabulary before a kernel sees it — a
//! malformed message fails the follower's step with an error, never an out-of-bounds
//! access or an allocation the message did not pay for.

use strata_common::trace::{TraceContext, MAX_TRACESTATE};
use strata_common::{Error, Result};

use crate::logits::{Draw, LogitsWanted, DRAW_PARAMS};
use crate::step::{BatchLayout, KvBlocks, SeqSlice, Step};

/// Bumped whenever the layout below changes; ranks of one replica must agree.
pub const PLAN_VERSION: u8 = 5;

const KIND_STEP: u8 = 1;
const KIND_SHUTDOWN: u8 = 2;
const KIND_INIT: u8 = 3;

/// Largest block size a plan may name (the engine's are 16–256).
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

/// Longest `traceparent` a step carries (the W3C form is 55 bytes).
const MAX_TRACEPARENT: usize = 64;

/// A message from the leader rank.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant, reason = "one message a step, decoded and moved once")]
pub enum LeaderMessage {
    /// Allocate this many KV blocks of `block_size` positions (the first message).
    Init(KvBlocks),
    Step(Step),
    Shutdown,
}

/// What a follower checks a plan against.
#[derive(Debug, Clone, Copy)]
pub struct PlanBounds {
    pub kv: KvBlocks,
    /// KV groups of the model's layers: a step has a layout for each.
    pub kv_groups: usize,
    pub vocab_size: usize,
}

fn bad(what: impl Into<String>) -> Error {
    Error::Internal(format!("malformed message from the leader rank: {}", what.into()))
}

fn put(out: &mut Vec<u8>, v: usize) {
    out.extend_from_slice(&(v as u32).to_le_bytes());
}

fn put_all(out: &mut Vec<u8>, v: impl ExactSizeIterator<Item = usize>) {
    put(out, v.len());
    for x in v {
        put(out, x);
    }
}

impl LeaderMessage {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            LeaderMessage::Init(kv) => {
                let mut out = vec![KIND_INIT, PLAN_VERSION];
                put(&mut out, kv.num_blocks);
                put(&mut out, kv.block_size);
                out
            }
            LeaderMessage::Shutdown => vec![KIND_SHUTDOWN, PLAN_VERSION],
            LeaderMessage::Step(step) => encode_step(step),
        }
    }

    /// Decodes a message; a step is checked against `bounds` (None before `Init`, when
    /// only `Init` is acceptable).
    pub fn decode(msg: &[u8], bounds: Option<PlanBounds>) -> Result<LeaderMessage> {
        let (&kind, rest) = msg.split_first().ok_or_else(|| bad("empty"))?;
        let (&version, _) = rest.split_first().ok_or_else(|| bad("no version byte"))?;
        if version != PLAN_VERSION {
            return Err(bad(format!("plan version {version}; this rank speaks {PLAN_VERSION}")));
        }
        let mut r = Reader { b: msg, at: 2 };
        let m = match (kind, bounds) {
            (KIND_INIT, _) => {
                let (num_blocks, block_size) = (r.u32()? as usize, r.u32()? as usize);
                if block_size == 0 || block_size > MAX_BLOCK_SIZE {
                    return Err(bad(format!("block size {block_size}")));
                }
                LeaderMessage::Init(KvBlocks { num_blocks, block_size })
            }
            (KIND_SHUTDOWN, _) => LeaderMessage::Shutdown,
            (KIND_STEP, Some(bounds)) => {
                let plan = decode_step(&mut r)?;
                check(&plan, bounds)?;
                LeaderMessage::Step(plan)
            }
            (KIND_STEP, None) => return Err(bad("a step before the KV cache size")),
            (k, _) => return Err(bad(format!("unknown kind {k}"))),
        };
        if r.at != msg.len() {
            return Err(bad(format!("{} trailing bytes", msg.len() - r.at)));
        }
        Ok(m)
    }
}

/// A step message (the leader encodes every step without copying it).
pub fn encode_step(step: &Step) -> Vec<u8> {
    // Masks never leave the leader (its executor refuses them with other ranks).
    let Step { ids, layout, logit_rows, wanted, draws, trace, hidden_rows, masks: _ } = step;
    let (wanted, trace) = (*wanted, trace.as_ref());
    let mut out = vec![KIND_STEP, PLAN_VERSION];
    put_all(&mut out, ids.iter().map(|&x| x as usize));
    put_all(&mut out, layout.positions.iter().map(|&x| x as usize));
    put_all(&mut out, layout.slots.iter().map(|&x| x as usize));
    put(&mut out, layout.block_size);
    put(&mut out, layout.seqs.len());
    for s in &layout.seqs {
        put(&mut out, s.token_start);
        put(&mut out, s.num_tokens);
        put(&mut out, s.context_before);
        put_all(&mut out, s.block_table.iter().map(|&x| x as usize));
    }
    put_all(&mut out, logit_rows.iter().copied());
    put(
        &mut out,
        match wanted {
            LogitsWanted::Full => 0,
            LogitsWanted::Greedy => 1,
            LogitsWanted::Top(k) => 2 + k,
        },
    );
    let params = crate::logits::draw::draws_to_f32s(draws);
    put_all(&mut out, params.iter().map(|v| v.to_bits() as usize));
    let (parent, state) = trace.map_or(("", ""), |t| (t.traceparent.as_str(), t.tracestate.as_str()));
    for text in [parent, state] {
        put(&mut out, text.len());
        out.extend_from_slice(text.as_bytes());
    }
    // The other KV groups' slots and block tables (their positions and rows are the
    // step's).
    put(&mut out, layout.groups.len());
    for g in &layout.groups {
        put_all(&mut out, g.slots.iter().map(|&x| x as usize));
        for s in &g.seqs {
            put_all(&mut out, s.block_table.iter().map(|&x| x as usize));
        }
    }
    put_all(&mut out, hidden_rows.iter().copied());
    out
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.b.len() - self.at
    }

    fn u32(&mut self) -> Result<u32> {
        let bytes = self.b.get(self.at..self.at + 4).ok_or_else(|| bad("truncated"))?;
        self.at += 4;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
    }

    /// A count of items of at least `item_bytes` each, no more than the bytes left can hold.
    fn count(&mut self, item_bytes: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > self.remaining() / item_bytes {
            return Err(bad(format!("a count of {n} in {} remaining bytes", self.remaining())));
        }
        Ok(n)
    }

    /// A length-prefixed string of at most `max` bytes.
    fn text(&mut self, max: usize) -> Result<&str> {
        let n = self.u32()? as usize;
        if n > max || n > self.remaining() {
            return Err(bad(format!("a string of {n} bytes (at most {max})")));
        }
        let bytes = &self.b[self.at..self.at + n];
        self.at += n;
        std::str::from_utf8(bytes).map_err(|_| bad("a string that is not UTF-8"))
    }

    fn vec(&mut self) -> Result<Vec<u32>> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
}

fn decode_step(r: &mut Reader<'_>) -> Result<Step> {
    let ids = r.vec()?;
    let positions = r.vec()?;
    let slots = r.vec()?;
    let block_size = r.u32()? as usize;
    // A sequence is at least four u32s (three fields and its table's count).
    let n = r.count(16)?;
    let mut seqs = Vec::with_capacity(n);
    for _ in 0..n {
        seqs.push(SeqSlice {
            token_start: r.u32()? as usize,
            num_tokens: r.u32()? as usize,
            context_before: r.u32()? as usize,
            block_table: r.vec()?,
        });
    }
    let logit_rows = r.vec()?.into_iter().map(|x| x as usize).collect();
    let wanted = match r.u32()? {
        0 => LogitsWanted::Full,
        1 => LogitsWanted::Greedy,
        w if (3..=2 + crate::logits::MAX_TOP as u32).contains(&w) => LogitsWanted::Top(w as usize - 2),
        w => return Err(bad(format!("logits form {w}"))),
    };
    let params: Vec<f32> = r.vec()?.into_iter().map(f32::from_bits).collect();
    if !params.len().is_multiple_of(DRAW_PARAMS) {
        return Err(bad(format!("{} draw parameters", params.len())));
    }
    let draws = params
        .chunks_exact(DRAW_PARAMS)
        .map(|d| Draw { temperature: d[0], top_p: d[1], min_p: d[2], u: d[3] })
        .collect();
    let parent = r.text(MAX_TRACEPARENT)?.to_string();
    let state = r.text(MAX_TRACESTATE)?;
    // A context that is not W3C's form is dropped: tracing is never a reason to fail a step.
    let trace =
        (!parent.is_empty()).then(|| TraceContext::from_headers(Some(&parent), Some(state))).flatten();
    let mut layout = BatchLayout { positions, slots, seqs, block_size, groups: Vec::new() };
    // A group is at least its slots' count and a table count per sequence.
    let groups = r.count(4 * (1 + layout.seqs.len()))?;
    for _ in 0..groups {
        let slots = r.vec()?;
        let mut seqs = layout.seqs.clone();
        for s in &mut seqs {
            s.block_table = r.vec()?;
        }
        let (positions, block_size) = (layout.positions.clone(), layout.block_size);
        layout.groups.push(BatchLayout { positions, slots, seqs, block_size, groups: Vec::new() });
    }
    let hidden_rows = r.vec()?.into_iter().map(|x| x as usize).collect();
    Ok(Step { ids, layout, logit_rows, wanted, draws, trace, hidden_rows, masks: None })
}

/// Every slot and block of `l` inside a cache of `num_blocks` blocks, every table long
/// enough for its sequence.
fn in_cache(l: &BatchLayout, num_blocks: usize) -> Result<()> {
    let cache_slots = num_blocks * l.block_size;
    if let Some(s) = l.slots.iter().find(|&&s| s as usize >= cache_slots) {
        return Err(bad(format!("KV slot {s} outside a cache of {cache_slots}")));
    }
    for s in &l.seqs {
        let context = s.context_before + s.num_tokens;
        if s.block_table.len() * l.block_size < context {
            return Err(bad(format!("{} blocks for {context} positions", s.block_table.len())));
        }
        if let Some(blk) = s.block_table.iter().find(|&&x| x as usize >= num_blocks) {
            return Err(bad(format!("block {blk} outside a cache of {num_blocks}")));
        }
    }
    Ok(())
}

/// Every index in `p` stays inside the KV cache, the vocabulary and the step's own rows.
fn check(p: &Step, b: PlanBounds) -> Result<()> {
    p.check_shape().map_err(|e| bad(e.to_string()))?;
    let l = &p.layout;
    if l.block_size != b.kv.block_size {
        return Err(bad(format!("block size {} in a cache of {}", l.block_size, b.kv.block_size)));
    }
    if let Some(id) = p.ids.iter().find(|&&t| t as usize >= b.vocab_size) {
        return Err(bad(format!("token id {id} outside a vocabulary of {}", b.vocab_size)));
    }
    // A layout for every KV group of the model's layers, no more.
    if 1 + l.groups.len() != b.kv_groups {
        return Err(bad(format!("layouts for {} KV groups of {}", 1 + l.groups.len(), b.kv_groups)));
    }
    for l in std::iter::once(l).chain(&l.groups) {
        in_cache(l, b.kv.num_blocks)?;
    }
    let valid = |d: &Draw| {
        d.temperature.is_finite()
            && d.temperature >= 0.0
            && d.top_p > 0.0
            && d.top_p <= 1.0
            && (0.0..=1.0).contains(&d.min_p)
            && (0.0..1.0).contains(&d.u)
    };
    if let Some(d) = p.draws.iter().find(|d| !valid(d)) {
        return Err(bad(format!("draw parameters {d:?}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Step {
        Step {
            ids: vec![5, 6, 9],
            layout: BatchLayout {
                positions: vec![0, 1, 7],
                slots: vec![32, 33, 71],
                seqs: vec![
                    SeqSlice { token_start: 0, num_tokens: 2, context_before: 0, block_table: vec![2] },
                    SeqSlice { token_start: 2, num_tokens: 1, context_before: 7, block_table: vec![4] },
                ],
                block_size: 16,
                groups: Vec::new(),
            },
            logit_rows: vec![1, 2],
            wanted: LogitsWanted::Greedy,
            draws: Vec::new(),
            hidden_rows: vec![0, 2],
            masks: None,
            trace: Some(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: "k=v".into(),
            }),
        }
    }

    const KV: KvBlocks = KvBlocks { num_blocks: 8, block_size: 16 };
    const BOUNDS: PlanBounds = PlanBounds { kv: KV, kv_groups: 1, vocab_size: 100 };
    const GROUPED: PlanBounds = PlanBounds { kv: KV, kv_groups: 3, vocab_size: 100 };

    /// `plan()` with a second KV group's layout.
    fn grouped() -> Step {
        let mut p = plan();
        let mut g = p.layout.clone();
        g.slots = vec![0, 1, 87];
        g.seqs[0].block_table = vec![0];
        g.seqs[1].block_table = vec![5];
        let mut third = g.clone();
        third.slots = vec![48, 49, 103];
        third.seqs[0].block_table = vec![3];
        third.seqs[1].block_table = vec![6];
        p.layout.groups = vec![g, third];
        p
    }

    fn step(msg: &[u8]) -> Result<Step> {
        match LeaderMessage::decode(msg, Some(BOUNDS))? {
            LeaderMessage::Step(p) => Ok(p),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn plans_round_trip() {
        let p = plan();
        let back = step(&LeaderMessage::Step(p.clone()).encode()).unwrap();
        assert_eq!(
            (back.ids, back.logit_rows, back.wanted, back.hidden_rows),
            (p.ids, p.logit_rows, p.wanted, p.hidden_rows)
        );
        assert_eq!((back.layout.positions, back.layout.slots), (p.layout.positions, p.layout.slots));
        assert_eq!(back.layout.seqs[1].block_table, vec![4]);
        assert_eq!(back.trace, p.trace);
        let untraced = Step { trace: None, ..plan() };
        assert_eq!(step(&LeaderMessage::Step(untraced).encode()).unwrap().trace, None);
        for wanted in [LogitsWanted::Full, LogitsWanted::Top(1), LogitsWanted::Top(crate::logits::MAX_TOP)] {
            let p = Step { wanted, ..plan() };
            assert_eq!(step(&LeaderMessage::Step(p).encode()).unwrap().wanted, wanted);
        }
        let draws =
            vec![Draw { temperature: 0.7, top_p: 0.9, min_p: 0.05, u: 0.25 }, Draw { u: 0.5, ..Draw::NONE }];
        let drawn = Step { draws: draws.clone(), ..plan() };
        assert_eq!(step(&LeaderMessage::Step(drawn).encode()).unwrap().draws, draws);
        let too_many = Step { wanted: LogitsWanted::Top(crate::logits::MAX_TOP + 1), ..plan() };
        assert!(
            step(&LeaderMessage::Step(too_many).encode()).is_err(),
            "more candidates than a step returns"
        );
        let init = LeaderMessage::Init(KV).encode();
        assert!(matches!(LeaderMessage::decode(&init, None).unwrap(), LeaderMessage::Init(k) if k == KV));
    }

    #[test]
    fn every_kv_groups_layout_round_trips_and_is_checked_against_the_cache() {
        let p = grouped();
        let back = LeaderMessage::decode(&LeaderMessage::Step(p.clone()).encode(), Some(GROUPED)).unwrap();
        let LeaderMessage::Step(back) = back else { panic!("{back:?}") };
        assert_eq!(back.layout, p.layout);
        let refused = |p: Step, b: PlanBounds| {
            LeaderMessage::decode(&LeaderMessage::Step(p).encode(), Some(b)).unwrap_err().to_string()
        };
        assert!(refused(plan(), GROUPED).contains("layouts for 1 KV groups of 3"));
        assert!(refused(grouped(), BOUNDS).contains("layouts for 3 KV groups of 1"));
        let mut outside = grouped();
        outside.layout.groups[0].seqs[1].block_table = vec![8];
        assert!(refused(outside, GROUPED).contains("block 8 outside a cache of 8"));
        let mut slot = grouped();
        slot.layout.groups[0].slots[2] = 8 * 16;
        assert!(refused(slot, GROUPED).contains("KV slot 128"));
    }

    #[test]
    fn malformed_messages_are_errors_not_allocations() {
        let msg = LeaderMessage::Step(plan()).encode();
        assert!(step(&msg[..msg.len() - 3]).is_err(), "truncated");
        let mut trailing = msg.clone();
        trailing.push(0);
        assert!(step(&trailing).is_err(), "trailing bytes");
        let mut version = msg.clone();
        version[1] = PLAN_VERSION + 1;
        assert!(step(&version).unwrap_err().to_string().contains("version"));
        // A count far beyond the message: refused before allocating.
        let mut huge = vec![KIND_STEP, PLAN_VERSION];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(step(&huge).unwrap_err().to_string().contains("count"));
        assert!(LeaderMessage::decode(&msg, None).is_err(), "a step before Init");
        assert!(LeaderMessage::decode(&[KIND_INIT, PLAN_VERSION, 0, 0, 0, 0, 0, 0, 0, 0], None).is_err());
    }

    #[test]
    fn plans_outside_the_cache_or_vocabulary_are_refused() {
        type Edit = Box<dyn Fn(&mut Step)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("token id", Box::new(|p| p.ids[0] = 100)),
            ("KV slot", Box::new(|p| p.layout.slots[2] = 8 * 16)),
            ("block 8", Box::new(|p| p.layout.seqs[0].block_table[0] = 8)),
            ("rows", Box::new(|p| p.layout.seqs[1].num_tokens = 5)),
            ("logit row", Box::new(|p| p.logit_rows.push(3))),
            ("positions", Box::new(|p| p.layout.positions.pop().map(|_| ()).unwrap_or(()))),
            ("blocks for", Box::new(|p| p.layout.seqs[1].context_before = 40)),
            ("block size", Box::new(|p| p.layout.block_size = 32)),
            ("draws for", Box::new(|p| p.draws = vec![Draw::NONE])),
            (
                "draw parameters",
                Box::new(|p| p.draws = vec![Draw::NONE, Draw { top_p: f32::NAN, ..Draw::NONE }]),
            ),
            ("draw parameters", Box::new(|p| p.draws = vec![Draw::NONE, Draw { u: 1.0, ..Draw::NONE }])),
        ];
        for (what, edit) in cases {
            let mut p = plan();
            edit(&mut p);
            let e = step(&LeaderMessage::Step(p).encode()).unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
    }

    #[test]
    fn mutated_messages_never_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let drawn = vec![Draw { temperature: 0.7, top_p: 0.9, min_p: 0.05, u: 0.25 }; 2];
        let good = LeaderMessage::Step(Step { draws: drawn, ..plan() }).encode();
        for _ in 0..5000 {
            let mut m = good.clone();
            match rng.random_range(0..3) {
                0 => m.truncate(rng.random_range(0..m.len())),
                1 => m.extend((0..rng.random_range(1..16)).map(|_| rng.random::<u8>())),
                _ => {}
            }
            for _ in 0..rng.random_range(1..6) {
                if !m.is_empty() {
                    let i = rng.random_range(0..m.len());
                    m[i] = rng.random();
                }
            }
            // An error or a message that passed every check, never a panic.
            let _ = LeaderMessage::decode(&m, Some(BOUNDS));
        }
    }
}
