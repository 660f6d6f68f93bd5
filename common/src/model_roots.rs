//! Which model directories a deployment may name: absolute paths under configured roots.
//!
//! A deployment's `model_dir` is read by every worker it is placed on, so it must mean the
//! same directory everywhere (absolute, no `..`) and stay inside what the operator allowed
//! (`--model-root`): a caller with the admin token must not point workers at `/etc` or at
//! another tenant's files. Roots are checked by path components, and again after
//! following symlinks where the directory exists on this machine — the directory and
//! every file in it (a `config.json` or weights file linked to a path outside the roots
//! is refused; links within them, as in HF's cache of snapshots and blobs, are fine).

use std::path::{Component, Path, PathBuf};

use crate::{Error, Result};

/// Longest model_dir accepted.
const MAX_PATH: usize = 4096;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelRoots(Vec<PathBuf>);

impl ModelRoots {
    /// Directories under `roots`; none: any absolute path.
    pub fn new(roots: Vec<PathBuf>) -> Self {
        ModelRoots(roots)
    }

    /// Also allows `dir` (and what is under it).
    pub fn with(mut self, dir: PathBuf) -> Self {
        if !self.0.is_empty() {
            self.0.push(dir);
        }
        self
    }

    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    fn listed(&self) -> String {
        self.0.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    /// `model_dir` as a path, when it is an absolute path inside the roots: an
    /// `INVALID_ARGUMENT` for a malformed path, `PERMISSION_DENIED` naming the roots for
    /// one outside them.
    pub fn check(&self, model_dir: &str) -> Result<PathBuf> {
        if model_dir.is_empty() {
            return Err(Error::invalid("model_dir", "must not be empty"));
        }
        if model_dir.len() > MAX_PATH || model_dir.contains('\0') {
            return Err(Error::invalid("model_dir", format!("must be a path of at most {MAX_PATH} bytes")));
        }
        let path = Path::new(model_dir);
        if !path.is_absolute() {
            return Err(Error::invalid(
                "model_dir",
                format!("{model_dir:?} must be an absolute path (a relative one would be read from each worker's working directory)"),
            ));
        }
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(Error::invalid("model_dir", format!("{model_dir:?} must not contain '..'")));
        }
        if self.is_open() {
            return Ok(path.to_path_buf());
        }
        if !self.0.iter().any(|r| path.starts_with(r)) {
            return Err(Error::PermissionDenied(format!(
                "model_dir {model_dir} is outside the model roots ({})",
                self.listed()
            )));
        }
        let roots: Vec<PathBuf> =
            self.0.iter().map(|r| std::fs::canonicalize(r).unwrap_or(r.clone())).collect();
        let inside = |real: &Path| roots.iter().any(|r| real.starts_with(r));
        if let Ok(real) = std::fs::canonicalize(path) {
            if !inside(&real) {
                return Err(Error::PermissionDenied(format!(
                    "model_dir {model_dir} resolves to {}, outside the model roots ({})",
                    real.display(),
                    self.listed()
                )));
            }
            // Each file the loaders read, wherever its links lead.
            for entry in std::fs::read_dir(&real).into_iter().flatten().flatten() {
                let file = entry.path();
                if let Ok(target) = std::fs::canonicalize(&file) {
                    if !inside(&target) {
                        return Err(Error::PermissionDenied(format!(
                            "{} resolves to {}, outside the model roots ({})",
                            file.display(),
                            target.display(),
                            self.listed()
                        )));
                    }
                }
            }
        }
        Ok(path.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorClass;

    #[test]
    fn only_absolute_paths_inside_the_roots() {
        let roots = ModelRoots::new(vec!["/models".into()]);
        assert!(roots.check("/models/llama").is_ok());
        let e = roots.check("/etc").unwrap_err();
        assert_eq!(e.class(), ErrorClass::PermissionDenied);
        assert!(e.to_string().contains("/models"), "{e}");
        assert_eq!(roots.check("/modelsx/a").unwrap_err().class(), ErrorClass::PermissionDenied);
        for bad in ["", "models/llama", "/models/../etc", "/models/a\0b"] {
            assert_eq!(roots.check(bad).unwrap_err().class(), ErrorClass::InvalidInput, "{bad:?}");
        }
        assert!(roots.check(&format!("/models/{}", "a".repeat(5000))).is_err());
        let open = ModelRoots::default();
        assert!(open.check("/anywhere").is_ok());
        assert!(open.check("relative").is_err());
    }

    #[test]
    fn a_symlink_out_of_a_root_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let link = root.path().join("escape");
        std::os::unix::fs::symlink(outside.path(), &link).unwrap();
        let roots = ModelRoots::new(vec![root.path().to_path_buf()]);
        let e = roots.check(link.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("resolves to"), "{e}");
        let real = root.path().join("real");
        std::fs::create_dir(&real).unwrap();
        assert!(roots.check(real.to_str().unwrap()).is_ok());
        // A file linked within the roots (HF's cache: snapshots link to blobs) is fine; one
        // linked outside them is refused, naming it.
        std::fs::write(root.path().join("blob"), "{}").unwrap();
        std::os::unix::fs::symlink(root.path().join("blob"), real.join("config.json")).unwrap();
        assert!(roots.check(real.to_str().unwrap()).is_ok());
        std::fs::write(outside.path().join("weights"), "x").unwrap();
        std::os::unix::fs::symlink(outside.path().join("weights"), real.join("model.safetensors")).unwrap();
        let e = roots.check(real.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("model.safetensors"), "{e}");
    }
}
