//! Who may call what: bearer tokens in the `authorization` metadata.
//!
//! Inference calls take client API keys when the coordinator is given some
//! (`--api-key`, `STRATA_API_KEYS`); otherwise they are open. Admin calls take the admin
//! token (`--admin-token`, `STRATA_ADMIN_TOKEN`), which must differ from every client key,
//! so a client credential never administers the cluster; without an admin token, admin
//! calls are accepted from loopback only. Comparisons take the same time whatever the
//! token, so a caller cannot guess it byte by byte.

use std::sync::Arc;

use tonic::{Request, Status};

fn bearer<T>(req: &Request<T>) -> Option<&str> {
    let v = req.metadata().get("authorization")?.to_str().ok()?;
    v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).map(str::trim)
}

fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

/// Inference-call credentials.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    keys: Option<Arc<Vec<String>>>,
}

impl ClientAuth {
    /// Accepts every caller.
    pub fn open() -> Self {
        ClientAuth { keys: None }
    }

    /// Accepts callers bearing one of `keys` (none given: open).
    pub fn with_keys(keys: Vec<String>) -> Self {
        let keys: Vec<String> = keys.into_iter().filter(|k| !k.is_empty()).collect();
        ClientAuth { keys: (!keys.is_empty()).then(|| Arc::new(keys)) }
    }

    pub fn keys(&self) -> &[String] {
        self.keys.as_deref().map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(keys) = &self.keys else { return Ok(()) };
        match bearer(req) {
            None => {
                Err(Status::unauthenticated("missing API key: send metadata \"authorization: Bearer <key>\""))
            }
            Some(t) if keys.iter().any(|k| same(k, t)) => Ok(()),
            Some(_) => Err(Status::unauthenticated("the API key is not valid")),
        }
    }
}

/// Admin-call credentials.
#[derive(Debug, Clone, Default)]
pub struct AdminAuth {
    token: Option<String>,
}

impl AdminAuth {
    /// `token` None: loopback callers only. Fails when the admin token is also a client key.
    pub fn new(token: Option<String>, clients: &ClientAuth) -> strata_common::Result<Self> {
        let token = token.filter(|t| !t.is_empty());
        if let Some(t) = &token {
            if clients.keys().iter().any(|k| same(k, t)) {
                return Err(strata_common::Error::invalid(
                    "admin_token",
                    "must differ from every client API key",
                ));
            }
        }
        Ok(AdminAuth { token })
    }

    /// Whether `req` bears the admin token (None: no token is configured).
    pub fn token_valid<T>(&self, req: &Request<T>) -> Option<bool> {
        let token = self.token.as_ref()?;
        Some(bearer(req).is_some_and(|t| same(token, t)))
    }

    pub fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        match &self.token {
            Some(token) => match bearer(req) {
                None => Err(Status::unauthenticated(
                    "admin calls need the admin token: send metadata \"authorization: Bearer <token>\"",
                )),
                Some(t) if same(token, t) => Ok(()),
                Some(_) => Err(Status::permission_denied("the admin token is not valid")),
            },
            None => match req.remote_addr() {
                Some(a) if a.ip().is_loopback() => Ok(()),
                Some(a) => Err(Status::permission_denied(format!(
                    "admin calls from {a} need an admin token (start the coordinator with --admin-token or STRATA_ADMIN_TOKEN); without one only loopback callers are accepted"
                ))),
                None => Err(Status::permission_denied("admin calls need an admin token or a loopback caller")),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_auth(v: &str) -> Request<()> {
        let mut r = Request::new(());
        r.metadata_mut().insert("authorization", v.parse().unwrap());
        r
    }

    #[test]
    fn client_keys_are_checked_when_configured() {
        assert!(ClientAuth::open().check(&Request::new(())).is_ok());
        let a = ClientAuth::with_keys(vec!["k1".into(), "k2".into()]);
        assert_eq!(a.check(&Request::new(())).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert!(a.check(&with_auth("Bearer k2")).is_ok());
        assert_eq!(a.check(&with_auth("Bearer k3")).unwrap_err().code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn the_admin_token_is_distinct_and_required() {
        let clients = ClientAuth::with_keys(vec!["k1".into()]);
        assert!(AdminAuth::new(Some("k1".into()), &clients).is_err());
        let a = AdminAuth::new(Some("root".into()), &clients).unwrap();
        assert_eq!(a.check(&Request::new(())).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert_eq!(a.check(&with_auth("Bearer k1")).unwrap_err().code(), tonic::Code::PermissionDenied);
        assert!(a.check(&with_auth("Bearer root")).is_ok());
        // Without a token and without a known peer address, nothing gets in.
        let open = AdminAuth::new(None, &clients).unwrap();
        assert_eq!(open.check(&Request::new(())).unwrap_err().code(), tonic::Code::PermissionDenied);
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "abcd"));
    }
}
