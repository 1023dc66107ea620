//! Host buffers standing in for device memory, and the one way kernels lock them.
//!
//! Invariant: a kernel that needs several buffers locks them all at once with
//! [`lock_distinct`], in ascending buffer id, and releases them together; anything else
//! (collectives, uploads) holds one buffer lock at a time. Lock sets taken in one global
//! order never form a cycle, so even a racing plan cannot deadlock the streams, and a
//! buffer named twice is reported instead of locked twice.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::OpsError;

/// A buffer of `f32` elements owned by one rank: a shared handle (cloning it does not
/// copy the data). Its length never changes after allocation.
#[derive(Clone)]
pub struct CpuBuffer {
    inner: Arc<Inner>,
}

struct Inner {
    id: u64,
    rank: u32,
    len: usize,
    data: Mutex<Vec<f32>>,
}

impl CpuBuffer {
    /// A zeroed buffer, or a `Backend` error when the memory cannot be reserved.
    pub(super) fn zeroed(id: u64, rank: u32, len: usize) -> Result<CpuBuffer, OpsError> {
        CpuBuffer::filled(id, rank, len, 0.0)
    }

    /// A buffer with every element `value` (NaN stands in for uninitialised memory).
    pub(super) fn filled(
        id: u64,
        rank: u32,
        len: usize,
        value: f32,
    ) -> Result<CpuBuffer, OpsError> {
        let mut data = Vec::new();
        data.try_reserve_exact(len).map_err(|e| {
            OpsError::Backend(format!(
                "cannot allocate {len} f32 elements on rank {rank}: {e}"
            ))
        })?;
        data.resize(len, value);
        Ok(CpuBuffer {
            inner: Arc::new(Inner {
                id,
                rank,
                len,
                data: Mutex::new(data),
            }),
        })
    }

    /// A copy of a remote member's send buffer, for one round of a communicator (never
    /// locked with another buffer: collectives lock one buffer at a time).
    pub(super) fn remote(rank: u32, data: Vec<f32>) -> CpuBuffer {
        CpuBuffer {
            inner: Arc::new(Inner {
                id: u64::MAX,
                rank,
                len: data.len(),
                data: Mutex::new(data),
            }),
        }
    }

    /// The backend-unique id (also the global lock order): two handles of one buffer
    /// have the same id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The rank the buffer lives on.
    pub(super) fn rank(&self) -> u32 {
        self.inner.rank
    }

    /// Number of elements.
    pub(super) fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether two handles name the same buffer.
    pub(super) fn same(&self, other: &CpuBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Locks the contents (recovering from a poisoned lock: the data is plain floats).
    pub(super) fn lock(&self) -> MutexGuard<'_, Vec<f32>> {
        super::lock(&self.inner.data)
    }
}

impl fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CpuBuffer#{}(rank {}, {} elements)",
            self.inner.id, self.inner.rank, self.inner.len
        )
    }
}

/// Locks `N` distinct buffers in ascending id order and returns their guards in the
/// order given, or a `Shape` error naming `kernel` when a buffer appears twice.
pub(super) fn lock_distinct<'a, const N: usize>(
    kernel: &'static str,
    bufs: [&'a CpuBuffer; N],
) -> Result<[MutexGuard<'a, Vec<f32>>; N], OpsError> {
    let mut order: [usize; N] = std::array::from_fn(|i| i);
    order.sort_unstable_by_key(|&i| bufs[i].id());
    let mut locked = Vec::with_capacity(N);
    let mut last = None;
    for i in order {
        let id = bufs[i].id();
        if last != Some(id) {
            last = Some(id);
            locked.push((i, bufs[i].lock()));
        }
    }
    locked.sort_unstable_by_key(|&(i, _)| i);
    let guards: Vec<_> = locked.into_iter().map(|(_, g)| g).collect();
    guards.try_into().map_err(|_| OpsError::Shape {
        kernel,
        reason: format!("its buffers must be distinct, got {bufs:?}"),
    })
}
