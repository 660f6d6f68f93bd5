//! Proto messages <-> domain types, written once for both ends of each call.
//!
//! The coordinator and the worker process both speak inference.v1's `SamplingParams` and
//! `FinishReason` (worker.v1 reuses them) and both ends of worker.v1; the coordinator and
//! `strata admin` both speak admin.v1's `DataType` and `DeviceKind`; every conversion
//! lives here so the two ends cannot drift. An enum value this build does not know is an
//! error naming the field, never silently another value.

use strata_proto::admin::v1 as apb;
use strata_proto::inference::v1 as ipb;
use strata_proto::worker::v1 as wpb;

use crate::cluster::{Assignment, EngineLimits, ShardState};
use crate::constraint::Constraint;
use crate::device::{DType, DeviceKind};
use crate::error::{Error, Result};
use crate::events::{EngineStats, SeqEvent, TokenLogprobs};
use crate::ids::ReplicaId;
use crate::sampling::{FinishReason, SamplingParams};
use crate::shard::Parallelism;
use crate::worker_api::{Job, ModelFiles, ShardLoad, WorkerStatus};

/// The sampling knobs of `p` (the rest of it travels beside the message).
pub fn sampling_to_pb(p: &SamplingParams) -> ipb::SamplingParams {
    ipb::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: Some(p.top_p),
        min_p: p.min_p,
        repetition_penalty: Some(p.repetition_penalty),
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
    }
}

/// Sets the knobs of `p` from `s`; absent optional fields are their defaults.
pub fn apply_sampling(s: &ipb::SamplingParams, p: &mut SamplingParams) {
    p.temperature = s.temperature;
    p.top_k = s.top_k;
    p.top_p = s.top_p.unwrap_or(1.0);
    p.min_p = s.min_p;
    p.repetition_penalty = s.repetition_penalty.unwrap_or(1.0);
    p.presence_penalty = s.presence_penalty;
    p.frequency_penalty = s.frequency_penalty;
    p.seed = s.seed;
}

/// The wire form of a finish reason (a cancelled sequence reads as stopped).
pub fn finish_to_pb(f: FinishReason) -> ipb::FinishReason {
    match f {
        FinishReason::Length => ipb::FinishReason::Length,
        FinishReason::Stop | FinishReason::Cancelled => ipb::FinishReason::Stop,
        FinishReason::Eos => ipb::FinishReason::Eos,
    }
}

/// A finish reason off the wire: None while unfinished; unknown values are errors.
pub fn finish_from_pb(v: i32) -> Result<Option<FinishReason>> {
    match ipb::FinishReason::try_from(v) {
        Ok(ipb::FinishReason::Unspecified) => Ok(None),
        Ok(ipb::FinishReason::Length) => Ok(Some(FinishReason::Length)),
        Ok(ipb::FinishReason::Stop) => Ok(Some(FinishReason::Stop)),
        Ok(ipb::FinishReason::Eos) => Ok(Some(FinishReason::Eos)),
        Err(_) => Err(Error::invalid("finish_reason", format!("unknown value {v}"))),
    }
}

pub fn logprobs_to_pb(l: TokenLogprobs) -> ipb::TokenLogprob {
    ipb::TokenLogprob {
        token_id: l.token_id,
        logprob: l.logprob,
        top: l.top.into_iter().map(|(token_id, logprob)| ipb::TopLogprob { token_id, logprob }).collect(),
        rank: l.rank,
    }
}

/// The worker.v1 request for `job` on `replica` (stop strings stay with the coordinator).
pub fn job_to_pb(replica: &str, job: &Job) -> wpb::WorkerGenerateRequest {
    let p = &job.params;
    wpb::WorkerGenerateRequest {
        request_id: job.request_id.clone(),
        prompt_token_ids: job.prompt.clone(),
        sampling: Some(sampling_to_pb(p)),
        max_tokens: p.max_new_tokens,
        ignore_eos: p.ignore_eos,
        stop_token_ids: p.stop_token_ids.clone(),
        logprobs: p.logprobs,
        prompt_logprobs: p.prompt_logprobs,
        generated_token_ids: job.generated.clone(),
        replica_id: replica.to_string(),
        batch: p.priority == crate::sampling::Priority::Batch,
        constraint: p.constraint.as_ref().map(constraint_to_pb),
        embed: p.embed.map(|e| wpb::EmbedParams {
            pooling: e.pooling.map(|p| p.as_str().to_string()).unwrap_or_default(),
            normalize: e.normalize,
        }),
        cache_salt: p.cache_salt,
    }
}

pub fn constraint_to_pb(c: &Constraint) -> ipb::Constraint {
    use ipb::constraint::Kind;
    let kind = match c {
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::Regex(s) => Kind::Regex(s.clone()),
        Constraint::Choice(c) => Kind::Choice(ipb::Choices { choices: c.clone() }),
        Constraint::Grammar(s) => Kind::Grammar(s.clone()),
    };
    ipb::Constraint { kind: Some(kind) }
}

/// A constraint off the wire; one with no kind (or `json_object: false`) is an error
/// naming the field, never an unconstrained request.
pub fn constraint_from_pb(c: ipb::Constraint) -> Result<Constraint> {
    use ipb::constraint::Kind;
    Ok(match c.kind {
        Some(Kind::JsonObject(true)) => Constraint::JsonObject,
        Some(Kind::JsonSchema(s)) => Constraint::JsonSchema(s),
        Some(Kind::Regex(s)) => Constraint::Regex(s),
        Some(Kind::Choice(c)) => Constraint::Choice(c.choices),
        Some(Kind::Grammar(s)) => Constraint::Grammar(s),
        Some(Kind::JsonObject(false)) | None => {
            return Err(Error::invalid(
                "constraint",
                "names no kind (json_object, json_schema, regex, choice or grammar)",
            ))
        }
    })
}

/// `(replica, job)` of a worker.v1 request; a malformed constraint is an error.
pub fn job_from_pb(r: wpb::WorkerGenerateRequest) -> Result<(ReplicaId, Job)> {
    let mut params = SamplingParams {
        max_new_tokens: r.max_tokens,
        ignore_eos: r.ignore_eos,
        stop_token_ids: r.stop_token_ids,
        logprobs: r.logprobs,
        prompt_logprobs: r.prompt_logprobs,
        priority: if r.batch { crate::sampling::Priority::Batch } else { crate::sampling::Priority::Online },
        constraint: r.constraint.map(constraint_from_pb).transpose()?,
        embed: r.embed.map(embed_from_pb).transpose()?,
        cache_salt: r.cache_salt,
        ..SamplingParams::default()
    };
    apply_sampling(&r.sampling.unwrap_or_default(), &mut params);
    let job = Job {
        request_id: r.request_id,
        prompt: r.prompt_token_ids,
        generated: r.generated_token_ids,
        params,
    };
    Ok((r.replica_id.into(), job))
}

fn embed_from_pb(e: wpb::EmbedParams) -> Result<crate::sampling::Embed> {
    let pooling = match e.pooling.as_str() {
        "" => None,
        name => Some(crate::sampling::Pooling::parse(name)?),
    };
    Ok(crate::sampling::Embed { pooling, normalize: e.normalize })
}

/// An embedding request's answer as a worker.v1 message.
pub fn embedding_to_pb(v: Vec<f32>) -> wpb::WorkerGenerateResponse {
    wpb::WorkerGenerateResponse {
        tokens: Vec::new(),
        finish_reason: ipb::FinishReason::Stop as i32,
        prompt_logprobs: Vec::new(),
        embedding: v,
    }
}

/// One token event as a worker.v1 message (failures travel as the stream's status).
pub fn token_to_pb(
    token: u32,
    logprobs: Option<TokenLogprobs>,
    finish: Option<FinishReason>,
) -> wpb::WorkerGenerateResponse {
    let mut t = wpb::WorkerToken { token_id: token, ..Default::default() };
    if let Some(l) = logprobs {
        t = worker_token(l);
    }
    wpb::WorkerGenerateResponse {
        tokens: vec![t],
        finish_reason: finish.map(finish_to_pb).unwrap_or(ipb::FinishReason::Unspecified) as i32,
        prompt_logprobs: Vec::new(),
        embedding: Vec::new(),
    }
}

/// A prompt-logprobs event as a worker.v1 message of its own.
pub fn prompt_to_pb(prompt: Vec<TokenLogprobs>) -> wpb::WorkerGenerateResponse {
    wpb::WorkerGenerateResponse {
        tokens: Vec::new(),
        finish_reason: ipb::FinishReason::Unspecified as i32,
        prompt_logprobs: prompt.into_iter().map(worker_token).collect(),
        embedding: Vec::new(),
    }
}

fn worker_token(l: TokenLogprobs) -> wpb::WorkerToken {
    wpb::WorkerToken {
        token_id: l.token_id,
        logprob: Some(l.logprob),
        top_token_ids: l.top.iter().map(|x| x.0).collect(),
        top_logprobs: l.top.iter().map(|x| x.1).collect(),
        rank: l.rank,
    }
}

fn token_logprobs(t: &wpb::WorkerToken) -> Option<TokenLogprobs> {
    t.logprob.map(|logprob| TokenLogprobs {
        token_id: t.token_id,
        logprob,
        rank: t.rank,
        top: t.top_token_ids.iter().copied().zip(t.top_logprobs.iter().copied()).collect(),
    })
}

/// The events of one worker.v1 message: its prompt's logprobs if it carries them, then its
/// tokens, the last carrying the finish reason.
pub fn events_from_pb(m: wpb::WorkerGenerateResponse) -> Result<Vec<SeqEvent>> {
    let finish = finish_from_pb(m.finish_reason)?;
    if !m.embedding.is_empty() {
        if !m.tokens.is_empty() || !m.prompt_logprobs.is_empty() {
            return Err(Error::invalid("embedding", "an embedding comes alone"));
        }
        return Ok(vec![SeqEvent::Embedding(m.embedding)]);
    }
    let n = m.tokens.len();
    if n == 0 && finish.is_some() {
        return Err(Error::invalid("tokens", "a finished message carries no token"));
    }
    let mut events = Vec::with_capacity(n + 1);
    if !m.prompt_logprobs.is_empty() {
        let prompt = m.prompt_logprobs.iter().map(token_logprobs).collect::<Option<Vec<_>>>();
        let prompt = prompt.ok_or_else(|| Error::invalid("prompt_logprobs", "an entry has no logprob"))?;
        events.push(SeqEvent::Prompt(prompt));
    }
    events.extend(m.tokens.iter().enumerate().map(|(i, t)| SeqEvent::Token {
        token: t.token_id,
        logprobs: token_logprobs(t),
        finish: if i + 1 == n { finish } else { None },
    }));
    Ok(events)
}

pub fn stats_to_pb(s: EngineStats) -> wpb::StatsResponse {
    wpb::StatsResponse {
        running_sequences: s.running as u32,
        waiting_requests: s.waiting as u32,
        kv_blocks_free: s.kv_blocks_free as u64,
        kv_blocks_total: s.kv_blocks_total as u64,
        kv_block_size: s.block_size as u32,
        max_context: s.max_context as u64,
    }
}

pub fn stats_from_pb(r: &wpb::StatsResponse) -> EngineStats {
    EngineStats {
        running: r.running_sequences as usize,
        waiting: r.waiting_requests as usize,
        kv_blocks_free: r.kv_blocks_free as usize,
        kv_blocks_total: r.kv_blocks_total as usize,
        block_size: r.kv_block_size as usize,
        max_context: usize::try_from(r.max_context).unwrap_or(usize::MAX),
    }
}

pub fn load_to_pb(l: &ShardLoad) -> wpb::LoadShardRequest {
    wpb::LoadShardRequest {
        replica_id: l.replica.to_string(),
        model: l.model.to_string(),
        model_dir: l.model_dir.clone(),
        dtype: l.dtype.map(|d| d.name().to_ascii_lowercase()).unwrap_or_default(),
        quantize: l.quantize.clone(),
        tp: l.par.tp as u32,
        pp: l.par.pp as u32,
        ep: l.par.ep as u32,
        rank: l.rank as u32,
        rendezvous: l.rendezvous.clone().unwrap_or_default(),
        max_num_seqs: l.limits.max_num_seqs,
        max_batched_tokens: l.limits.max_batched_tokens,
        kv_cache_bytes: l.limits.kv_cache_bytes,
        group_secret: l.group_secret.clone(),
        max_model_len: l.limits.max_model_len,
    }
}

/// A load request off the wire; a dtype this build does not know is an error naming it.
pub fn load_from_pb(r: wpb::LoadShardRequest) -> Result<ShardLoad> {
    let dtype = if r.dtype.is_empty() { None } else { Some(DType::parse(&r.dtype)?) };
    if !matches!(r.quantize.as_str(), "" | "int8") {
        let shown: String = r.quantize.chars().take(32).collect();
        return Err(Error::invalid("quantize", format!("{shown:?}: give int8 or nothing")));
    }
    if !r.group_secret.is_empty() && !crate::worker_api::GROUP_SECRET_BYTES.contains(&r.group_secret.len()) {
        return Err(Error::invalid("group_secret", "must be 16 to 64 bytes"));
    }
    Ok(ShardLoad {
        replica: r.replica_id.into(),
        model: r.model.into(),
        model_dir: r.model_dir,
        dtype,
        quantize: r.quantize,
        par: Parallelism::with_ep(r.tp as usize, r.pp as usize, r.ep.max(1) as usize)?,
        rank: r.rank as usize,
        rendezvous: (!r.rendezvous.is_empty()).then_some(r.rendezvous),
        limits: EngineLimits {
            max_num_seqs: r.max_num_seqs,
            max_batched_tokens: r.max_batched_tokens,
            kv_cache_bytes: r.kv_cache_bytes,
            // The coordinators' queues hold waiting requests; workers need not know.
            max_waiting: 0,
            max_model_len: r.max_model_len,
        },
        group_secret: r.group_secret,
    })
}

pub fn status_to_pb(s: WorkerStatus) -> wpb::StatusResponse {
    let shard = s.assignment.map(|a| wpb::Shard {
        replica_id: a.replica.into(),
        model: a.model.into(),
        rank: a.rank,
        state: match a.state {
            ShardState::Loading => wpb::ShardState::Loading,
            ShardState::Ready => wpb::ShardState::Ready,
            ShardState::Failed => wpb::ShardState::Failed,
        } as i32,
        error: a.error,
        lost_rank: a.lost_rank,
    });
    wpb::StatusResponse {
        worker_id: s.worker_id.into(),
        shard,
        draining: s.draining,
        stats: Some(stats_to_pb(s.stats)),
        loads: s.loads,
        served: s.served,
    }
}

pub fn status_from_pb(r: wpb::StatusResponse) -> Result<WorkerStatus> {
    let assignment = match r.shard {
        None => None,
        Some(s) => Some(Assignment {
            replica: s.replica_id.into(),
            model: s.model.into(),
            rank: s.rank,
            state: match wpb::ShardState::try_from(s.state) {
                Ok(wpb::ShardState::Loading) => ShardState::Loading,
                Ok(wpb::ShardState::Ready) => ShardState::Ready,
                Ok(wpb::ShardState::Failed) => ShardState::Failed,
                Ok(wpb::ShardState::Unspecified) | Err(_) => {
                    return Err(Error::invalid("shard.state", format!("unknown value {}", s.state)))
                }
            },
            error: s.error,
            lost_rank: s.lost_rank,
        }),
    };
    Ok(WorkerStatus {
        worker_id: r.worker_id.into(),
        assignment,
        draining: r.draining,
        stats: r.stats.as_ref().map(stats_from_pb).unwrap_or_default(),
        loads: r.loads,
        served: r.served,
    })
}

pub fn files_to_pb(f: ModelFiles) -> wpb::ModelFilesResponse {
    wpb::ModelFilesResponse {
        config_json: f.config_json,
        generation_config_json: f.generation_config_json,
        tokenizer_json: f.tokenizer_json,
        tokenizer_config_json: f.tokenizer_config_json,
    }
}

pub fn files_from_pb(r: wpb::ModelFilesResponse) -> ModelFiles {
    ModelFiles {
        config_json: r.config_json,
        generation_config_json: r.generation_config_json,
        tokenizer_json: r.tokenizer_json,
        tokenizer_config_json: r.tokenizer_config_json,
    }
}

/// admin.v1's `DataType` (UNSPECIFIED: the checkpoint's own).
pub fn data_type_from_pb(v: i32) -> Result<Option<DType>> {
    match apb::DataType::try_from(v) {
        Ok(apb::DataType::Unspecified) => Ok(None),
        Ok(apb::DataType::Bf16) => Ok(Some(DType::BF16)),
        Ok(apb::DataType::F16) => Ok(Some(DType::F16)),
        Ok(apb::DataType::F32) => Ok(Some(DType::F32)),
        Err(_) => Err(Error::invalid("build.dtype", format!("{v} is no DataType this build knows"))),
    }
}

/// `d` as admin.v1's `DataType`; None (and int8, a checkpoint format rather than a dtype)
/// is UNSPECIFIED.
pub fn data_type_to_pb(d: Option<DType>) -> apb::DataType {
    match d {
        None | Some(DType::I8) => apb::DataType::Unspecified,
        Some(DType::BF16) => apb::DataType::Bf16,
        Some(DType::F16) => apb::DataType::F16,
        Some(DType::F32) => apb::DataType::F32,
    }
}

/// admin.v1's `DeviceKind` (UNSPECIFIED: any, or the default).
pub fn device_kind_from_pb(v: i32) -> Result<Option<DeviceKind>> {
    match apb::DeviceKind::try_from(v) {
        Ok(apb::DeviceKind::Unspecified) => Ok(None),
        Ok(apb::DeviceKind::Cpu) => Ok(Some(DeviceKind::Cpu)),
        Ok(apb::DeviceKind::Cuda) => Ok(Some(DeviceKind::Cuda)),
        Err(_) => Err(Error::invalid("build.device", format!("{v} is no DeviceKind this build knows"))),
    }
}

pub fn device_kind_to_pb(d: Option<DeviceKind>) -> apb::DeviceKind {
    match d {
        None => apb::DeviceKind::Unspecified,
        Some(DeviceKind::Cpu) => apb::DeviceKind::Cpu,
        Some(DeviceKind::Cuda) => apb::DeviceKind::Cuda,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_round_trip_through_worker_v1() {
        let job = Job {
            request_id: "r1".into(),
            prompt: vec![1, 2, 3],
            generated: vec![4],
            params: SamplingParams {
                temperature: 0.7,
                top_k: 5,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                presence_penalty: 0.5,
                frequency_penalty: -0.5,
                seed: Some(7),
                max_new_tokens: 9,
                ignore_eos: true,
                stop_token_ids: vec![11],
                stop: Vec::new(),
                logprobs: Some(3),
                prompt_logprobs: Some(2),
                priority: crate::sampling::Priority::Batch,
                constraint: Some(Constraint::Choice(vec!["a".into(), "b".into()])),
                embed: None,
                cache_salt: Some(0xfeed),
            },
        };
        let (replica, back) = job_from_pb(job_to_pb("m-0", &job)).unwrap();
        assert_eq!(replica, "m-0");
        assert_eq!(back.params, job.params);
        assert_eq!(
            (back.prompt, back.generated, back.request_id),
            (job.prompt, job.generated, job.request_id)
        );
    }

    #[test]
    fn every_constraint_kind_round_trips_and_an_empty_one_is_refused() {
        let kinds = [
            Constraint::JsonObject,
            Constraint::JsonSchema("{}".into()),
            Constraint::Regex("a+".into()),
            Constraint::Choice(vec!["x".into()]),
            Constraint::Grammar("start: \"a\"".into()),
        ];
        for c in kinds {
            assert_eq!(constraint_from_pb(constraint_to_pb(&c)).unwrap(), c);
        }
        let empty = constraint_from_pb(ipb::Constraint { kind: None }).unwrap_err();
        assert!(empty.to_string().contains("constraint"), "{empty}");
        let off = ipb::Constraint { kind: Some(ipb::constraint::Kind::JsonObject(false)) };
        assert!(constraint_from_pb(off).is_err());
    }

    #[test]
    fn unknown_finish_reasons_are_errors_not_stop() {
        assert_eq!(finish_from_pb(0).unwrap(), None);
        assert_eq!(finish_from_pb(3).unwrap(), Some(FinishReason::Eos));
        let e = finish_from_pb(42).unwrap_err();
        assert!(e.to_string().contains("finish_reason"), "{e}");
    }

    #[test]
    fn the_last_token_of_a_message_carries_the_finish_reason() {
        let mut m = token_to_pb(5, None, None);
        m.tokens.push(token_to_pb(6, None, None).tokens.remove(0));
        m.finish_reason = ipb::FinishReason::Length as i32;
        let evs = events_from_pb(m).unwrap();
        assert!(matches!(evs[0], SeqEvent::Token { token: 5, finish: None, .. }));
        assert!(matches!(evs[1], SeqEvent::Token { token: 6, finish: Some(FinishReason::Length), .. }));
    }

    #[test]
    fn embedding_requests_and_answers_cross_worker_v1() {
        use crate::sampling::{Embed, Pooling};
        for embed in [Embed::default(), Embed { pooling: Some(Pooling::Mean), normalize: Some(false) }] {
            let job = Job {
                request_id: "e".into(),
                prompt: vec![1, 2],
                generated: Vec::new(),
                params: SamplingParams { max_new_tokens: 1, embed: Some(embed), ..Default::default() },
            };
            assert_eq!(job_from_pb(job_to_pb("m-0", &job)).unwrap().1.params.embed, Some(embed));
        }
        let evs = events_from_pb(embedding_to_pb(vec![0.5, -1.0])).unwrap();
        assert!(matches!(&evs[..], [SeqEvent::Embedding(v)] if v == &[0.5, -1.0]) && evs[0].is_last());
        let mut both = embedding_to_pb(vec![1.0]);
        both.tokens.push(wpb::WorkerToken::default());
        assert!(events_from_pb(both).is_err());
        let mut bad = job_to_pb(
            "m",
            &Job {
                request_id: "x".into(),
                prompt: vec![1],
                generated: vec![],
                params: SamplingParams::default(),
            },
        );
        bad.embed = Some(wpb::EmbedParams { pooling: "max".into(), normalize: None });
        assert!(job_from_pb(bad).unwrap_err().to_string().contains("pooling"));
    }

    #[test]
    fn prompt_logprobs_travel_in_a_message_of_their_own() {
        let lp = TokenLogprobs { token_id: 9, logprob: -1.5, rank: 3, top: vec![(4, -0.5), (2, -1.0)] };
        let evs = events_from_pb(prompt_to_pb(vec![lp.clone()])).unwrap();
        assert!(matches!(&evs[..], [SeqEvent::Prompt(p)] if p == std::slice::from_ref(&lp)));
        let mut m = prompt_to_pb(vec![lp]);
        m.prompt_logprobs[0].logprob = None;
        assert!(events_from_pb(m).unwrap_err().to_string().contains("prompt_logprobs"));
    }

    #[test]
    fn expert_parallelism_crosses_worker_v1_and_bad_splits_are_named() {
        let load = |tp: u32, ep: u32| wpb::LoadShardRequest {
            replica_id: "r".into(),
            model: "m".into(),
            model_dir: "/m".into(),
            tp,
            pp: 2,
            ep,
            ..Default::default()
        };
        let l = load_from_pb(load(2, 2)).unwrap();
        assert_eq!(l.par, Parallelism { tp: 2, pp: 2, ep: 2 });
        // A deployment's quantization crosses too; one the engine does not know is refused.
        let q = load_from_pb(wpb::LoadShardRequest { quantize: "int8".into(), ..load(1, 1) }).unwrap();
        assert_eq!(q.quantize, "int8");
        let e = load_from_pb(wpb::LoadShardRequest { quantize: "int4".into(), ..load(1, 1) }).unwrap_err();
        assert!(e.to_string().contains("quantize"), "{e}");
        assert_eq!(load_to_pb(&l).ep, 2);
        // A leader of a version before `ep` sends 0: no expert parallelism.
        assert_eq!(load_from_pb(load(2, 0)).unwrap().par.ep, 1);
        assert!(load_from_pb(load(4, 2)).unwrap_err().to_string().contains("ep"));
    }

    #[test]
    fn status_with_an_unknown_shard_state_is_an_error() {
        let r = wpb::StatusResponse {
            worker_id: "w".into(),
            shard: Some(wpb::Shard { state: 9, ..Default::default() }),
            ..Default::default()
        };
        assert!(status_from_pb(r).unwrap_err().to_string().contains("shard.state"));
    }

    /// A fuzz pass over what a peer sends on worker.v1: valid messages mutated (bytes
    /// flipped, cut, inserted, duplicated) decode to an error or a message, and every
    /// decoded message converts to an error or a value: never a panic. (Seeded, so a
    /// failure reproduces.)
    #[test]
    fn mutated_peer_messages_decode_and_convert_without_panics() {
        use prost::Message;
        let job = Job {
            request_id: "r".into(),
            prompt: vec![1, 2, 3],
            generated: vec![4],
            params: SamplingParams {
                constraint: Some(Constraint::Regex("[a-z]+".into())),
                logprobs: Some(2),
                cache_salt: Some(9),
                ..Default::default()
            },
        };
        let load = wpb::LoadShardRequest {
            replica_id: "r".into(),
            model: "m".into(),
            model_dir: "/m".into(),
            tp: 2,
            pp: 2,
            ep: 1,
            quantize: "int8".into(),
            ..Default::default()
        };
        let status = wpb::StatusResponse {
            worker_id: "w".into(),
            shard: Some(wpb::Shard { state: 1, replica_id: "r".into(), ..Default::default() }),
            ..Default::default()
        };
        let lp = TokenLogprobs { token_id: 9, logprob: -1.5, rank: 3, top: vec![(4, -0.5)] };
        let seeds: [Vec<u8>; 5] = [
            job_to_pb("r", &job).encode_to_vec(),
            load.encode_to_vec(),
            status.encode_to_vec(),
            prompt_to_pb(vec![lp]).encode_to_vec(),
            stats_to_pb(EngineStats { running: 3, ..Default::default() }).encode_to_vec(),
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n.max(1) as u64) as usize
        };
        for i in 0..20_000 {
            let mut b = seeds[i % seeds.len()].clone();
            for _ in 0..1 + next(4) {
                match next(4) {
                    0 if !b.is_empty() => {
                        let at = next(b.len());
                        b[at] ^= 1 << next(8);
                    }
                    1 => b.truncate(next(b.len() + 1)),
                    2 => b.insert(next(b.len() + 1), next(256) as u8),
                    _ => {
                        let from = next(b.len() + 1);
                        let piece = b[from..].to_vec();
                        b.extend(piece);
                    }
                }
            }
            if let Ok(m) = wpb::WorkerGenerateRequest::decode(&b[..]) {
                let _ = job_from_pb(m);
            }
            if let Ok(m) = wpb::LoadShardRequest::decode(&b[..]) {
                let _ = load_from_pb(m);
            }
            if let Ok(m) = wpb::StatusResponse::decode(&b[..]) {
                let _ = status_from_pb(m);
            }
            if let Ok(m) = wpb::WorkerGenerateResponse::decode(&b[..]) {
                let _ = events_from_pb(m);
            }
            if let Ok(m) = wpb::StatsResponse::decode(&b[..]) {
                let _ = stats_from_pb(&m);
            }
        }
    }
}
