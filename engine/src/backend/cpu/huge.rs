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
//! A [`HugeVec`] is an anonymous mapping advised `MADV_HUGEPAGE` *before* its first
//! touch, so the kernel backs it with huge pages as it is filled (under the usual
//! `transparent_hugepage=madvise` setting an unadvised `Vec` never gets them). Where the
//! kernel has no transparent huge pages the advice fails quietly and the buffer is an
//! ordinary mapping.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

/// A fixed-length, zero-initialised buffer of plain values on huge pages where the
/// kernel gives them.
pub struct HugeVec<T> {
    /// `None` for an empty buffer (a mapping cannot be empty).
    map: Option<MmapMut>,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: bytemuck::Pod> HugeVec<T> {
    /// `len` zeroed elements. Aborts on allocation failure, as `Vec` does.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).expect("HugeVec size overflows usize");
        if bytes == 0 {
            return HugeVec { map: None, len, _elem: PhantomData };
        }
        let map = MmapMut::map_anon(bytes).unwrap_or_else(|_| {
            // Page alignment covers every Pod type's alignment.
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(bytes, 4096).unwrap())
        });
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        HugeVec { map: Some(map), len, _elem: PhantomData }
    }

    /// A copy of `src`.
    pub fn from_slice(src: &[T]) -> Self {
        let mut v = Self::zeroed(src.len());
        v.copy_from_slice(src);
        v
    }
}

impl<T: bytemuck::Pod> Deref for HugeVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.map {
            Some(m) => &bytemuck::cast_slice(&m[..])[..self.len],
            None => &[],
        }
    }
}

impl<T: bytemuck::Pod> DerefMut for HugeVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.map {
            Some(m) => &mut bytemuck::cast_slice_mut(&mut m[..])[..self.len],
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
}
