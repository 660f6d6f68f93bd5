//! Cluster mode with real processes: etcd, `strata coordinator`s and `strata worker`s, placement, rollouts, security, tenants, dashboards with a real Prometheus, the registry contract, the Helm chart.
//!
//! One test binary of several modules (one per former file): each binary links the
//! whole dependency graph, so fewer of them build faster.

#[path = "cluster_suite/cluster.rs"]
mod cluster;
#[path = "cluster_suite/cluster_placement.rs"]
mod cluster_placement;
#[path = "cluster_suite/cluster_rollouts.rs"]
mod cluster_rollouts;
#[path = "cluster_suite/cluster_security.rs"]
mod cluster_security;
#[path = "cluster_suite/cluster_signals.rs"]
mod cluster_signals;
#[path = "cluster_suite/cluster_tenants.rs"]
mod cluster_tenants;
#[path = "cluster_suite/dashboards.rs"]
mod dashboards;
#[path = "cluster_suite/etcd_security.rs"]
mod etcd_security;
#[path = "cluster_suite/helm_chart.rs"]
mod helm_chart;
#[path = "cluster_suite/registry.rs"]
mod registry;
