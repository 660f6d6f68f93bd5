//! `strata cert`: a cluster CA and per-role certificates for development and tests.
//!
//! Production clusters can issue the same certificates with cert-manager (deploy/): what
//! matters is the CA, and that each certificate names its role (`strata-coordinator` or
//! `strata-worker`) among its DNS names, with both server and client key usage.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use strata_common::tls::Role;

#[derive(Subcommand, Debug)]
pub enum CertCommand {
    /// A development set in one go: ca.{crt,key}, coordinator.{crt,key}, worker.{crt,key}.
    Dev {
        /// Directory to write into (created if missing).
        /// Directory the files are written to (created if missing).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        opts: IssueOptions,
    },
    /// A new cluster CA: ca.crt and ca.key.
    Ca {
        /// Directory the files are written to (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// A certificate signed by the CA in --ca: NAME.crt and NAME.key.
    Issue {
        /// Directory holding ca.crt and ca.key.
        #[arg(long)]
        ca: PathBuf,
        /// File stem and common name.
        #[arg(long)]
        name: String,
        /// coordinator or worker: the cluster role the certificate carries. Without it the
        /// certificate is a plain server/client certificate (etcd, callers).
        #[arg(long)]
        role: Option<Role>,
        /// Directory the files are written to (created if missing).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        opts: IssueOptions,
    },
}

#[derive(Args, Debug, Clone)]
pub struct IssueOptions {
    /// Extra DNS names or IP addresses the certificate is valid for (repeatable).
    #[arg(long = "host", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
    pub hosts: Vec<String>,
    /// Days the certificate is valid.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
}

fn validity(params: &mut CertificateParams, days: u32) -> anyhow::Result<()> {
    if days == 0 || days > 3650 {
        bail!("--days {days}: give 1 to 3650");
    }
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days.into());
    Ok(())
}

fn write(dir: &Path, stem: &str, cert: &str, key: &KeyPair) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--out {}", dir.display()))?;
    let crt = dir.join(format!("{stem}.crt"));
    std::fs::write(&crt, cert).with_context(|| format!("writing {}", crt.display()))?;
    let key_path = dir.join(format!("{stem}.key"));
    std::fs::write(&key_path, key.serialize_pem())
        .with_context(|| format!("writing {}", key_path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

fn make_ca(days: u32) -> anyhow::Result<(String, KeyPair, CertificateParams)> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, "Strata cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params, days)?;
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key, params))
}

fn issue(
    issuer: &Issuer<'_, KeyPair>,
    name: &str,
    role: Option<Role>,
    opts: &IssueOptions,
) -> anyhow::Result<(String, KeyPair)> {
    let mut names: Vec<String> = role.map(|r| r.dns_name().to_string()).into_iter().collect();
    for host in &opts.hosts {
        // A role is a name in the certificate: a host may not be another role's.
        let plain = host.trim_end_matches('.').to_ascii_lowercase();
        if let Some(other) = Role::all().into_iter().find(|r| r.dns_name() == plain && Some(*r) != role) {
            bail!("--host {host}: that name is the {other} role; issue it with --role {other}");
        }
    }
    names.extend(opts.hosts.iter().cloned());
    let mut params = CertificateParams::new(names).context("--host")?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages =
        vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    validity(&mut params, opts.days)?;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key))
}

pub fn run(command: CertCommand) -> anyhow::Result<()> {
    match command {
        CertCommand::Dev { out, opts } => {
            let (ca_pem, ca_key, ca_params) = make_ca(opts.days)?;
            write(&out, "ca", &ca_pem, &ca_key)?;
            let issuer = Issuer::new(ca_params, ca_key);
            for role in Role::all() {
                let (pem, key) = issue(&issuer, &role.to_string(), Some(role), &opts)?;
                write(&out, &role.to_string(), &pem, &key)?;
            }
            println!("wrote ca, coordinator and worker certificates to {}", out.display());
        }
        CertCommand::Ca { out, days } => {
            let (pem, key, _) = make_ca(days)?;
            write(&out, "ca", &pem, &key)?;
            println!("wrote {}", out.join("ca.crt").display());
        }
        CertCommand::Issue { ca, name, role, out, opts } => {
            if !strata_common::registry::keys::valid_name(&name) {
                bail!("--name {name:?}: use letters, digits, '-', '_', '.' or ':'");
            }
            let read = |f: &str| {
                let p = ca.join(f);
                std::fs::read_to_string(&p).with_context(|| format!("--ca: reading {}", p.display()))
            };
            let key = KeyPair::from_pem(&read("ca.key")?).context("--ca: ca.key")?;
            let issuer = Issuer::from_ca_cert_pem(&read("ca.crt")?, key).context("--ca: ca.crt")?;
            let (pem, key) = issue(&issuer, &name, role, &opts)?;
            write(&out, &name, &pem, &key)?;
            println!("wrote {}", out.join(format!("{name}.crt")).display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--role worker --host strata-coordinator` minted a coordinator's certificate.
    #[test]
    fn a_host_cannot_name_another_role() {
        let (_, ca_key, ca_params) = make_ca(1).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let opts = |host: &str| IssueOptions { hosts: vec![host.into()], days: 1 };
        for host in ["strata-coordinator", "STRATA-Coordinator."] {
            let e = issue(&issuer, "w1", Some(Role::Worker), &opts(host)).map(|_| ()).unwrap_err();
            assert!(e.to_string().contains("coordinator role"), "{host}: {e}");
        }
        assert!(issue(&issuer, "w1", Some(Role::Worker), &opts("strata-worker")).is_ok());
        let e =
            issue(&issuer, "c1", Some(Role::Coordinator), &opts("strata-worker")).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("worker role"), "{e}");
    }
}
