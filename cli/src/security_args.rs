//! Cluster credentials and model roots on the command line ([security] in the config), and
//! the safe default: a cluster role reachable from other machines needs credentials.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::bail;
use clap::Args;
use strata_common::config::SecuritySettings;
use strata_common::tls::{ClusterCredentials, ClusterTls, Role};

#[derive(Args, Debug, Clone, Default)]
pub struct SecurityArgs {
    /// This process's certificate from the cluster CA (PEM); it must name its role
    /// (`strata cert dev --out DIR` makes a development set).
    #[arg(long, env = "STRATA_CLUSTER_CERT", value_name = "FILE")]
    pub cluster_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "STRATA_CLUSTER_KEY", value_name = "FILE")]
    pub cluster_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers must present a certificate it signed.
    #[arg(long, env = "STRATA_CLUSTER_CA", value_name = "FILE")]
    pub cluster_ca: Option<PathBuf>,
    /// Listen beyond loopback without cluster credentials: anyone who can reach this
    /// process is trusted as a cluster member.
    #[arg(long, env = "STRATA_INSECURE")]
    pub insecure: bool,
    /// A directory deployments may load models from (repeatable; absolute).
    #[arg(long = "model-root", alias = "model-roots", env = "STRATA_MODEL_ROOTS", value_delimiter = ',')]
    pub model_roots: Vec<PathBuf>,
}

impl SecurityArgs {
    pub fn apply(&self, s: &mut SecuritySettings) {
        for (slot, v) in [
            (&mut s.cluster_cert, &self.cluster_cert),
            (&mut s.cluster_key, &self.cluster_key),
            (&mut s.cluster_ca, &self.cluster_ca),
        ] {
            if v.is_some() {
                *slot = v.clone();
            }
        }
        if self.insecure {
            s.insecure = true;
        }
        if !self.model_roots.is_empty() {
            s.model_roots = self.model_roots.clone();
        }
    }
}

/// The cluster credentials of a process of `role` listening on `listen`. Without
/// credentials, only a loopback address (or an explicit `--insecure`) is allowed.
pub fn cluster_tls(
    s: &SecuritySettings,
    listen: SocketAddr,
    role: Role,
) -> anyhow::Result<Option<ClusterTls>> {
    if let Some((cert, key, ca)) = s.credentials()? {
        return Ok(Some(ClusterTls::load(&ClusterCredentials { cert, key, ca }, role)?));
    }
    if listen.ip().is_loopback() {
        return Ok(None);
    }
    if s.insecure {
        tracing::warn!(
            "--insecure: listening on {listen} without cluster credentials; anyone who can reach this {role} is trusted as a cluster member"
        );
        return Ok(None);
    }
    bail!(
        "--listen {listen} is reachable from other machines, and without cluster credentials anyone who can reach it would be trusted: \
         give --cluster-cert, --cluster-key and --cluster-ca (`strata cert dev --out DIR` makes a development set), \
         or --insecure to accept that"
    )
}
