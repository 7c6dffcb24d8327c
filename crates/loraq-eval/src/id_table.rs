//! The index of the reference ids: an open-addressing hash table (linear probing)
//! whose 32-byte slots hold a short id's bytes inline, so that looking up an id of
//! at most [`INLINE_ID_BYTES`] bytes reads one slot, one cache miss, and nothing
//! else; [`IdTable::prefetch`] lets a caller start that miss some lines ahead.
//! Longer ids keep their first bytes inline and are compared in full by the caller.

use std::hash::Hasher;

/// Bytes of an id kept in its slot; longer ids are compared in full by the caller.
pub(crate) const INLINE_ID_BYTES: usize = 23;

/// The length byte of a key whose id is longer than [`INLINE_ID_BYTES`].
const LONG_ID: u8 = INLINE_ID_BYTES as u8 + 1;

/// Entry index of an empty slot.
const EMPTY: u32 = u32::MAX;

/// An id as the table compares it: its length (or [`LONG_ID`]) then its first
/// [`INLINE_ID_BYTES`] bytes, zero-padded; with 32 bits of the id's hash.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdKey {
    bytes: [u8; INLINE_ID_BYTES + 1],
    hash: u32,
}

impl IdKey {
    /// The key of `id`.
    pub(crate) fn of(id: &str) -> Self {
        let id = id.as_bytes();
        let inline = id.len().min(INLINE_ID_BYTES);
        let mut bytes = [0u8; INLINE_ID_BYTES + 1];
        bytes[0] = if id.len() <= INLINE_ID_BYTES {
            id.len() as u8
        } else {
            LONG_ID
        };
        bytes[1..=inline].copy_from_slice(&id[..inline]);
        let mut hasher = FastHasher::default();
        hasher.write(id);
        let hash = hasher.finish();
        Self {
            bytes,
            hash: (hash ^ (hash >> 32)) as u32,
        }
    }

    /// The key holds only part of the id: equal keys may still be different ids.
    fn is_partial(&self) -> bool {
        self.bytes[0] == LONG_ID
    }
}

/// One slot: a key and its entry's index ([`EMPTY`] in a free slot). 32 bytes,
/// aligned, so that a slot never straddles two cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Slot {
    key: IdKey,
    entry: u32,
}

const FREE: Slot = Slot {
    key: IdKey {
        bytes: [0; INLINE_ID_BYTES + 1],
        hash: 0,
    },
    entry: EMPTY,
};

/// Slots from which a new table is filled by every thread (2 MiB, a huge page).
const PARALLEL_FILL_SLOTS: usize = 1 << 16;

/// Ids, each mapped to the index of its entry; at most three quarters full.
pub(crate) struct IdTable {
    slots: Vec<Slot>,
    /// Bits of the bucket index (the table has `1 << bits` slots).
    bits: u32,
    len: usize,
}

impl Default for IdTable {
    fn default() -> Self {
        Self::with_bits(10)
    }
}

impl IdTable {
    fn with_bits(bits: u32) -> Self {
        let len = 1usize << bits;
        let mut slots = Vec::with_capacity(len);
        advise_huge_pages(&slots);
        if len >= PARALLEL_FILL_SLOTS {
            // The first write of each page is a fault that clears it: a million ids'
            // table (64 MiB) took a quarter of a second on one thread while the
            // other waited; filled by every thread.
            use rayon::prelude::*;
            slots.par_extend(rayon::iter::repeat_n(FREE, len));
        } else {
            slots.resize(len, FREE);
        }
        Self {
            slots,
            bits,
            len: 0,
        }
    }

    /// The first slot probed for a hash: the top bits of a Fibonacci product, so
    /// that every bit of the 32-bit hash moves the bucket.
    #[inline]
    fn bucket(&self, hash: u32) -> usize {
        (u64::from(hash).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - self.bits)) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Starts loading the first slot `key` probes (a hint; no effect elsewhere
    /// than x86_64).
    #[inline]
    pub(crate) fn prefetch(&self, key: &IdKey) {
        let slot = &self.slots[self.bucket(key.hash)];
        prefetch(std::ptr::from_ref(slot).cast());
    }

    /// The entry of `key`; `same_id(entry)` decides between ids longer than
    /// [`INLINE_ID_BYTES`] whose keys are equal.
    #[inline]
    pub(crate) fn find(&self, key: &IdKey, same_id: impl Fn(u32) -> bool) -> Option<u32> {
        let mask = self.mask();
        let mut i = self.bucket(key.hash);
        loop {
            let slot = &self.slots[i];
            if slot.entry == EMPTY {
                return None;
            }
            if slot.key == *key && (!key.is_partial() || same_id(slot.entry)) {
                return Some(slot.entry);
            }
            i = (i + 1) & mask;
        }
    }

    /// Maps `key` to `entry` unless the id is there already: then the entry it
    /// maps to (nothing is changed). `same_id` as in [`IdTable::find`].
    pub(crate) fn insert(
        &mut self,
        key: &IdKey,
        entry: u32,
        same_id: impl Fn(u32) -> bool,
    ) -> std::result::Result<(), u32> {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.bucket(key.hash);
        loop {
            let slot = &mut self.slots[i];
            if slot.entry == EMPTY {
                *slot = Slot { key: *key, entry };
                self.len += 1;
                return Ok(());
            }
            if slot.key == *key && (!key.is_partial() || same_id(slot.entry)) {
                return Err(slot.entry);
            }
            i = (i + 1) & mask;
        }
    }

    /// Makes room for `more` ids beyond those in the table.
    pub(crate) fn reserve(&mut self, more: usize) {
        let wanted = self.len.saturating_add(more);
        let mut bits = self.bits;
        while wanted.saturating_mul(4) > (1usize << bits).saturating_mul(3) && bits < 40 {
            bits += 1;
        }
        if bits > self.bits {
            self.rehash(bits);
        }
    }

    /// Doubles the table.
    fn grow(&mut self) {
        self.rehash(self.bits + 1);
    }

    /// Moves the keys into a table of `1 << bits` slots; keys are placed by their
    /// stored hash, no id is read again.
    fn rehash(&mut self, bits: u32) {
        let old = std::mem::replace(self, Self::with_bits(bits));
        let mask = self.mask();
        // The moves are random writes into a table larger than the caches: each
        // bucket is fetched some slots ahead.
        const AHEAD: usize = 16;
        let used: Vec<&Slot> = old.slots.iter().filter(|s| s.entry != EMPTY).collect();
        for (n, slot) in used.iter().enumerate() {
            if let Some(ahead) = used.get(n + AHEAD) {
                self.prefetch(&ahead.key);
            }
            let mut i = self.bucket(slot.key.hash);
            while self.slots[i].entry != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = **slot;
        }
        self.len = old.len;
    }
}

/// Starts loading the cache line at `address` (a hint).
#[inline]
pub(crate) fn prefetch(address: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and changes nothing observable; SSE is part of
    // the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// Asks the kernel to back the spare capacity of `vec` with huge pages (a hint; Linux
/// only): tables read at random then miss the TLB far less often, and fill with far
/// fewer page faults. Call before the memory is first written.
pub(crate) fn advise_huge_pages<T>(vec: &Vec<T>) {
    let bytes = vec.capacity().saturating_mul(std::mem::size_of::<T>());
    advise_huge_range(vec.as_ptr().cast(), bytes);
}

/// [`advise_huge_pages`] for the `bytes` bytes allocated at `start` (a string's
/// capacity, say); nothing below two huge pages.
pub(crate) fn advise_huge_range(start: *const u8, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    if bytes < 2 * HUGE_PAGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = start as usize;
        let aligned = start.next_multiple_of(PAGE);
        let length = (start + bytes - aligned) / PAGE * PAGE;
        // SAFETY: the range lies inside an allocation of `bytes` bytes at `start`,
        // which this process owns; MADV_HUGEPAGE changes how pages are backed, never
        // their contents.
        unsafe {
            libc::madvise(aligned as *mut libc::c_void, length, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = start;
}

/// Writes `fill` into one element of every 4 KiB page of `vec`'s spare capacity, on
/// every thread: the page faults (each clears a page, or a huge page) happen here in
/// parallel instead of one by one in a sequential pass that later appends to `vec`.
/// The length of `vec` is unchanged.
pub(crate) fn prefault_spare<T: Copy + Send + Sync>(vec: &mut Vec<T>, fill: T) {
    use rayon::prelude::*;
    const PAGE: usize = 4096;
    // Pieces of 64 pages: large enough that a task costs nothing beside its faults.
    const PAGES_PER_TASK: usize = 64;
    let per_page = (PAGE / std::mem::size_of::<T>().max(1)).max(1);
    vec.spare_capacity_mut()
        .par_chunks_mut(per_page * PAGES_PER_TASK)
        .for_each(|pages| {
            for item in pages.iter_mut().step_by(per_page) {
                item.write(fill);
            }
        });
}

/// rustc's Fx hash: ids are not adversarial, and SipHash was a tenth of the time of
/// a million-question comparison.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0xf135_7aea_2e62_a9c5;
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(26) ^ word).wrapping_mul(K);
        }
        let mut tail = [0u8; 8];
        let rest = chunks.remainder();
        tail[..rest.len()].copy_from_slice(rest);
        self.0 =
            (self.0.rotate_left(26) ^ u64::from_le_bytes(tail) ^ rest.len() as u64).wrapping_mul(K);
    }

    fn finish(&self) -> u64 {
        // Spread the high bits down.
        self.0.rotate_left(26)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_ids_are_found_and_refused_twice() {
        let ids: Vec<String> = (0..5000)
            .map(|i| {
                if i % 3 == 0 {
                    format!("a-long-identifier-with-a-shared-prefix-{i}")
                } else {
                    format!("q{i}")
                }
            })
            .collect();
        let mut table = IdTable::default();
        for (i, id) in ids.iter().enumerate() {
            let same = |entry: u32| ids[entry as usize] == *id;
            assert_eq!(table.insert(&IdKey::of(id), i as u32, same), Ok(()));
        }
        for (i, id) in ids.iter().enumerate() {
            let same = |entry: u32| ids[entry as usize] == *id;
            assert_eq!(table.find(&IdKey::of(id), same), Some(i as u32));
            assert_eq!(table.insert(&IdKey::of(id), 99_999, same), Err(i as u32));
        }
        for absent in ["q5000", "a-long-identifier-with-a-shared-prefix-1", "", "q"] {
            let same = |entry: u32| ids[entry as usize] == absent;
            assert_eq!(table.find(&IdKey::of(absent), same), None, "{absent}");
        }
        // An id of 23 bytes is inline, one of 24 is not; a NUL byte is part of an id.
        let edge = ["x".repeat(23), "x".repeat(24), "x\0".into(), "x".into()];
        let mut table = IdTable::default();
        for (i, id) in edge.iter().enumerate() {
            let same = |entry: u32| edge[entry as usize] == *id;
            assert_eq!(table.insert(&IdKey::of(id), i as u32, same), Ok(()));
        }
        for (i, id) in edge.iter().enumerate() {
            let same = |entry: u32| edge[entry as usize] == *id;
            assert_eq!(table.find(&IdKey::of(id), same), Some(i as u32));
        }
    }

    /// Tables of at least `PARALLEL_FILL_SLOTS` slots are filled by every thread,
    /// both when reserved and when grown: every id is found, none twice, and an
    /// absent one is not.
    #[test]
    fn tables_filled_in_parallel_find_every_id() {
        let ids: Vec<String> = (0..120_000).map(|i| format!("q{i}")).collect();
        for reserved in [0, ids.len()] {
            let mut table = IdTable::default();
            table.reserve(reserved);
            for (i, id) in ids.iter().enumerate() {
                let same = |entry: u32| ids[entry as usize] == *id;
                assert_eq!(table.insert(&IdKey::of(id), i as u32, same), Ok(()));
            }
            assert!(table.slots.len() >= PARALLEL_FILL_SLOTS);
            assert_eq!(
                table.slots.iter().filter(|s| s.entry != EMPTY).count(),
                ids.len()
            );
            for (i, id) in ids.iter().enumerate() {
                let same = |entry: u32| ids[entry as usize] == *id;
                assert_eq!(table.find(&IdKey::of(id), same), Some(i as u32));
            }
            assert_eq!(table.find(&IdKey::of("q120000"), |_| false), None);
        }
    }

    /// Faulting the spare capacity in leaves the vector's length and contents, and
    /// what is appended afterwards is what is read back.
    #[test]
    fn prefault_keeps_the_vector() {
        let mut values: Vec<f64> = (0..10).map(f64::from).collect();
        values.reserve(3 << 20);
        let capacity = values.capacity();
        prefault_spare(&mut values, -1.0);
        assert_eq!(values.capacity(), capacity);
        assert_eq!(values, (0..10).map(f64::from).collect::<Vec<_>>());
        values.extend((10..3 << 20).map(f64::from));
        assert!(values.iter().enumerate().all(|(i, &v)| v == i as f64));
    }
}
