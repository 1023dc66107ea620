//! The executor's in-place receive path, on the CPU backend. A backend whose
//! communicators receive in place (`Backend::receives_in_place`, the CUDA backend's
//! ring) gets a one-element `recv` for each copy-transport exchange: only a key naming
//! the exchange to its combine. The CPU backend never receives in place, so CI would not
//! run that branch of the executor; [`KeyedCpu`] says it does, checks every key has one
//! element, and swaps in a real receive buffer (remembered by the key until the combine)
//! so the CPU math still runs. A step must then give the same parameters and reduced
//! gradients as on the plain CPU backend, bit for bit; and where receives are not in
//! place, every exchange must still get its full receive buffer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

mod common;
use common::assert_same_bits;

use overlap::executor::ExecConfig;
use overlap::graph::{Collective, Schedule, Stream, Transport};
use overlap::ops::cpu::{CpuBackend, CpuBuffer, CpuEvent};
use overlap::ops::{
    exchange_roles, Backend, BoxFuture, CommId, EventStatus, Kernel, OpsError, Tag, Timing,
};
use overlap::{Gate, Mesh, PlanSpec, Session};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What [`KeyedCpu`] saw.
#[derive(Default)]
struct Seen {
    /// Exchanges launched with a receive buffer.
    exchanges: usize,
    /// Of those, exchanges whose full receive buffer has more than one element (where a
    /// key of one element is a change the test can see).
    shrinkable: usize,
    /// Broken expectations, in words.
    violations: Vec<String>,
    /// Real receive buffers by the id of the key their exchange was launched with,
    /// until their combine.
    real: HashMap<u64, CpuBuffer>,
}

/// The CPU backend, claiming (`in_place`) or not that every communicator receives in
/// place, and checking the receive buffers the executor passes accordingly.
struct KeyedCpu {
    inner: CpuBackend,
    mesh: Mesh,
    in_place: bool,
    seen: Mutex<Seen>,
}

impl KeyedCpu {
    /// Every communicator receives in place.
    fn new(mesh: Mesh) -> KeyedCpu {
        KeyedCpu::with(mesh, true)
    }

    /// No communicator receives in place (as the plain CPU backend), still checked.
    fn not_in_place(mesh: Mesh) -> KeyedCpu {
        KeyedCpu::with(mesh, false)
    }

    fn with(mesh: Mesh, in_place: bool) -> KeyedCpu {
        KeyedCpu {
            inner: CpuBackend::new(mesh),
            mesh,
            in_place,
            seen: Mutex::new(Seen::default()),
        }
    }

    /// The receive buffer an exchange of `desc` on `rank` really needs, after checking
    /// the one it was given (`recv`): a key of one element when receives are in place,
    /// the full buffer otherwise.
    fn receive(&self, rank: u32, desc: &Collective, recv: CpuBuffer) -> CpuBuffer {
        let mut seen = lock(&self.seen);
        seen.exchanges += 1;
        let size = self.mesh.group_size(desc.group);
        let Some(index) = self.mesh.index_in(desc.group, rank) else {
            seen.violations
                .push(format!("rank {rank} is not in {}", desc.group));
            return recv;
        };
        let full = match exchange_roles(desc, size, index) {
            Ok(roles) => roles.recv,
            Err(e) => {
                seen.violations.push(format!("exchange_roles: {e}"));
                return recv;
            }
        };
        let Some(full) = full else {
            seen.violations
                .push(format!("rank {rank} receives nothing but got {recv:?}"));
            return recv;
        };
        seen.shrinkable += usize::from(full > 1);
        let got = self.inner.len(&recv);
        let want = if self.in_place { 1 } else { full };
        if got != want {
            seen.violations.push(format!(
                "rank {rank}, {desc:?}: recv {recv:?} has {got} elements, want {want}"
            ));
        }
        if !self.in_place {
            return recv;
        }
        let real = match self.inner.alloc_uninit(rank, full) {
            Ok(real) => real,
            Err(e) => {
                seen.violations.push(format!("alloc: {e}"));
                return recv;
            }
        };
        if seen.real.insert(recv.id(), real.clone()).is_some() {
            seen.violations
                .push(format!("key {recv:?} reused before its combine"));
        }
        real
    }

    /// The real receive buffer remembered for `key` (consumed), or `key` itself (the
    /// inner backend then reports the shape error).
    fn take(&self, key: CpuBuffer) -> CpuBuffer {
        let mut seen = lock(&self.seen);
        match seen.real.remove(&key.id()) {
            Some(real) => real,
            None => {
                seen.violations
                    .push(format!("combine with the unknown key {key:?}"));
                key
            }
        }
    }
}

impl Backend for KeyedCpu {
    type Buffer = CpuBuffer;
    type Event = CpuEvent;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn local_ranks(&self) -> Vec<u32> {
        self.inner.local_ranks()
    }
    fn alloc(&self, rank: u32, len: usize) -> Result<CpuBuffer, OpsError> {
        self.inner.alloc(rank, len)
    }
    fn alloc_uninit(&self, rank: u32, len: usize) -> Result<CpuBuffer, OpsError> {
        self.inner.alloc_uninit(rank, len)
    }
    fn len(&self, buf: &CpuBuffer) -> usize {
        self.inner.len(buf)
    }
    fn upload(&self, buf: &CpuBuffer, data: &[f32]) -> Result<(), OpsError> {
        self.inner.upload(buf, data)
    }
    fn download(&self, buf: &CpuBuffer) -> Result<Vec<f32>, OpsError> {
        self.inner.download(buf)
    }
    fn event(&self, rank: u32) -> CpuEvent {
        self.inner.event(rank)
    }
    fn launch(&self, rank: u32, stream: Stream, tag: Tag, kernel: Kernel<CpuBuffer>) {
        let kernel = match kernel {
            Kernel::Exchange {
                desc,
                comm,
                send,
                recv: Some(key),
            } => Kernel::Exchange {
                recv: Some(self.receive(rank, &desc, key)),
                desc,
                comm,
                send,
            },
            Kernel::Combine {
                desc,
                size,
                index,
                own,
                own_offset,
                recv,
                dst,
            } if self.in_place => Kernel::Combine {
                desc,
                size,
                index,
                own,
                own_offset,
                recv: self.take(recv),
                dst,
            },
            other => other,
        };
        self.inner.launch(rank, stream, tag, kernel);
    }
    fn record(&self, rank: u32, stream: Stream, event: &CpuEvent) {
        self.inner.record(rank, stream, event);
    }
    fn wait(&self, rank: u32, stream: Stream, event: &CpuEvent) {
        self.inner.wait(rank, stream, event);
    }
    fn status(&self, event: &CpuEvent) -> EventStatus {
        self.inner.status(event)
    }
    fn host_wait(&self, event: &CpuEvent) -> BoxFuture<Result<(), OpsError>> {
        self.inner.host_wait(event)
    }
    fn errors(&self) -> Vec<(u32, Stream, Tag, OpsError)> {
        self.inner.errors()
    }
    fn reset(&self) {
        self.inner.reset();
    }
    fn take_timings(&self) -> Vec<Timing> {
        self.inner.take_timings()
    }
    fn set_timings(&self, on: bool) {
        self.inner.set_timings(on);
    }
    fn receives_in_place(&self, _comm: CommId) -> bool {
        self.in_place
    }
}

/// [`common::mixed_spec`] on the copy transport, the combine `lag` layers behind,
/// `after` the exchanges issued before it or not.
fn spec(shard: u32, replicate: u32, (lag, after): (u32, bool)) -> PlanSpec {
    common::mixed_spec(shard, replicate).with_schedule(
        Schedule::default()
            .with_transport(Transport::Copy)
            .with_combine_lag(lag)
            .with_combine_after_exchanges(after),
    )
}

const STEPS: u32 = 4;

/// Runs [`STEPS`] steps of `gates`, calling `after_step` after each, and returns every
/// parameter and reduced gradient of every rank.
async fn run<B: Backend>(
    spec: PlanSpec,
    backend: Arc<B>,
    gates: &[Gate],
    after_step: impl Fn(&B),
) -> Vec<Option<Vec<f32>>> {
    let mut s =
        Session::new(spec, Arc::clone(&backend), ExecConfig::default()).expect("a valid session");
    common::run_steps(&mut s, gates, STEPS, |_, _| after_step(&backend)).await;
    common::read_all(&s)
}

const GATES: [&[Gate]; 3] = [
    &[Gate::On],
    &[Gate::NoSync, Gate::On],
    &[Gate::ReplicateOff, Gate::On],
];

/// For every mesh, gate pattern and combine lag: runs a [`KeyedCpu`] made by `make`
/// against the plain CPU backend and checks what it saw.
async fn check_against_cpu(make: fn(Mesh) -> KeyedCpu) {
    for (shard, replicate) in [(2, 1), (1, 2), (2, 2)] {
        for gates in GATES {
            for lag in [(0, false), (1, false), (1, true)] {
                let mesh = Mesh::new(shard, replicate).expect("a valid mesh");
                let cpu = run(
                    spec(shard, replicate, lag),
                    Arc::new(CpuBackend::new(mesh)),
                    gates,
                    |_| (),
                )
                .await;
                let keyed = Arc::new(make(mesh));
                let what = format!(
                    "mesh {shard}x{replicate}, gates {gates:?}, (lag, after exchanges) {lag:?}, in place {}",
                    keyed.in_place
                );
                let got = run(
                    spec(shard, replicate, lag),
                    Arc::clone(&keyed),
                    gates,
                    |b| {
                        let left = lock(&b.seen).real.len();
                        assert_eq!(left, 0, "{what}: keys without a combine after a step");
                    },
                )
                .await;
                assert_same_bits(&cpu, &got, &what);
                let seen = lock(&keyed.seen);
                assert!(
                    seen.violations.is_empty(),
                    "{what}: {} violations, the first: {:#?}",
                    seen.violations.len(),
                    &seen.violations[..seen.violations.len().min(4)]
                );
                assert!(seen.exchanges > 0, "{what}: no exchange had a recv");
                assert!(
                    seen.shrinkable > 0,
                    "{what}: every full receive buffer has one element"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_receives_get_one_element_keys_and_change_no_bit() {
    check_against_cpu(KeyedCpu::new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receives_not_in_place_get_full_buffers() {
    check_against_cpu(KeyedCpu::not_in_place).await;
}
