//! The control plane: [`view`] keeps an exact copy of the registry (list + watch),
//! [`leader`] elects one coordinator, which reconciles desired state with what runs:
//! [`plan`] decides (pure), [`tasks`] carries out (build, canary, drain, teardown)
//! through the `WorkerApi` seam.

pub mod leader;
pub mod metrics;
pub mod placement;
pub mod plan;
pub mod tasks;
pub mod view;
