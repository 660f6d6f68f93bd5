//! The batch API's routes: `/v1/files` (multipart upload, list, get, content, delete) and
//! `/v1/batches` (create, list, get, cancel).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Multipart, Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use super::index::FileQuery;
use super::store::{check_id, new_id, MAX_FILENAME_BYTES};
use super::{Batches, MAX_FILE_BYTES};
use crate::api::http::error::ApiError;
use crate::api::http::params;
use crate::tenant::Caller;

pub fn router<S: Clone + Send + Sync + 'static>(batches: Arc<Batches>) -> Router<S> {
    Router::new()
        .route(
            "/v1/files",
            post(upload).get(list_files).layer(DefaultBodyLimit::max(MAX_FILE_BYTES as usize + (1 << 20))),
        )
        .route("/v1/files/{id}", get(get_file).delete(delete_file))
        .route("/v1/files/{id}/content", get(file_content))
        .route("/v1/batches", post(create).get(list_batches))
        .route("/v1/batches/{id}", get(get_batch))
        .route("/v1/batches/{id}/cancel", post(cancel))
        .with_state(batches)
}

fn answer<T: serde::Serialize>(r: strata_common::Result<T>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

fn multipart_error(e: axum::extract::multipart::MultipartError) -> ApiError {
    ApiError::invalid("file", format!("the upload is not valid multipart/form-data: {}", e.body_text()))
}

/// `POST /v1/files`: a multipart form with `purpose` and `file`, written to disk as it
/// arrives (never held whole in memory), each chunk's bytes taken from the tenant's quota
/// before they are written.
async fn upload(
    State(batches): State<Arc<Batches>>,
    Extension(who): Extension<Caller>,
    mut form: Multipart,
) -> Response {
    let id = new_id("file-");
    let result = receive(&batches, &id, &mut form, &who.owner()).await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(batches.store().upload_path(&id)).await;
    }
    match result {
        Ok(f) => Json(f).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn receive(
    batches: &Batches,
    id: &str,
    form: &mut Multipart,
    owner: &crate::tenant::Owner,
) -> Result<super::store::FileObject, ApiError> {
    // A tenant's files (uploads and results) are bounded in number and bytes: the place
    // and each chunk are taken before they are written (see batch::index).
    let mut reserved = batches.reserve_file(owner)?;
    let mut purpose = None;
    let mut file: Option<(String, u64)> = None;
    while let Some(mut field) = form.next_field().await.map_err(multipart_error)? {
        match field.name() {
            Some("purpose") => purpose = Some(short_text(field).await?),
            Some("file") if file.is_some() => {
                return Err(ApiError::invalid("file", "the form has more than one file field"))
            }
            Some("file") => {
                let name = field.file_name().unwrap_or("upload.jsonl").to_string();
                if name.len() > MAX_FILENAME_BYTES {
                    return Err(ApiError::invalid(
                        "file",
                        format!("a file name of {} bytes; at most {MAX_FILENAME_BYTES}", name.len()),
                    ));
                }
                reserved.take(name.len() as u64)?;
                let path = batches.store().upload_path(id);
                let mut out = tokio::fs::File::create(&path)
                    .await
                    .map_err(|e| ApiError::from(strata_common::Error::Internal(e.to_string())))?;
                let mut bytes = 0u64;
                while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
                    bytes += chunk.len() as u64;
                    if bytes > MAX_FILE_BYTES {
                        return Err(ApiError::invalid(
                            "file",
                            format!("files may be at most {MAX_FILE_BYTES} bytes"),
                        ));
                    }
                    reserved.take(chunk.len() as u64)?;
                    out.write_all(&chunk)
                        .await
                        .map_err(|e| ApiError::from(strata_common::Error::Internal(e.to_string())))?;
                }
                out.sync_all()
                    .await
                    .map_err(|e| ApiError::from(strata_common::Error::Internal(e.to_string())))?;
                file = Some((name, bytes));
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    other.to_string(),
                    "the upload form takes only purpose and file",
                ))
            }
            None => return Err(ApiError::invalid("file", "a form field without a name")),
        }
    }
    let Some((name, bytes)) = file else {
        return Err(ApiError::invalid("file", "the form has no file field"));
    };
    match purpose.as_deref() {
        Some("batch") => {}
        _ => return Err(ApiError::invalid("purpose", "purpose must be batch")),
    }
    Ok(batches.add_file(id, (&name, "batch"), bytes, reserved, owner)?)
}

/// A short text field (`purpose`), read at most 64 bytes of.
async fn short_text(mut field: axum::extract::multipart::Field<'_>) -> Result<String, ApiError> {
    let mut text = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
        text.extend_from_slice(&chunk);
        if text.len() > 64 {
            return Err(ApiError::invalid("purpose", "purpose must be batch"));
        }
    }
    String::from_utf8(text).map_err(|_| ApiError::invalid("purpose", "purpose must be batch"))
}

type Who = Extension<Caller>;

/// `GET /v1/files?limit=&after=&order=&purpose=`: the caller's files, newest first unless
/// `order=asc`, paged by id (only the page is copied).
async fn list_files(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Query(q): Query<FilesQuery>,
) -> Response {
    if q.purpose.as_deref().is_some_and(|p| p != "batch" && p != "batch_output") {
        return ApiError::invalid("purpose", "batch files only: purpose batch or batch_output")
            .into_response();
    }
    let oldest_first = match q.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => {
            return ApiError::invalid("order", format!("{other:?}: give asc or desc")).into_response()
        }
    };
    let query = FileQuery {
        after: q.after,
        limit: q.limit.unwrap_or(10_000).clamp(1, 10_000),
        oldest_first,
        purpose: q.purpose,
    };
    let (data, has_more) = batches.files(&who.owner(), &query);
    Json(json!({
        "object": "list",
        "first_id": data.first().map(|f| f.id.clone()),
        "last_id": data.last().map(|f| f.id.clone()),
        "has_more": has_more,
        "data": data,
    }))
    .into_response()
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FilesQuery {
    limit: Option<usize>,
    after: Option<String>,
    order: Option<String>,
    purpose: Option<String>,
}

async fn get_file(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Response {
    answer(batches.file(&id, &who.owner()))
}

async fn delete_file(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Response {
    let deleted = batches.delete_file(&id, &who.owner());
    answer(deleted.map(|_| json!({"id": id, "object": "file", "deleted": true})))
}

/// `GET /v1/files/{id}/content`: the bytes, streamed from disk.
async fn file_content(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = check_id(&id).and_then(|_| batches.file(&id, &who.owner())) {
        return ApiError::from(e).into_response();
    }
    match tokio::fs::File::open(batches.store().data_path(&id)).await {
        Ok(f) => {
            let body = Body::from_stream(file_stream(f));
            ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
        }
        Err(e) => ApiError::from(strata_common::Error::Internal(e.to_string())).into_response(),
    }
}

/// A file's bytes as a stream of chunks.
fn file_stream(
    f: tokio::fs::File,
) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static {
    use tokio::io::AsyncReadExt;
    futures::stream::unfold(f, |mut f| async move {
        let mut buf = vec![0u8; 64 << 10];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    })
}

async fn create(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    body: axum::body::Bytes,
) -> Response {
    let f = match params::object(&body) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let field = |name: &str| -> Result<String, ApiError> {
        params::string(&f, name)?
            .map(str::to_string)
            .ok_or_else(|| ApiError::invalid(name, format!("{name} is required")))
    };
    let (input, endpoint, window) =
        match (field("input_file_id"), field("endpoint"), field("completion_window")) {
            (Ok(i), Ok(e), Ok(w)) => (i, e, w),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e.into_response(),
        };
    let metadata = f.get("metadata").filter(|v| !v.is_null()).cloned();
    answer(batches.create(&input, &endpoint, &window, metadata, &who.owner()))
}

#[derive(serde::Deserialize)]
struct ListQuery {
    limit: Option<usize>,
    after: Option<String>,
}

/// `GET /v1/batches?limit=&after=`: newest first, paged by id.
async fn list_batches(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Query(q): Query<ListQuery>,
) -> Response {
    let limit = q.limit.unwrap_or(20).clamp(1, 100);
    let (page, has_more) = batches.list(&who.owner(), q.after.as_deref(), limit);
    let body: Value = json!({
        "object": "list",
        "first_id": page.first().map(|b| b.id.clone()),
        "last_id": page.last().map(|b| b.id.clone()),
        "has_more": has_more,
        "data": page,
    });
    Json(body).into_response()
}

async fn get_batch(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Response {
    answer(batches.get(&id, &who.owner()))
}

async fn cancel(
    State(batches): State<Arc<Batches>>,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Response {
    answer(batches.cancel(&id, &who.owner()))
}
