//! Weight buffers on transparent huge pages.
//!
//! A decode step streams every weight once, gigabytes per token. On 4 KiB pages that is a
//! TLB miss and a page walk every 4 KiB of the stream — in a virtual machine a nested walk
//! through the host's tables too; on 2 MiB pages, one every 2 MiB. On this project's
//! development machine (a VM) batch-1 decode of the 1B shape never passed ~13.4 tok/s
//! (33 GB/s) on 4 KiB pages, and on huge pages won every one of 8 alternating pairs, by 6%
//! to 74%. The price is paid at load: the kernel zeroes each fresh 2 MiB page, which on
//! the VM ran at a few hundred MB/s the first time its memory was touched (a 12 s load),
//! 3–6 s later (1.2 s on 4 KiB pages).
//!
//! A [`HugeVec`] lies in an anonymous mapping advised `MADV_HUGEPAGE` *before* its first
//! touch, so the kernel backs it with huge pages as it is filled (under the usual
//! `transparent_hugepage=madvise` setting an unadvised `Vec` never gets them). Where the
//! kernel has no transparent huge pages the advice fails quietly and the buffer is an
//! ordinary mapping.
//!
//! A huge page backs only a 2 MiB-aligned 2 MiB of one mapping, so a buffer mapped on its
//! own smaller than that (a 1 MiB expert matrix of a mixture of experts) would get none:
//! streaming such matrices ran at 20 GB/s where large ones ran at 32. So buffers are cut
//! from shared **slabs**, 2 MiB-aligned reservations of [`SLAB`] bytes whose untouched
//! rest costs only address space, one after another; a slab is unmapped when its last
//! buffer drops, and a dropped buffer's whole pages go back to the kernel at once
//! (`MADV_DONTNEED`; its range is never handed out again).

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use memmap2::{MmapMut, MmapRaw};

/// Bytes a slab reserves (address space; only what buffers touch is memory).
const SLAB: usize = 256 << 20;
/// A huge page.
const HUGE: usize = 2 << 20;
/// Where buffers in a slab start (a page, so that a dropped buffer's pages are its own).
const PAGE: usize = 4096;

/// One reservation; unmapped when the last buffer in it drops.
struct Slab {
    map: MmapRaw,
}

impl Slab {
    /// A mapping of `bytes` and a huge page more, and the offset of its first 2 MiB
    /// boundary. `None` where the mapping fails.
    fn reserve(bytes: usize) -> Option<(Arc<Slab>, usize)> {
        let map = MmapMut::map_anon(bytes.checked_add(HUGE)?).ok()?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let map = MmapRaw::from(map);
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        Some((Arc::new(Slab { map }), start))
    }
}

/// Where buffers are cut from: the slab in use and its first free byte.
struct Slabs {
    current: Mutex<Option<(Arc<Slab>, usize)>>,
}

/// The process's slabs.
static SLABS: Slabs = Slabs { current: Mutex::new(None) };

impl Slabs {
    /// `bytes` (a multiple of [`PAGE`]) in a slab: a slab of their own when large.
    fn carve(&self, bytes: usize) -> Option<(Arc<Slab>, usize)> {
        if bytes > SLAB / 4 {
            return Slab::reserve(bytes);
        }
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((slab, next)) = current.as_mut() {
            if *next + bytes <= slab.map.len() {
                let at = *next;
                *next += bytes;
                return Some((slab.clone(), at));
            }
        }
        let (slab, start) = Slab::reserve(SLAB)?;
        *current = Some((slab.clone(), start + bytes));
        Some((slab, start))
    }
}

/// A fixed-length, zero-initialised buffer of plain values on huge pages where the
/// kernel gives them.
pub struct HugeVec<T> {
    /// `None` for an empty buffer.
    slab: Option<Arc<Slab>>,
    /// Byte offset of the first element in the slab.
    offset: usize,
    len: usize,
    _elem: PhantomData<T>,
}

// SAFETY: a HugeVec owns its range of the slab alone (ranges never overlap and are never
// handed out twice); the slab itself is only mapped and unmapped. Elements are plain data.
unsafe impl<T: Send> Send for HugeVec<T> {}
// SAFETY: as above; shared access reads only.
unsafe impl<T: Sync> Sync for HugeVec<T> {}

impl<T: bytemuck::Pod> HugeVec<T> {
    /// `len` zeroed elements. Aborts on allocation failure, as `Vec` does.
    pub fn zeroed(len: usize) -> Self {
        Self::zeroed_in(&SLABS, len)
    }

    fn zeroed_in(slabs: &Slabs, len: usize) -> Self {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).expect("HugeVec size overflows usize");
        if bytes == 0 {
            return HugeVec { slab: None, offset: 0, len, _elem: PhantomData };
        }
        let (slab, offset) =
            bytes.checked_next_multiple_of(PAGE).and_then(|b| slabs.carve(b)).unwrap_or_else(|| {
                // Page alignment covers every Pod type's alignment.
                std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(bytes, PAGE).unwrap())
            });
        HugeVec { slab: Some(slab), offset, len, _elem: PhantomData }
    }

    /// A copy of `src`.
    pub fn from_slice(src: &[T]) -> Self {
        let mut v = Self::zeroed(src.len());
        v.copy_from_slice(src);
        v
    }

    fn ptr(&self) -> Option<*mut T> {
        // SAFETY: `offset` lies inside the mapping (carve checked it).
        self.slab.as_ref().map(|s| unsafe { s.map.as_mut_ptr().add(self.offset) } as *mut T)
    }
}

impl<T> Drop for HugeVec<T> {
    fn drop(&mut self) {
        let Some(slab) = self.slab.take() else { return };
        let bytes = (self.len * std::mem::size_of::<T>()).next_multiple_of(PAGE);
        // SAFETY: this buffer alone uses these pages and nothing reads them again; a
        // failed advice only keeps them until the slab is unmapped.
        let _ = unsafe {
            slab.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, self.offset, bytes)
        };
    }
}

impl<T: bytemuck::Pod> Deref for HugeVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self.ptr() {
            // SAFETY: `len` elements from a page-aligned start lie inside this buffer's
            // range, which holds initialised (zeroed, then written) plain values.
            Some(p) => unsafe { std::slice::from_raw_parts(p, self.len) },
            None => &[],
        }
    }
}

impl<T: bytemuck::Pod> DerefMut for HugeVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self.ptr() {
            // SAFETY: as in `deref`; `&mut self` makes this the only access.
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p, self.len) },
            None => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_is_written() {
        let mut v = HugeVec::<u32>::zeroed(3 << 20);
        assert!(v.iter().all(|&x| x == 0));
        v.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32);
        assert_eq!(v[(3 << 20) - 1], (3 << 20) - 1);
        let c = HugeVec::from_slice(&[1i8, -2, 3]);
        assert_eq!(&c[..], &[1, -2, 3]);
        assert!(HugeVec::<f32>::zeroed(0).is_empty());
    }

    #[test]
    fn small_buffers_share_huge_aligned_slabs_and_stay_apart() {
        let slabs = Slabs { current: Mutex::new(None) };
        let sizes: Vec<usize> = (1..=6).map(|i| 300_000 * i).collect();
        let mut bufs: Vec<HugeVec<u8>> = sizes.iter().map(|&n| HugeVec::zeroed_in(&slabs, n)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.iter().all(|&x| x == 0));
            b.fill(i as u8 + 1);
        }
        let first = bufs[0].as_ptr() as usize;
        assert_eq!(first % HUGE, 0, "a slab's first buffer starts on a huge page");
        let mut at = first;
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8 + 1), "buffer {i} was written over");
            assert_eq!(b.as_ptr() as usize, at, "buffer {i} follows the one before, page-aligned");
            at += sizes[i].next_multiple_of(PAGE);
        }
        // A large buffer has a reservation of its own, starting on a huge page.
        let big = HugeVec::<u8>::zeroed_in(&slabs, SLAB / 2);
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        // Dropped buffers' ranges are not handed out again: the next one follows on.
        drop(bufs);
        let again = HugeVec::<u64>::zeroed_in(&slabs, 1000);
        assert_eq!(again.as_ptr() as usize, at);
        assert!(again.iter().all(|&x| x == 0));
    }
}
