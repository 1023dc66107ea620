//! Device memory: buffers, and the pool that reuses their memory safely.
//!
//! A [`CudaBuffer`] is a shared handle to an allocation. Kernels are asynchronous, so
//! the memory of a buffer whose last handle is dropped may still be read or written by
//! work queued on any of the rank's streams. It is therefore never freed nor reused at
//! once: the drop *retires* it; the next allocation *fences* retired blocks by
//! recording an event on every stream of the rank (each records after everything issued
//! so far, which includes every use of the block, since a use is issued through a
//! handle); and a block goes back to the free lists only when all of its fence events
//! have completed. Allocation takes a free block of the same size class before asking
//! the driver, so a steady training loop allocates nothing: this is the pool that keeps
//! device buffers alive until their last readers complete.
//!
//! Memory is returned to the driver only when an allocation fails (then the device is
//! synchronised, every fence completes, free blocks are released and the allocation is
//! retried once) and when the backend is gone.
//!
//! Invariant: a block is handed out again only after every stream of the rank executed
//! past the point where its previous owner was dropped.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::Stream;

use super::device::{backend, Device};
use super::event::{lock, EventPool};
use crate::OpsError;

/// Allocation granularity: sizes are rounded up to this, so near sizes share a class.
const GRANULE: usize = 512;

/// One allocation.
pub(super) struct DevMem {
    ptr: sys::CUdeviceptr,
    /// The size class in bytes.
    bytes: usize,
    id: u64,
    memory: Arc<Memory>,
}

impl DevMem {
    /// The device address.
    pub(super) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Usable bytes (the size class).
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        self.memory.retire(self.ptr, self.bytes);
    }
}

/// A buffer of `f32` elements on the rank's GPU: a shared handle (cloning it does not
/// copy the data). Its length never changes after allocation. Dropping the last handle
/// retires the memory: the backend's pool reuses it only once every stream of the rank
/// has executed past the drop (so work still queued on it is never disturbed).
#[derive(Clone)]
pub struct CudaBuffer {
    pub(super) mem: Arc<DevMem>,
    pub(super) rank: u32,
    pub(super) len: usize,
}

impl CudaBuffer {
    /// The device address of element 0.
    pub(super) fn ptr(&self) -> sys::CUdeviceptr {
        self.mem.ptr()
    }

    /// The device address of element 0, for a trainer's own kernels and library calls
    /// (a `float*` in the device's primary context). The address is valid while a
    /// handle of the buffer lives: a trainer that reads or writes it on a stream of its
    /// own keeps a handle until that work has executed (the backend's pool knows only
    /// its own streams, [`CudaBuffer`]).
    pub fn device_ptr(&self) -> u64 {
        self.mem.ptr()
    }

    /// The number of `f32` elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rank whose GPU holds the buffer.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The device address of element `i`.
    pub(super) fn at(&self, i: u64) -> sys::CUdeviceptr {
        self.mem.ptr() + i * 4
    }

    /// Whether two handles name the same buffer.
    pub(super) fn same(&self, other: &CudaBuffer) -> bool {
        Arc::ptr_eq(&self.mem, &other.mem)
    }

    /// The buffer's identity, equal for two handles exactly when [`CudaBuffer::same`]
    /// (valid while a handle lives).
    pub(super) fn id(&self) -> usize {
        Arc::as_ptr(&self.mem) as usize
    }
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaBuffer#{}(rank {}, {} elements)",
            self.mem.id, self.rank, self.len
        )
    }
}

/// The rank's allocator.
pub(super) struct Memory {
    device: Arc<Device>,
    events: Arc<EventPool>,
    state: Mutex<State>,
    next_id: AtomicU64,
}

/// Blocks (address, size class) waiting for their fence events.
type Fenced = (Vec<(sys::CUdeviceptr, usize)>, Vec<sys::CUevent>);

#[derive(Default)]
struct State {
    /// Dropped blocks not fenced yet.
    retired: Vec<(sys::CUdeviceptr, usize)>,
    /// Fenced blocks with their fence events (one per stream), oldest first: they
    /// complete in this order (each stream runs its events in the order recorded).
    fenced: VecDeque<Fenced>,
    /// Reusable blocks by size class.
    free: HashMap<usize, Vec<sys::CUdeviceptr>>,
    /// Bytes obtained from the driver and not returned.
    held: usize,
}

// SAFETY: the state holds driver handles and addresses, used with the context bound,
// behind a mutex.
unsafe impl Send for Memory {}
// SAFETY: as for `Send`.
unsafe impl Sync for Memory {}

impl Memory {
    pub(super) fn new(device: Arc<Device>, events: Arc<EventPool>) -> Arc<Memory> {
        Arc::new(Memory {
            device,
            events,
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(0),
        })
    }

    fn retire(&self, ptr: sys::CUdeviceptr, bytes: usize) {
        lock(&self.state).retired.push((ptr, bytes));
    }

    /// Bytes currently obtained from the driver (in use, fenced or free).
    pub(super) fn held_bytes(&self) -> usize {
        lock(&self.state).held
    }

    /// An uninitialised allocation of at least `bytes` bytes. The caller has the
    /// context bound.
    pub(super) fn alloc_raw(self: &Arc<Self>, bytes: usize) -> Result<Arc<DevMem>, OpsError> {
        let class = bytes.max(1).div_ceil(GRANULE).saturating_mul(GRANULE);
        let mut st = lock(&self.state);
        self.fence(&mut st)?;
        // Sweep only when no block of the class is free (a sweep queries events).
        let mut reused = st.free.get_mut(&class).and_then(Vec::pop);
        if reused.is_none() {
            self.sweep(&mut st)?;
            reused = st.free.get_mut(&class).and_then(Vec::pop);
        }
        let ptr = match reused {
            Some(p) => p,
            // SAFETY: a plain allocation of the bound context.
            None => match unsafe { cu::malloc_sync(class) } {
                Ok(p) => {
                    st.held += class;
                    p
                }
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    // Give cached memory back and try once more.
                    cu::ctx::synchronize().map_err(|e| backend("cuCtxSynchronize", e))?;
                    self.sweep(&mut st)?;
                    let free = std::mem::take(&mut st.free);
                    for (c, list) in free {
                        for p in list {
                            // SAFETY: free blocks are fenced and unused.
                            let _ = unsafe { cu::free_sync(p) };
                            st.held -= c;
                        }
                    }
                    // SAFETY: as above.
                    let p = unsafe { cu::malloc_sync(class) }.map_err(|e| {
                        backend(
                            &format!(
                                "cannot allocate {class} bytes on GPU {} ({})",
                                self.device.ordinal, self.device.name
                            ),
                            e,
                        )
                    })?;
                    st.held += class;
                    p
                }
                Err(e) => {
                    return Err(backend(
                        &format!(
                            "cannot allocate {class} bytes on GPU {}",
                            self.device.ordinal
                        ),
                        e,
                    ))
                }
            },
        };
        drop(st);
        Ok(Arc::new(DevMem {
            ptr,
            bytes: class,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            memory: Arc::clone(self),
        }))
    }

    /// A zeroed allocation of `len` f32 elements (synchronous: the zeroing has executed
    /// when this returns, so any stream may use the buffer at once). The caller has the
    /// context bound.
    pub(super) fn alloc_zeroed(
        self: &Arc<Self>,
        rank: u32,
        len: usize,
    ) -> Result<CudaBuffer, OpsError> {
        let bytes = len.checked_mul(4).ok_or_else(|| {
            OpsError::Backend(format!("cannot allocate {len} f32 elements: too many"))
        })?;
        let mem = self.alloc_raw(bytes)?;
        if len > 0 {
            let host = self.device.host_stream();
            // SAFETY: the block holds at least `len` words and is unused.
            unsafe { sys::cuMemsetD32Async(mem.ptr(), 0, len, host) }
                .result()
                .map_err(|e| backend("cuMemsetD32Async", e))?;
            self.device.sync_host_stream("zeroing a new buffer")?;
        }
        Ok(CudaBuffer { mem, rank, len })
    }

    /// An allocation of `len` f32 elements with unspecified contents (asynchronous: no
    /// device work). The caller has the context bound.
    pub(super) fn alloc_uninit(
        self: &Arc<Self>,
        rank: u32,
        len: usize,
    ) -> Result<CudaBuffer, OpsError> {
        let bytes = len.checked_mul(4).ok_or_else(|| {
            OpsError::Backend(format!("cannot allocate {len} f32 elements: too many"))
        })?;
        let mem = self.alloc_raw(bytes)?;
        Ok(CudaBuffer { mem, rank, len })
    }

    /// Fences the retired blocks behind one event per stream.
    fn fence(&self, st: &mut State) -> Result<(), OpsError> {
        if st.retired.is_empty() {
            return Ok(());
        }
        let mut events = Vec::with_capacity(Stream::ALL.len());
        for stream in Stream::ALL {
            let ev = self.events.take_plain()?;
            // SAFETY: live handles of the bound context.
            if let Err(e) = unsafe { cu::event::record(ev, self.device.stream(stream)) } {
                self.events.put_plain(ev);
                events.into_iter().for_each(|e| self.events.put_plain(e));
                return Err(backend("cuEventRecord (memory fence)", e));
            }
            events.push(ev);
        }
        let blocks = std::mem::take(&mut st.retired);
        st.fenced.push_back((blocks, events));
        Ok(())
    }

    /// Moves fenced blocks whose fences completed to the free lists.
    fn sweep(&self, st: &mut State) -> Result<(), OpsError> {
        let mut done = Vec::new();
        let swept = sweep(st, &mut done, |ev| {
            // SAFETY: fence events are live until returned to the pool.
            match unsafe { cu::event::query(ev) } {
                Ok(()) => Ok(true),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                Err(e) => Err(backend("a memory fence", e)),
            }
        });
        // Completed events go back to the pool also when a later query failed.
        done.into_iter().for_each(|e| self.events.put_plain(e));
        swept
    }
}

/// Moves the oldest fenced blocks whose fences completed to the free lists, and puts
/// their fence events, once complete, in `done`. Stops at the first fence set not
/// complete: every later one has an event recorded after one of its events on the same
/// stream, so it is not complete either. So a sweep queries each completed event once
/// and one pending event, however far the device is behind the host (querying every
/// fence set made each allocation cost microseconds per set in flight).
fn sweep(
    st: &mut State,
    done: &mut Vec<sys::CUevent>,
    mut complete: impl FnMut(sys::CUevent) -> Result<bool, OpsError>,
) -> Result<(), OpsError> {
    while let Some((_, events)) = st.fenced.front_mut() {
        // Drop the events known complete, so a set is never queried twice for them.
        while let Some(&ev) = events.last() {
            if !complete(ev)? {
                return Ok(());
            }
            done.push(ev);
            events.pop();
        }
        if let Some((blocks, _)) = st.fenced.pop_front() {
            for (p, c) in blocks {
                st.free.entry(c).or_default().push(p);
            }
        }
    }
    Ok(())
}

impl Drop for Memory {
    /// Every handle is gone: synchronise the device and give all memory back.
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        let _ = cu::ctx::synchronize();
        let st = std::mem::take(&mut *lock(&self.state));
        let blocks = st
            .retired
            .into_iter()
            .map(|(p, _)| p)
            .chain(st.fenced.into_iter().flat_map(|(blocks, events)| {
                events.into_iter().for_each(|e| self.events.put_plain(e));
                blocks.into_iter().map(|(p, _)| p)
            }))
            .chain(st.free.into_values().flatten());
        for p in blocks {
            // SAFETY: the device is idle and nothing refers to the block any more.
            let _ = unsafe { cu::free_sync(p) };
        }
    }
}

/// Buffers of `lens` elements on `rank` for tests of the host-side logic that runs
/// without a GPU: each at a distinct stand-in address (unique in the process), never
/// handed to the driver. Their allocator is leaked, so nothing behind them ever calls
/// the driver when dropped.
#[cfg(test)]
pub(super) fn stand_in_buffers(rank: u32, lens: &[usize]) -> Vec<CudaBuffer> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let device = Arc::new(Device::stand_in());
    let memory = Memory::new(Arc::clone(&device), EventPool::new(device));
    std::mem::forget(Arc::clone(&memory));
    lens.iter()
        .map(|&len| {
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            CudaBuffer {
                mem: Arc::new(DevMem {
                    ptr: (1 << 44) + (id << 24),
                    bytes: (len * 4).div_ceil(GRANULE) * GRANULE,
                    id,
                    memory: Arc::clone(&memory),
                }),
                rank,
                len,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in event handle (never passed to the driver).
    fn ev(i: usize) -> sys::CUevent {
        i as sys::CUevent
    }

    #[test]
    fn a_sweep_frees_completed_fences_oldest_first_and_stops_at_the_first_pending() {
        let mut st = State::default();
        // Four fence sets of five events (one per stream): set k holds 10k+1 ..= 10k+5
        // and one block of 512 bytes at 0x1000·(k+1).
        for k in 0..4usize {
            st.fenced.push_back((
                vec![(0x1000 * (k as u64 + 1), 512)],
                (1..=5).map(|s| ev(10 * k + s)).collect(),
            ));
        }
        // Sets 0 and 1 are complete; in set 2 the event 23 is not yet.
        let mut pending = vec![23usize, 31, 32, 33, 34, 35];
        let mut queried = Vec::new();
        let query = |e: sys::CUevent, pending: &[usize], queried: &mut Vec<usize>| {
            queried.push(e as usize);
            Ok(!pending.contains(&(e as usize)))
        };
        let mut done = Vec::new();
        sweep(&mut st, &mut done, |e| query(e, &pending, &mut queried)).unwrap();
        assert_eq!(
            done.iter().map(|&e| e as usize).collect::<Vec<_>>(),
            vec![5, 4, 3, 2, 1, 15, 14, 13, 12, 11, 25, 24]
        );
        // Set 3 was not queried: set 2 was pending before it.
        assert_eq!(queried.last(), Some(&23));
        assert!(queried.iter().all(|&e| e < 30));
        assert_eq!(st.free[&512], vec![0x1000, 0x2000]);
        assert_eq!(st.fenced.len(), 2);
        // Once 23 completes, set 2 frees without querying 24 and 25 again; set 3 waits.
        pending.retain(|&e| e != 23);
        queried.clear();
        let mut done = Vec::new();
        sweep(&mut st, &mut done, |e| query(e, &pending, &mut queried)).unwrap();
        assert_eq!(
            done.iter().map(|&e| e as usize).collect::<Vec<_>>(),
            vec![23, 22, 21]
        );
        assert_eq!(queried, vec![23, 22, 21, 35]);
        assert_eq!(st.free[&512], vec![0x1000, 0x2000, 0x3000]);
        assert_eq!(st.fenced.len(), 1);
        // A failed query is an error; the events found complete before it are handed
        // back (not lost), and the set stays.
        let mut done = Vec::new();
        let failed = sweep(&mut st, &mut done, |e| {
            if e as usize == 33 {
                Err(OpsError::Backend("lost".into()))
            } else {
                Ok(true)
            }
        });
        assert!(failed.is_err());
        assert_eq!(
            done.iter().map(|&e| e as usize).collect::<Vec<_>>(),
            vec![35, 34]
        );
        assert_eq!(st.fenced.len(), 1);
    }
}
