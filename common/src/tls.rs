//! Cluster membership by certificate (mutual TLS with a cluster CA).
//!
//! Every process of a secured cluster holds a certificate signed by the cluster CA. Its
//! **role** is a DNS name among its subject alternative names: [`Role::Coordinator`]
//! certificates name `strata-coordinator`, [`Role::Worker`] certificates `strata-worker`.
//! A worker's server accepts only clients whose certificate chains to the CA and learns
//! their role from it; a coordinator dials a worker expecting the name `strata-worker`, so
//! it verifies the worker's role rather than its address (pod addresses change;
//! cert-manager can issue a role name but not a pod IP in advance). `strata cert` makes a
//! development CA and per-role certificates.

use std::path::{Path, PathBuf};

use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::{Error, Result};

/// What a cluster member may do, read from its certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Coordinator,
    Worker,
}

impl Role {
    /// The DNS name a certificate of this role carries.
    pub fn dns_name(self) -> &'static str {
        match self {
            Role::Coordinator => "strata-coordinator",
            Role::Worker => "strata-worker",
        }
    }

    pub fn all() -> [Role; 2] {
        [Role::Coordinator, Role::Worker]
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Coordinator => "coordinator",
            Role::Worker => "worker",
        })
    }
}

impl std::str::FromStr for Role {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "coordinator" => Ok(Role::Coordinator),
            "worker" => Ok(Role::Worker),
            _ => Err(Error::invalid("role", format!("{s:?}: use coordinator or worker"))),
        }
    }
}

/// Largest PEM file read (a certificate chain or key is a few KiB).
const MAX_PEM: u64 = 1 << 20;

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>> {
    let meta =
        std::fs::metadata(path).map_err(|e| Error::invalid(what, format!("{}: {e}", path.display())))?;
    if meta.len() > MAX_PEM {
        return Err(Error::invalid(what, format!("{}: larger than {MAX_PEM} bytes", path.display())));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::invalid(what, format!("{}: {e}", path.display())))?;
    if !bytes.windows(10).any(|w| w == b"-----BEGIN") {
        return Err(Error::invalid(what, format!("{}: not a PEM file", path.display())));
    }
    Ok(bytes)
}

/// The DER bytes of the first certificate in a PEM text.
fn first_der(pem: &[u8]) -> Option<Vec<u8>> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).ok()?;
    (pem.label == "CERTIFICATE").then_some(pem.contents)
}

/// The roles a DER certificate names (none when it is malformed or names none).
pub fn roles_of(der: &[u8]) -> Vec<Role> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else { return Vec::new() };
    let Ok(Some(san)) = cert.subject_alternative_name() else { return Vec::new() };
    let mut roles = Vec::new();
    for name in &san.value.general_names {
        if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
            roles.extend(Role::all().into_iter().filter(|r| r.dns_name() == *dns));
        }
    }
    roles
}

/// The roles of the client that sent `req`: `None` when the connection is not TLS (a
/// cluster without credentials), an empty list when its certificate names no role.
pub fn peer_roles<B>(req: &http::Request<B>) -> Option<Vec<Role>> {
    let info = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs = info.peer_certs()?;
    Some(certs.first().map(|leaf| roles_of(leaf.as_ref())).unwrap_or_default())
}

/// Where a process's cluster credentials live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterCredentials {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// A process's loaded cluster credentials.
#[derive(Clone)]
pub struct ClusterTls {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    roles: Vec<Role>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").field("roles", &self.roles).finish_non_exhaustive()
    }
}

impl ClusterTls {
    /// Reads the files and checks that the certificate names `role`.
    pub fn load(files: &ClusterCredentials, role: Role) -> Result<Self> {
        let cert = read_pem(&files.cert, "cluster certificate")?;
        let key = read_pem(&files.key, "cluster key")?;
        let ca = read_pem(&files.ca, "cluster CA")?;
        let der = first_der(&cert).ok_or_else(|| {
            Error::invalid("cluster certificate", format!("{}: no certificate in it", files.cert.display()))
        })?;
        let roles = roles_of(&der);
        if !roles.contains(&role) {
            return Err(Error::invalid(
                "cluster certificate",
                format!(
                    "{} does not name {:?} among its DNS names, so it cannot act as a {role} (make one with `strata cert issue --role {role}`)",
                    files.cert.display(),
                    role.dns_name()
                ),
            ));
        }
        first_der(&ca).ok_or_else(|| {
            Error::invalid("cluster CA", format!("{}: no certificate in it", files.ca.display()))
        })?;
        Ok(ClusterTls { cert, key, ca, roles })
    }

    /// A server that requires a client certificate from the cluster CA.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    /// A client that presents this certificate and accepts only a server of role `peer`.
    pub fn client(&self, peer: Role) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.cert, &self.key))
            .domain_name(peer.dns_name())
    }
}
