//! Who may call what: bearer tokens in the `authorization` metadata.
//!
//! Inference calls take client API keys when the coordinator is given some
//! (`--api-key`, `STRATA_API_KEYS`); otherwise they are open. Admin calls take the admin
//! token (`--admin-token`, `STRATA_ADMIN_TOKEN`), which must differ from every client key,
//! so a client credential never administers the cluster; without an admin token, admin
//! calls are accepted from loopback only. Comparisons take the same time whatever the
//! token, so a caller cannot guess it byte by byte.

use strata_common::tenant::TenantConfig;

use tonic::{Request, Status};

use crate::tenant::{digest, parse_key, Caller, Tenants};

fn bearer<T>(req: &Request<T>) -> Option<&str> {
    bearer_token(req.metadata().get("authorization")?.to_str().ok()?)
}

/// The token of an `authorization: Bearer <token>` value (gRPC metadata or HTTP header).
pub fn bearer_token(value: &str) -> Option<&str> {
    value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer ")).map(str::trim)
}

fn same(a: &str, b: &str) -> bool {
    same_bytes(a.as_bytes(), b.as_bytes())
}

fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

/// One accepted credential: the secret itself, or its SHA-256 (`sha256:<64 hex digits>`,
/// as `printf %s KEY | sha256sum` prints it), so a config file need not hold the key.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Secret {
    Plain(String),
    Hash([u8; 32]),
}

impl Secret {
    fn parse(entry: &str, field: &str) -> strata_common::Result<Secret> {
        match entry.starts_with("sha256:") {
            true => Ok(Secret::Hash(parse_key(entry, field)?)),
            false => Ok(Secret::Plain(entry.to_string())),
        }
    }

    fn matches(&self, presented: &str) -> bool {
        match self {
            Secret::Plain(k) => same(k, presented),
            Secret::Hash(h) => same_bytes(h, &digest(presented)),
        }
    }

    /// The SHA-256 of the token this credential accepts.
    fn digest(&self) -> [u8; 32] {
        match self {
            Secret::Plain(k) => digest(k),
            Secret::Hash(h) => *h,
        }
    }
}

/// Inference-call credentials: the tenant directory (see [`crate::tenant`]). Clones
/// share it, so a reload (SIGHUP, when the keys come from a file) or a tenant made
/// through the admin API reaches every service that checks them.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    tenants: Tenants,
}

impl ClientAuth {
    /// Accepts every caller (as the default tenant).
    pub fn open() -> Self {
        ClientAuth::default()
    }

    /// Accepts callers bearing one of `keys`, each the key or `sha256:<hex>` of it (none
    /// given: open).
    pub fn with_keys(keys: Vec<String>) -> strata_common::Result<Self> {
        ClientAuth::with_tenants(keys, Vec::new())
    }

    /// `keys` (the default tenant's) and the configured tenants with theirs.
    pub fn with_tenants(keys: Vec<String>, tenants: Vec<TenantConfig>) -> strata_common::Result<Self> {
        Ok(ClientAuth { tenants: Tenants::new(keys, tenants)? })
    }

    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Replaces the default tenant's keys (rotation without a restart); refused, keeping
    /// the old keys, when an entry is malformed or would also pass as the admin token.
    pub fn reload(&self, keys: Vec<String>, admin: &AdminAuth) -> strata_common::Result<usize> {
        if let Some(token) = &admin.token {
            let digests: Vec<[u8; 32]> = keys
                .iter()
                .map(|k| k.trim())
                .filter(|k| !k.is_empty())
                .map(|k| parse_key(k, "api_keys"))
                .collect::<strata_common::Result<_>>()?;
            if digests.contains(&token.digest()) {
                return Err(strata_common::Error::invalid(
                    "api_keys",
                    "a client key must differ from the admin token",
                ));
            }
        }
        self.tenants.set_default_keys(keys)
    }

    /// The caller, or UNAUTHENTICATED.
    pub fn check<T>(&self, req: &Request<T>) -> Result<Caller, Status> {
        self.check_token(bearer(req), "metadata").map_err(|e| match e {
            strata_common::Error::Unauthenticated(m) => Status::unauthenticated(m),
            other => Status::unauthenticated(other.to_string()),
        })
    }

    /// Checks a bearer token (None: the caller sent none); `carrier` names where the
    /// caller should put it ("metadata" for gRPC, "header" for HTTP).
    pub fn check_token(&self, token: Option<&str>, carrier: &str) -> strata_common::Result<Caller> {
        self.tenants.authenticate(token, carrier)
    }
}

/// inference.v1's auth as a layer (a tonic interceptor on the service): every call's
/// caller, named by its bearer token, goes into the request's extensions — as the HTTP
/// API's layer puts it in its requests' — and a call without a valid key never reaches a
/// handler. Handlers read it with [`caller_of`].
#[derive(Clone)]
pub struct CallerLayer(pub ClientAuth);

impl tonic::service::Interceptor for CallerLayer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let caller = self.0.check(&request)?;
        request.extensions_mut().insert(caller);
        Ok(request)
    }
}

/// The caller [`CallerLayer`] named for `request`.
pub fn caller_of<T>(request: &Request<T>) -> Result<Caller, Status> {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::internal("no caller: the auth layer did not run"))
}

/// Admin-call credentials.
#[derive(Debug, Clone, Default)]
pub struct AdminAuth {
    token: Option<Secret>,
}

impl AdminAuth {
    /// `token` (the token or `sha256:<hex>` of it) None: loopback callers only. Fails when
    /// the admin token would also pass as a client key.
    pub fn new(token: Option<String>, clients: &ClientAuth) -> strata_common::Result<Self> {
        let token = token.filter(|t| !t.is_empty()).map(|t| Secret::parse(&t, "admin_token")).transpose()?;
        if let Some(t) = &token {
            if clients.tenants.holds_digest(&t.digest()) {
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
        Some(bearer(req).is_some_and(|t| token.matches(t)))
    }

    pub fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        match &self.token {
            Some(token) => match bearer(req) {
                None => Err(Status::unauthenticated(
                    "admin calls need the admin token: send metadata \"authorization: Bearer <token>\"",
                )),
                Some(t) if token.matches(t) => Ok(()),
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
        let a = ClientAuth::with_keys(vec!["k1".into(), "k2".into()]).unwrap();
        assert_eq!(a.check(&Request::new(())).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert!(a.check(&with_auth("Bearer k2")).is_ok());
        assert_eq!(a.check(&with_auth("Bearer k3")).unwrap_err().code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn the_admin_token_is_distinct_and_required() {
        let clients = ClientAuth::with_keys(vec!["k1".into()]).unwrap();
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

    #[test]
    fn keys_may_be_given_as_hashes_and_rotated() {
        // printf %s k2 | sha256sum
        let k2 = "sha256:015f7e6bc5aeaf483724089e9252cc13b50951a6b69412522765cff4d780306e";
        let hashed = format!("sha256:{}", crate::tenant::hex(&digest("k2")));
        assert!(ClientAuth::with_keys(vec![k2.into()]).unwrap().check(&with_auth("Bearer k2")).is_ok());
        let a = ClientAuth::with_keys(vec!["k1".into(), hashed.clone()]).unwrap();
        assert!(a.check(&with_auth("Bearer k2")).is_ok());
        assert!(a.check(&with_auth(&format!("Bearer {hashed}"))).is_err(), "the hash is not the key");
        assert!(ClientAuth::with_keys(vec!["sha256:zz".into()]).is_err());
        // The admin token may not be a client key, hashed or not, now or after a reload.
        assert!(AdminAuth::new(Some("k2".into()), &a).is_err());
        let admin = AdminAuth::new(Some(hashed_of("root")), &a).unwrap();
        assert!(admin.check(&with_auth("Bearer root")).is_ok());
        let copy = a.clone();
        assert_eq!(a.reload(vec!["k3".into()], &admin).unwrap(), 1);
        assert!(copy.check(&with_auth("Bearer k3")).is_ok(), "clones see the reload");
        assert!(copy.check(&with_auth("Bearer k1")).is_err(), "rotated out");
        assert!(a.reload(vec!["root".into()], &admin).is_err());
        assert!(copy.check(&with_auth("Bearer k3")).is_ok(), "a refused reload keeps the old keys");
    }

    fn hashed_of(t: &str) -> String {
        format!("sha256:{}", crate::tenant::hex(&digest(t)))
    }
}
