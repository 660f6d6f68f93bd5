//! The OpenAI-style HTTP API (`--http-listen`), beside inference.v1 on every coordinator.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
//! ([`responses`]), Anthropic's `POST /v1/messages` ([`anthropic`]), `GET
//! /v1/models[/{id}]`,
//! the batch API (`/v1/files`, `/v1/batches`, see [`batch`](crate::batch)), vLLM's
//! `POST /tokenize`, `POST /detokenize` and `GET /version` ([`utility`]), and `GET
//! /health` (the process answers) and `GET /ready` (it would serve a request now) for load
//! balancers. Any other path is a 404 and another method a 405, both in OpenAI's error
//! shape naming the method and path. Requests take the same path as gRPC calls — admission, routing, failover,
//! metrics, traces — and the same API keys (`Authorization: Bearer`), needed on every
//! route but the two probes and `/version` when keys are configured.

mod anthropic;
pub mod arrival;
pub mod completions;
mod embeddings;
pub mod error;
#[cfg(test)]
mod fuzz;
pub mod metrics;
pub mod params;
mod prompt_logprobs;
pub mod respond;
mod responses;
mod serve;
mod structured;
mod tool_calls;
mod utility;

pub use serve::{serve, HEADER_READ_TIMEOUT};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde_json::json;

use self::error::ApiError;
use super::auth::{bearer_token, ClientAuth};
use crate::frontend::FrontEnd;
use crate::routing::Catalog;
use crate::tenant::Caller;
use strata_common::conn_limits::LimitedListener;

/// Largest JSON request body (prompts are bounded again by the context on admission).
pub const MAX_JSON_BODY: usize = 16 << 20;

/// Where and how the HTTP API serves.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    pub listen: SocketAddr,
    /// Batch jobs' directory (None: no batch API).
    pub data_dir: Option<std::path::PathBuf>,
    pub batch_concurrency: usize,
}

/// What every handler shares.
pub struct HttpState {
    pub front: Arc<FrontEnd>,
    pub auth: ClientAuth,
    /// Set when the server drains: `/ready` answers 503 so balancers stop sending.
    pub draining: AtomicBool,
    next: AtomicU64,
    /// A per-process prefix so response ids differ across restarts.
    prefix: String,
    /// The batch API, when the coordinator has a data directory.
    pub batches: Option<Arc<crate::batch::Batches>>,
    /// Stored Responses conversations (`previous_response_id`).
    responses: Arc<responses::ResponseStore>,
    /// Request bodies on their way in, per tenant ([`arrival`]).
    arrivals: arrival::Arrivals,
}

impl HttpState {
    pub fn new(front: Arc<FrontEnd>, auth: ClientAuth) -> Self {
        HttpState {
            front,
            auth,
            draining: AtomicBool::new(false),
            next: AtomicU64::new(1),
            prefix: format!("{:08x}", rand::random::<u32>()),
            batches: None,
            responses: Arc::default(),
            arrivals: arrival::Arrivals::default(),
        }
    }

    /// A fresh id for a response.
    pub fn next_id(&self) -> String {
        format!("{}{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

/// The API's router over `state`.
pub fn router(state: Arc<HttpState>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(create_response))
        .route("/v1/embeddings", post(create_embeddings))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/tokenize", post(utility::tokenize))
        .route("/detokenize", post(utility::detokenize))
        .route("/tokenizer_info", get(utility::tokenizer_info))
        .layer(DefaultBodyLimit::max(MAX_JSON_BODY));
    let api = match &state.batches {
        Some(b) => api.merge(crate::batch::http::router(b.clone())),
        None => api,
    };
    let api = api.layer(axum::middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/version", get(utility::version))
        .merge(api)
        .fallback(utility::no_route)
        .method_not_allowed_fallback(utility::wrong_method)
        .layer(axum::middleware::from_fn(metrics::track))
        .with_state(state)
}

/// Authenticates the caller and hands its [`Caller`] to the handlers (an extension).
async fn authenticate(State(state): State<Arc<HttpState>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    // Anthropic's clients send the key as `x-api-key`.
    let token = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    let caller = match state.auth.check_token(token, "header") {
        Ok(caller) => caller,
        Err(e) => return ApiError::from(e).into_response(),
    };
    // The body arrives at a minimum rate, a bounded number per tenant at once.
    let (parts, body) = request.into_parts();
    let body = match state.arrivals.admit(caller.tenant(), body) {
        Ok(body) => body,
        Err(e) => {
            let mut refused = e.into_response();
            // Its body is never read: the connection cannot carry another request.
            refused.headers_mut().insert(axum::http::header::CONNECTION, "close".parse().unwrap());
            return refused;
        }
    };
    let mut request = Request::from_parts(parts, body);
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// The caller's W3C trace context, if it sent one.
fn caller(headers: &HeaderMap) -> Option<strata_common::trace::TraceContext> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    strata_common::trace::TraceContext::from_headers(get("traceparent"), get("tracestate"))
}

/// `build` over a parsed body on the blocking pool, under the front end's budget of text
/// worked on at once ([`crate::frontend::texts`]): a body may be megabytes of JSON, ~50×
/// that once parsed and handed to a template, and tokenizing costs more still.
async fn build_job<T: Send + 'static>(
    state: &HttpState,
    who: &Caller,
    body: Bytes,
    build: impl FnOnce(&dyn Catalog, params::Fields) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let permit = state.front.texts().acquire(who.tenant(), body.len()).await;
    let models = state.front.models().clone();
    let built = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        params::object(&body).and_then(|f| build(&*models, f))
    })
    .await;
    built.map_err(|e| ApiError::from(strata_common::Error::Internal(format!("building the request: {e}"))))?
}

async fn completions(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match build_job(&state, &who, body, |models, f| completions::completion(models, &f)).await {
        Ok(job) => respond::run(state.clone(), job, who, caller(&headers)).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match build_job(&state, &who, body, completions::chat).await {
        Ok(job) => respond::run(state.clone(), job, who, caller(&headers)).await,
        Err(e) => e.into_response(),
    }
}

/// OpenAI's embeddings API ([`embeddings`]).
async fn create_embeddings(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    body: Bytes,
) -> Response {
    embeddings::route(state, who, body).await
}

/// Anthropic's Messages API, run as a chat request ([`anthropic`]).
async fn messages(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let build = |models: &dyn Catalog, f| anthropic::to_chat(f).and_then(|f| completions::chat(models, f));
    let job = match build_job(&state, &who, body, build).await {
        Ok(job) => job,
        Err(e) => return anthropic::error(e),
    };
    if job.common.stream {
        let model = job.common.model.clone();
        match respond::start_stream(&state, job, &who, caller(&headers)).await {
            Ok((chunks, id)) => anthropic::stream(chunks, id, model).into_response(),
            Err(e) => anthropic::error(e),
        }
    } else {
        match respond::answer(&state.front, &job, state.next_id(), &who, caller(&headers).as_ref()).await {
            Ok(chat) => axum::Json(anthropic::from_chat(&chat)).into_response(),
            Err(e) => anthropic::error(e),
        }
    }
}

/// OpenAI's Responses API, run as a chat request ([`responses`]).
async fn create_response(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (store, tenant) = (state.responses.clone(), who.owner());
    let build = move |models: &dyn Catalog, f| {
        let mut t = responses::to_chat(f, &store, &tenant)?;
        let job = completions::chat(models, std::mem::take(&mut t.chat))?;
        Ok((job, t))
    };
    let (job, t) = match build_job(&state, &who, body, build).await {
        Ok(built) => built,
        Err(e) => return e.into_response(),
    };
    let tenant = who.owner();
    if job.common.stream {
        match respond::start_stream(&state, job, &who, caller(&headers)).await {
            Ok((chunks, id)) => {
                responses::stream(chunks, id, t, state.responses.clone(), tenant).into_response()
            }
            Err(e) => e.into_response(),
        }
    } else {
        match respond::answer(&state.front, &job, state.next_id(), &who, caller(&headers).as_ref()).await {
            Ok(chat) => axum::Json(responses::from_chat(&chat, t, &state.responses, &tenant)).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

fn model_json(m: &crate::routing::ModelEntry) -> serde_json::Value {
    json!({
        "id": m.name,
        "object": "model",
        "created": 0,
        "owned_by": "strata",
        "max_model_len": m.max_context(),
        "ready_replicas": m.routes.ready(),
    })
}

/// The models the caller may use (a tenant limited to some models sees only those).
async fn list_models(State(state): State<Arc<HttpState>>, Extension(who): Extension<Caller>) -> Response {
    let data: Vec<_> = state
        .front
        .models()
        .all()
        .iter()
        .filter(|m| who.may_use(&m.name).is_ok())
        .map(|m| model_json(m))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// A model the caller may use; another is not found, as if it were not served.
async fn get_model(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    match state.front.models().get(&id) {
        Ok(m) if who.may_use(&m.name).is_ok() => axum::Json(model_json(&m)).into_response(),
        Ok(m) => ApiError::not_found(format!("model {:?}", m.name)).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// 200 when a request would be served now: not draining, and some model has a ready
/// replica.
/// `GET /ready`: 200 while a request would be served now (some model has a ready replica);
/// `GET /ready?model=NAME`: the same for one model, with 503 naming where its replicas
/// stand (pending and why, loading) when none is ready. Open, as load balancers probe it.
async fn ready(
    State(state): State<Arc<HttpState>>,
    axum::extract::Query(query): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Response {
    if let Some(k) = query.keys().find(|k| k.as_str() != "model") {
        return ApiError::invalid(k.clone(), format!("/ready takes no parameter {k:?}")).into_response();
    }
    if state.draining.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response();
    }
    let Some(name) = query.get("model") else {
        return if state.front.models().all().iter().any(|m| m.routes.ready() > 0) {
            (StatusCode::OK, "ready").into_response()
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, "no model has a ready replica").into_response()
        };
    };
    let model = match state.front.models().get(name) {
        Ok(m) => m,
        Err(_) => return ApiError::not_found(format!("model {name:?}")).into_response(),
    };
    let ready = model.routes.ready();
    let mut body = json!({"model": model.name, "ready_replicas": ready, "status": "ready"});
    if ready > 0 {
        return (StatusCode::OK, axum::Json(body)).into_response();
    }
    body["status"] = json!("unavailable");
    if let Some(u) = model.routes.unready() {
        body["state"] = json!(u.state.map_or("none", |s| s.as_str()));
        body["reason"] = json!(u.describe(strata_common::cluster::now_ms()));
    }
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
}

/// The HTTP API while it serves, until [`drain`](RunningHttp::drain).
pub struct RunningHttp {
    state: Arc<HttpState>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl RunningHttp {
    /// Binds, opens the batch store (resuming its unfinished jobs), announces the address
    /// (`{"event":"http",…}`) and serves in the background.
    pub async fn start(
        opts: &HttpOptions,
        bound: Option<std::net::TcpListener>,
        front: Arc<FrontEnd>,
        auth: ClientAuth,
        (role, id): (&str, &str),
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let tenants = auth.tenants().clone();
        let mut state = HttpState::new(front.clone(), auth);
        if let Some(dir) = &opts.data_dir {
            let batches = crate::batch::Batches::start(dir, front, opts.batch_concurrency, tenants)
                .with_context(|| format!("--data-dir {}", dir.display()))?;
            state.batches = Some(batches);
        }
        let server = match bound {
            Some(l) => HttpServer::from_std(l, Arc::new(state))?,
            None => HttpServer::bind(opts.listen, Arc::new(state)).await?,
        };
        let (address, state) = (server.address, server.state.clone());
        tracing::info!("OpenAI-style HTTP API on http://{address}/v1");
        let announcement =
            strata_common::ready::Announcement { event: "http", role, address: &address.to_string(), id };
        strata_common::ready::announce(&announcement);
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(server.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        Ok(RunningHttp { state, task, stop })
    }

    /// Stops taking requests (`/ready` answers 503) and waits for those in flight.
    pub async fn drain(self) {
        self.state.draining.store(true, Ordering::Relaxed);
        let _ = self.stop.send(true);
        if let Ok(Err(e)) = self.task.await {
            tracing::warn!("the HTTP API failed while draining: {e}");
        }
    }
}

/// A bound HTTP listener and the state it serves.
pub struct HttpServer {
    pub listener: tokio::net::TcpListener,
    pub address: SocketAddr,
    pub state: Arc<HttpState>,
}

impl HttpServer {
    pub async fn bind(listen: SocketAddr, state: Arc<HttpState>) -> anyhow::Result<Self> {
        use anyhow::Context;
        let listener =
            tokio::net::TcpListener::bind(listen).await.with_context(|| format!("--http-listen {listen}"))?;
        let address = listener.local_addr()?;
        Ok(HttpServer { listener, address, state })
    }

    /// A listener bound earlier (non-blocking).
    pub fn from_std(listener: std::net::TcpListener, state: Arc<HttpState>) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let address = listener.local_addr()?;
        Ok(HttpServer { listener, address, state })
    }

    /// Serves until `stop` resolves, then lets in-flight requests finish.
    pub async fn run(
        self,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let app = router(self.state);
        // Capped connections, each with a deadline for its first bytes and for every
        // request head; TCP_NODELAY (streams write small events: Nagle would hold each
        // behind the peer's delayed ACK).
        serve::serve(LimitedListener::new(self.listener, Default::default()), app, stop).await
    }
}
