//! Request bodies on their way in: each must keep up a minimum rate, and a tenant has a
//! bounded number arriving at once.
//!
//! 4,200 bodies sent at one byte every five seconds once filled the HTTP listener: every
//! connection was busy, none was idle, and `/health` and completions timed out for as long
//! as the sender liked. A body now has [`BODY_GRACE`] plus one second for every
//! [`MIN_BODY_RATE`] bytes it has sent to arrive whole (a 16 MiB JSON body on a slow link
//! has minutes; a trickle is cut after seconds), and a tenant (the caller's key) has at most
//! [`ARRIVING_PER_TENANT`] bodies arriving at once: more are refused with a 429 at once,
//! and their connection closed, so one key cannot hold the listener's connections.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use http_body::{Body as _, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use super::error::ApiError;

/// How long any body has before the rate counts.
pub const BODY_GRACE: Duration = Duration::from_secs(10);

/// The least average rate a body must arrive at after [`BODY_GRACE`], in bytes a second.
pub const MIN_BODY_RATE: u64 = 16 << 10;

/// Bodies one tenant may have arriving at once.
pub const ARRIVING_PER_TENANT: usize = 256;

/// The bodies arriving now, per tenant.
#[derive(Default)]
pub struct Arrivals {
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl Arrivals {
    /// `body`, bounded as the module says, holding one of `tenant`'s places until it has
    /// arrived (or failed, or was dropped). An empty body holds none.
    pub fn admit(&self, tenant: &str, body: Body) -> Result<Body, ApiError> {
        if body.is_end_stream() {
            return Ok(body);
        }
        let place = {
            let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
            // Forget tenants with nothing arriving, so names cannot grow the map.
            tenants.retain(|_, s| Arc::strong_count(s) > 1);
            tenants
                .entry(tenant.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(ARRIVING_PER_TENANT)))
                .clone()
        };
        let Ok(place) = place.try_acquire_owned() else {
            let mut e = ApiError::from(strata_common::Error::Overloaded(format!(
                "tenant {tenant:?} has {ARRIVING_PER_TENANT} request bodies arriving already; send fewer at once"
            )));
            e.code = Some("too_many_bodies");
            return Err(e);
        };
        let started = Instant::now();
        Ok(Body::new(Arriving {
            inner: body,
            received: 0,
            started,
            deadline: Box::pin(tokio::time::sleep_until(started + BODY_GRACE)),
            place: Some(place),
        }))
    }
}

/// A body that must keep up the rate; its tenant's place goes back when it ends.
struct Arriving {
    inner: Body,
    received: u64,
    started: Instant,
    deadline: Pin<Box<Sleep>>,
    place: Option<OwnedSemaphorePermit>,
}

impl Arriving {
    /// When the body must have arrived, for what it has sent so far.
    fn due(&self) -> Instant {
        self.started + BODY_GRACE + Duration::from_secs_f64(self.received as f64 / MIN_BODY_RATE as f64)
    }
}

impl http_body::Body for Arriving {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if this.place.is_none() {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.received += frame.data_ref().map_or(0, |d| d.len() as u64);
                let due = this.due();
                this.deadline.as_mut().reset(due);
            }
            Poll::Ready(_) => this.place = None,
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    this.place = None;
                    let why = format!(
                        "the request body came too slowly: {} bytes in {:.0} s (at least {} KiB/s after the first {} s)",
                        this.received,
                        this.started.elapsed().as_secs_f64(),
                        MIN_BODY_RATE >> 10,
                        BODY_GRACE.as_secs()
                    );
                    return Poll::Ready(Some(Err(axum::Error::new(why))));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.place.is_none() || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use http_body_util::BodyExt;

    /// A body that sends `chunks` one at a time, `gap` apart.
    fn trickle(chunks: usize, gap: Duration) -> Body {
        let stream = futures::stream::iter(0..chunks).then(move |_| async move {
            tokio::time::sleep(gap).await;
            Ok::<_, std::io::Error>(Bytes::from_static(b"x"))
        });
        Body::from_stream(stream)
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickling_body_is_cut_and_gives_its_place_back() {
        let arrivals = Arrivals::default();
        let body = arrivals.admit("t", trickle(100, Duration::from_secs(5))).unwrap();
        let started = Instant::now();
        let e = body.collect().await.unwrap_err();
        assert!(e.to_string().contains("came too slowly"), "{e}");
        let took = started.elapsed();
        assert!(took >= BODY_GRACE && took < BODY_GRACE + Duration::from_secs(6), "{took:?}");
        assert!(arrivals
            .tenants
            .lock()
            .unwrap()
            .values()
            .all(|s| s.available_permits() == ARRIVING_PER_TENANT));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_rate_arrives_however_long_it_takes() {
        let arrivals = Arrivals::default();
        // 64 KiB chunks a second for a minute: four times the least rate.
        let stream = futures::stream::iter(0..60).then(|_| async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 64 << 10]))
        });
        let body = arrivals.admit("t", Body::from_stream(stream)).unwrap();
        assert_eq!(body.collect().await.unwrap().to_bytes().len(), 60 * (64 << 10));
    }

    #[tokio::test]
    async fn a_tenant_has_a_bounded_number_of_bodies_arriving() {
        let arrivals = Arrivals::default();
        let held: Vec<Body> = (0..ARRIVING_PER_TENANT)
            .map(|_| arrivals.admit("t", trickle(1, Duration::from_secs(60))).unwrap())
            .collect();
        let e = arrivals.admit("t", trickle(1, Duration::ZERO)).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::TOO_MANY_REQUESTS, "{e:?}");
        assert!(arrivals.admit("other", trickle(1, Duration::ZERO)).is_ok(), "another tenant is not held up");
        assert!(arrivals.admit("t", Body::empty()).is_ok(), "an empty body holds no place");
        drop(held);
        assert!(arrivals.admit("t", trickle(1, Duration::ZERO)).is_ok(), "places come back");
    }
}
