//! One request's generation on the coordinator side: submit token ids to a replica,
//! turn the tokens that come back into text deltas, apply stop strings.
//!
//! Unary and streaming calls share this path: both read [`Chunk`]s from the channel
//! [`start`] returns. When the receiver is dropped (the caller cancelled or
//! disconnected), the task ends and its `SequenceStream` is dropped, which cancels the
//! sequence on the replica and frees its KV blocks.

use std::sync::Arc;

use strata_common::{Error, FinishReason, Result};
use strata_proto::inference::v1 as pb;
use strata_worker::{SeqEvent, TokenLogprobs};
use tokio::sync::mpsc;

use crate::models::ServedModel;
use crate::request::Admitted;
use crate::text::TextStream;

/// What one generated token adds to a response.
#[derive(Debug, Default)]
pub struct Chunk {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<pb::TokenLogprob>,
    pub finish: Option<FinishReason>,
}

/// Chunks of one generation, in order; the last has `finish` set (or is an error).
pub type ChunkRx = mpsc::Receiver<Result<Chunk>>;

/// Submits the request to the least-loaded replica and streams its chunks.
pub fn start(model: Arc<ServedModel>, admitted: Admitted) -> Result<ChunkRx> {
    let stop = admitted.params.stop.clone();
    let mut seq = model.route().submit(admitted.prompt_ids, admitted.params)?;
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut text = TextStream::new(&model.tokenizer, stop);
        loop {
            let chunk = match seq.next().await {
                Some(SeqEvent::Token { token, logprobs, finish }) => {
                    token_chunk(&mut text, token, logprobs, finish)
                }
                Some(SeqEvent::Failed(e)) => Err(e),
                None => Err(Error::Unavailable("the replica stopped before the sequence finished".into())),
            };
            let last = !matches!(chunk, Ok(Chunk { finish: None, .. }));
            if tx.send(chunk).await.is_err() || last {
                return; // dropping `seq` cancels the sequence if it is still running
            }
        }
    });
    Ok(rx)
}

fn token_chunk(
    text: &mut TextStream<'_>,
    token: u32,
    logprobs: Option<TokenLogprobs>,
    finish: Option<FinishReason>,
) -> Result<Chunk> {
    let delta = text.push(token)?;
    let mut chunk = Chunk {
        text: delta.text,
        token_ids: vec![token],
        logprobs: logprobs.map(to_pb).into_iter().collect(),
        finish: if delta.stopped { Some(FinishReason::Stop) } else { finish },
    };
    if chunk.finish.is_some() {
        chunk.text.push_str(&text.finish()?.text);
    }
    Ok(chunk)
}

pub fn to_pb(l: TokenLogprobs) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: l.token_id,
        logprob: l.logprob,
        top: l.top.into_iter().map(|(token_id, logprob)| pb::TopLogprob { token_id, logprob }).collect(),
    }
}

pub fn finish_to_pb(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Stop | FinishReason::Cancelled => pb::FinishReason::Stop,
        FinishReason::Eos => pb::FinishReason::Eos,
    }
}
