//! Each tenant's batch files, kept in memory: a listing, a lookup or a quota check reads
//! one tenant's entries, never every tenant's objects from disk (a tenant's 30 files with
//! 95 MB names once made another tenant's 120-byte upload take 12 s and 4 GB).
//!
//! The quota's check and the upload's write are one step: an upload first reserves a
//! file's place, then each chunk's bytes before it is written ([`Reservation`]), under the
//! index's lock, so uploads side by side can never pass the tenant's limits together (1,036
//! files once got past the 1,000-file limit). A file's name counts in its bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use strata_common::{Error, Result};

use super::store::FileObject;
use crate::tenant::Owner;

/// Most files one tenant keeps (uploads and batch results).
pub const MAX_TENANT_FILES: usize = 1000;
/// Most bytes of files one tenant keeps (their names included).
pub const MAX_TENANT_BYTES: u64 = 10 << 30;

/// One tenant's files and what its uploads in progress have reserved.
#[derive(Default)]
struct TenantFiles {
    files: BTreeMap<String, FileObject>,
    bytes: u64,
    reserved_files: usize,
    reserved_bytes: u64,
}

impl TenantFiles {
    fn add(&mut self, f: FileObject) {
        self.bytes += f.charged();
        if let Some(old) = self.files.insert(f.id.clone(), f) {
            self.bytes -= old.charged();
        }
    }
}

type Key = (String, String);

fn key(owner: &Owner) -> Key {
    (owner.tenant.clone(), owner.incarnation.clone())
}

/// The listing `sorted` after the entry whose id is `after` (from the start without one; past
/// the end for an unknown one), at most `limit` entries, each made by `copy` (only the
/// page is copied); and whether more follow. Files and batches page alike.
pub(super) fn page_after<T, R>(
    sorted: &[T],
    id: impl Fn(&T) -> &str,
    (after, limit): (Option<&str>, usize),
    copy: impl Fn(&T) -> R,
) -> (Vec<R>, bool) {
    let start = after.map_or(0, |a| sorted.iter().position(|x| id(x) == a).map_or(sorted.len(), |i| i + 1));
    let page: Vec<R> = sorted.iter().skip(start).take(limit).map(copy).collect();
    let more = start + page.len() < sorted.len();
    (page, more)
}

/// Which of a tenant's files a listing shows.
#[derive(Debug, Clone, Default)]
pub struct FileQuery {
    pub after: Option<String>,
    pub limit: usize,
    pub oldest_first: bool,
    pub purpose: Option<String>,
}

/// The index (see the module).
#[derive(Default)]
pub struct FileIndex {
    tenants: Mutex<HashMap<Key, TenantFiles>>,
}

impl FileIndex {
    /// The index of `files` (as found on disk at start).
    pub fn of(files: Vec<FileObject>) -> Self {
        let index = FileIndex::default();
        for f in files {
            index.insert(f);
        }
        index
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, TenantFiles>> {
        self.tenants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds (or replaces) a file, past the limits if need be (a batch's results).
    pub fn insert(&self, f: FileObject) {
        let k = (f.tenant.clone(), f.tenant_incarnation.clone());
        self.lock().entry(k).or_default().add(f);
    }

    pub fn get(&self, owner: &Owner, id: &str) -> Option<FileObject> {
        self.lock().get(&key(owner)).and_then(|t| t.files.get(id)).cloned()
    }

    pub fn remove(&self, owner: &Owner, id: &str) -> Option<FileObject> {
        let mut tenants = self.lock();
        let t = tenants.get_mut(&key(owner))?;
        let f = t.files.remove(id)?;
        t.bytes -= f.charged();
        Some(f)
    }

    /// Up to `q.limit` of `owner`'s files, newest first (oldest with `q.oldest_first`),
    /// of `q.purpose` only if it names one, after the file `q.after` (only the page is
    /// copied); and whether more follow.
    pub fn page(&self, owner: &Owner, q: &FileQuery) -> (Vec<FileObject>, bool) {
        let tenants = self.lock();
        let Some(t) = tenants.get(&key(owner)) else { return (Vec::new(), false) };
        let (after, limit) = (q.after.as_deref(), q.limit);
        let mut order: Vec<&FileObject> =
            t.files.values().filter(|f| q.purpose.as_ref().is_none_or(|p| &f.purpose == p)).collect();
        order.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
        if q.oldest_first {
            order.reverse();
        }
        page_after(&order, |f| &f.id, (after, limit), |f| (*f).clone())
    }

    /// A place for one more of `owner`'s files, refused when the tenant has its most.
    pub fn reserve(self: &Arc<Self>, owner: &Owner) -> Result<Reservation> {
        let mut tenants = self.lock();
        let t = tenants.entry(key(owner)).or_default();
        let held = t.files.len() + t.reserved_files;
        if held >= MAX_TENANT_FILES {
            return Err(Error::invalid(
                "file",
                format!("the tenant has {held} files, at most {MAX_TENANT_FILES}: delete some first"),
            ));
        }
        t.reserved_files += 1;
        Ok(Reservation { index: self.clone(), owner: owner.clone(), bytes: 0, done: false })
    }
}

/// One upload's place and the bytes it has taken so far; given back unless committed.
pub struct Reservation {
    index: Arc<FileIndex>,
    owner: Owner,
    bytes: u64,
    done: bool,
}

impl Reservation {
    /// Takes `n` more bytes of the tenant's quota, refused past it.
    pub fn take(&mut self, n: u64) -> Result<()> {
        let mut tenants = self.index.lock();
        let t = tenants.entry(key(&self.owner)).or_default();
        let held = t.bytes + t.reserved_bytes;
        if held.saturating_add(n) > MAX_TENANT_BYTES {
            return Err(Error::invalid(
                "file",
                format!(
                    "the tenant's files would pass {MAX_TENANT_BYTES} bytes ({held} held): delete some first"
                ),
            ));
        }
        t.reserved_bytes += n;
        self.bytes += n;
        Ok(())
    }

    /// The upload became `f`: its reservation becomes the file.
    pub fn commit(mut self, f: FileObject) {
        let mut tenants = self.index.lock();
        let t = tenants.entry(key(&self.owner)).or_default();
        t.reserved_files -= 1;
        t.reserved_bytes -= self.bytes;
        t.add(f);
        self.done = true;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut tenants = self.index.lock();
        if let Some(t) = tenants.get_mut(&key(&self.owner)) {
            t.reserved_files -= 1;
            t.reserved_bytes -= self.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(t: &str) -> Owner {
        Owner { tenant: t.into(), incarnation: "1".into() }
    }

    fn file(id: &str, o: &Owner, bytes: u64, created_at: u64) -> FileObject {
        FileObject {
            id: id.into(),
            object: "file".into(),
            bytes,
            created_at,
            filename: "f.jsonl".into(),
            purpose: "batch".into(),
            status: "processed".into(),
            tenant: o.tenant.clone(),
            tenant_incarnation: o.incarnation.clone(),
        }
    }

    #[test]
    fn uploads_side_by_side_cannot_pass_the_file_limit_together() {
        let index = Arc::new(FileIndex::default());
        let a = owner("a");
        for i in 0..MAX_TENANT_FILES - 2 {
            index.insert(file(&format!("f{i}"), &a, 1, i as u64));
        }
        let first = index.reserve(&a).unwrap();
        let second = index.reserve(&a).unwrap();
        assert!(index.reserve(&a).is_err(), "two uploads in progress hold the last two places");
        assert!(index.reserve(&owner("b")).is_ok(), "another tenant is not affected");
        drop(first);
        let third = index.reserve(&a).unwrap();
        third.commit(file("new", &a, 1, 9999));
        assert!(index.reserve(&a).is_err());
        drop(second);
        assert!(index.reserve(&a).is_ok());
    }

    #[test]
    fn bytes_are_taken_before_they_are_written_and_names_count() {
        let index = Arc::new(FileIndex::default());
        let a = owner("a");
        let mut r = index.reserve(&a).unwrap();
        r.take(MAX_TENANT_BYTES - 10).unwrap();
        let mut other = index.reserve(&a).unwrap();
        assert!(other.take(11).is_err(), "the first upload's bytes are held");
        other.take(10).unwrap();
        drop(other);
        let mut f = file("x", &a, MAX_TENANT_BYTES - 10, 1);
        f.filename = "n".repeat(20);
        r.commit(f);
        let mut next = index.reserve(&a).unwrap();
        assert!(next.take(1).is_err(), "the name's bytes count too");
        assert_eq!(index.remove(&a, "x").map(|f| f.id), Some("x".into()));
        next.take(1).unwrap();
    }

    #[test]
    fn pages_come_newest_first_after_an_id() {
        let index = Arc::new(FileIndex::default());
        let a = owner("a");
        for i in 0..5 {
            index.insert(file(&format!("f{i}"), &a, 1, i));
        }
        index.insert(file("other", &owner("b"), 1, 99));
        let q = |after: Option<&str>, limit, oldest_first| FileQuery {
            after: after.map(str::to_string),
            limit,
            oldest_first,
            purpose: None,
        };
        let (page, more) = index.page(&a, &q(None, 2, false));
        assert_eq!(page.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(), ["f4", "f3"]);
        assert!(more);
        let (page, more) = index.page(&a, &q(Some("f3"), 10, false));
        assert_eq!(page.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(), ["f2", "f1", "f0"]);
        assert!(!more);
        let (page, _) = index.page(&a, &q(Some("f1"), 2, true));
        assert_eq!(page.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(), ["f2", "f3"]);
        assert!(index.get(&a, "other").is_none(), "another tenant's file is not found");
    }
}
