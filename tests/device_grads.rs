//! Gradients handed in where the trainer's backward left them, and gathered parameters
//! left on the device (`Session::grad_ready_device`, `forward_ready_device`,
//! `backward_ready_device`): the same steps as the host path bit for bit, the
//! trainer's buffers only read, its events waited on, and misuse refused by name.
//! On the CPU backend the "device" is host memory behind the backend's buffers; the
//! calls are the ones a CUDA trainer makes.

mod common;

use std::sync::Arc;

use overlap::graph::{ForwardSpec, Stream, Transport};
use overlap::ops::cpu::CpuBackend;
use overlap::ops::Backend;
use overlap::{Error, ExecConfig, Gate, PlanSpec, Session};

const MESHES: [(u32, u32); 5] = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)];
const GATES: [Gate; 3] = [Gate::NoSync, Gate::ReplicateOff, Gate::On];

type Buf = <CpuBackend as Backend>::Buffer;
type Event = <CpuBackend as Backend>::Event;

fn session(spec: PlanSpec) -> Session<CpuBackend> {
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    Session::new(spec, backend, ExecConfig::default()).unwrap()
}

fn grad(rank: u32, param: u32, i: usize, m: usize, step: u32) -> f32 {
    ((rank * 7 + param * 13 + i as u32 * 5 + m as u32 * 3 + step * 11) % 17) as f32 * 0.23 - 1.7
}

fn values(rank: u32, param: u32, numel: usize, m: usize, step: u32) -> Vec<f32> {
    (0..numel).map(|i| grad(rank, param, i, m, step)).collect()
}

/// The trainer's "own stream" work: an event per local rank recorded on a stream the
/// plan's points do not stand on.
fn trainer_events(s: &Session<CpuBackend>) -> Vec<(u32, Event)> {
    let b = s.backend();
    s.local_ranks()
        .into_iter()
        .map(|r| {
            let ev = b.event(r);
            b.record(r, Stream::Publish, &ev);
            (r, ev)
        })
        .collect()
}

/// One step through the host path.
async fn host_step(s: &mut Session<CpuBackend>, step: u32) {
    let forward = s.has_forward();
    for (m, &gate) in GATES.iter().enumerate() {
        s.begin_micro_batch(gate).await.unwrap();
        if forward {
            for layer in s.forward_layers() {
                s.forward_ready(layer, |_, _, _| {}).await.unwrap();
            }
        }
        for layer in s.layers() {
            if forward {
                s.backward_ready(layer, |_, _, _| {}).await.unwrap();
            }
            s.grad_ready(layer, |rank, param, out| {
                out.copy_from_slice(&values(rank, param, out.len(), m, step))
            })
            .await
            .unwrap();
        }
    }
    s.step().await.unwrap();
}

/// The trainer's gradient buffers of one step, by (micro-batch, rank, param), written
/// "by its backward" (uploaded here) and kept until the step returned.
struct Grads(Vec<Handed>);

/// One gradient handed in: (micro-batch, rank, param), its buffer, and the values the
/// trainer wrote there.
type Handed = ((usize, u32, u32), Buf, Vec<f32>);

impl Grads {
    fn get(&self, m: usize, rank: u32, param: u32) -> Buf {
        self.0
            .iter()
            .find(|(k, _, _)| *k == (m, rank, param))
            .map(|(_, b, _)| b.clone())
            .expect("a buffer of the step")
    }
}

/// One step through the device path: gradients bound in place with the trainer's
/// events, gathered buffers read where they are. Returns the step's buffers.
async fn device_step(s: &mut Session<CpuBackend>, step: u32) -> Grads {
    let forward = s.has_forward();
    let backend = s.backend().clone();
    let mut grads = Grads(Vec::new());
    for (m, &gate) in GATES.iter().enumerate() {
        s.begin_micro_batch(gate).await.unwrap();
        for rank in s.local_ranks() {
            for (p, placed) in s.params().iter().enumerate() {
                let numel = placed.spec.numel() as usize;
                let buf = backend.alloc(rank, numel).unwrap();
                let v = values(rank, p as u32, numel, m, step);
                backend.upload(&buf, &v).unwrap();
                grads.0.push(((m, rank, p as u32), buf, v));
            }
        }
        if forward {
            for layer in s.forward_layers() {
                let after = trainer_events(s);
                let mut seen = 0;
                s.forward_ready_device(layer, &after, |_, _, _| seen += 1)
                    .await
                    .unwrap();
                assert!(seen > 0, "layer {layer} hands its parameters");
            }
        }
        for layer in s.layers() {
            if forward {
                let after = trainer_events(s);
                s.backward_ready_device(layer, &after, |_, _, _| {})
                    .await
                    .unwrap();
            }
            let after = trainer_events(s);
            s.grad_ready_device(layer, &after, |rank, param| grads.get(m, rank, param))
                .await
                .unwrap();
        }
    }
    s.step().await.unwrap();
    grads
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_gradients_give_the_host_paths_steps_bit_for_bit_and_stay_unchanged() {
    for (shard, replicate) in MESHES {
        for transport in [Transport::Nccl, Transport::Copy] {
            for forward in [None, Some(ForwardSpec::default())] {
                let spec = common::mixed_spec(shard, replicate)
                    .with_schedule(overlap::Schedule::default().with_transport(transport))
                    .with_forward(forward);
                let what = format!("{shard}x{replicate} {transport:?} forward {forward:?}");
                let (mut host, mut device) = (session(spec.clone()), session(spec));
                for step in 0..3 {
                    host_step(&mut host, step).await;
                    let grads = device_step(&mut device, step).await;
                    // The plan only read the trainer's buffers.
                    let backend = device.backend();
                    for ((m, rank, p), buf, v) in &grads.0 {
                        assert_eq!(
                            &backend.download(buf).unwrap(),
                            v,
                            "{what}: step {step} micro-batch {m} rank {rank} param {p} changed"
                        );
                    }
                }
                common::assert_same_bits(
                    &common::read_all(&host),
                    &common::read_all(&device),
                    &what,
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathered_device_buffers_hold_the_current_parameters() {
    for (shard, replicate) in MESHES {
        for reshard_after_forward in [true, false] {
            let spec = common::mixed_spec(shard, replicate).with_forward(Some(
                ForwardSpec::default()
                    .with_prefetch(1)
                    .with_reshard_after_forward(reshard_after_forward),
            ));
            let what = format!("{shard}x{replicate} reshard {reshard_after_forward}");
            let mut s = session(spec);
            // A step first, so the parameters are not their initial values.
            host_step(&mut s, 0).await;
            let backend = s.backend().clone();
            let full = |s: &Session<CpuBackend>, param: u32| -> Vec<f32> {
                // Every rank's piece put together: the owner's, or the shards in order.
                let placed = &s.params()[param as usize];
                let numel = placed.spec.numel() as usize;
                let mut out = Vec::new();
                for rank in 0..shard {
                    if let Some(v) = s.param_values(rank, param).unwrap() {
                        if v.len() == numel {
                            return v;
                        }
                        out.extend(v);
                    }
                }
                out.truncate(numel);
                out
            };
            s.begin_micro_batch(Gate::On).await.unwrap();
            for layer in s.forward_layers() {
                let mut got = Vec::new();
                s.forward_ready_device(layer, &[], |rank, param, buf| {
                    got.push((rank, param, backend.download(buf).unwrap()))
                })
                .await
                .unwrap();
                let local = s.local_ranks().len();
                let in_layer = s.params().iter().filter(|p| p.spec.layer == layer).count();
                assert_eq!(got.len(), local * in_layer, "{what}: layer {layer}");
                for (rank, param, v) in got {
                    let want = full(&s, param);
                    assert_eq!(
                        &v[..want.len()],
                        &want[..],
                        "{what}: rank {rank} param {param}"
                    );
                }
            }
            for layer in s.layers() {
                s.backward_ready_device(layer, &[], |_, _, _| {})
                    .await
                    .unwrap();
                s.grad_ready(layer, |_, _, out| out.fill(0.5))
                    .await
                    .unwrap();
            }
            s.step().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_of_the_device_path_is_refused_by_name() {
    let mut s = session(common::mixed_spec(2, 1));
    let backend = s.backend().clone();
    let top = s.layers()[0];

    // Before a micro-batch.
    let e = s
        .grad_ready_device(top, &[], |r, _| backend.alloc(r, 1).unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("before begin_micro_batch"), "{e}");

    s.begin_micro_batch(Gate::On).await.unwrap();
    // A layer out of order.
    let low = *s.layers().last().unwrap();
    let e = s
        .grad_ready_device(low, &[], |r, _| backend.alloc(r, 1).unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is next"), "{e}");

    // A buffer of the wrong length names the parameter and both lengths.
    let e = s
        .grad_ready_device(top, &[], |r, _| backend.alloc(r, 3).unwrap())
        .await
        .unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("has 3 elements") && m.contains("parameter"),
        "{m}"
    );
    assert!(matches!(e, Error::Exec(_) | Error::Usage(_)), "{e:?}");

    // An event for a rank this session does not drive.
    let stranger = CpuBackend::new(overlap::Mesh::new(4, 1).unwrap());
    let ev = stranger.event(3);
    let mut fresh = session(common::mixed_spec(2, 1));
    fresh.begin_micro_batch(Gate::On).await.unwrap();
    let numel = |s: &Session<CpuBackend>, p: u32| s.params()[p as usize].spec.numel();
    let sizes: Vec<u64> = (0..fresh.params().len() as u32)
        .map(|p| numel(&fresh, p))
        .collect();
    let b = fresh.backend().clone();
    let e = fresh
        .grad_ready_device(top, &[(3, ev)], |r, p| {
            b.alloc(r, sizes[p as usize] as usize).unwrap()
        })
        .await
        .unwrap_err();
    assert!(e.to_string().contains("rank 3"), "{e}");

    // The forward's device calls on a session without a forward.
    let e = fresh
        .forward_ready_device(0, &[], |_, _, _| {})
        .await
        .unwrap_err();
    assert!(e.to_string().contains("PlanSpec::with_forward"), "{e}");
}

/// `overlap run`'s `[run] grads = "device"`: `drive::device_step` hands in, every step,
/// the gradients `drive::synthetic_step` writes on the host for step 0, so the two agree
/// bit for bit step after step (with no_sync micro-batches, a forward, and several
/// ranks): the buffers are never written, or the later steps would differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_device_gradients_are_the_synthetic_step_zero_ones_every_step() {
    use overlap::drive;
    const SEED: u64 = 7;
    for (shard, replicate) in [(1, 1), (2, 2)] {
        for forward in [None, Some(ForwardSpec::default())] {
            let spec = common::mixed_spec(shard, replicate).with_forward(forward);
            let what = format!("{shard}x{replicate} forward {forward:?}");
            let (mut host, mut device) = (session(spec.clone()), session(spec));
            let grads = drive::DeviceGrads::new(&device, SEED, GATES.len()).unwrap();
            for step in 0..3 {
                drive::synthetic_step(&mut host, SEED, 0, &GATES)
                    .await
                    .unwrap();
                drive::device_step(&mut device, &grads, &GATES)
                    .await
                    .unwrap();
                common::assert_same_bits(
                    &common::read_all(&host),
                    &common::read_all(&device),
                    &format!("{what} step {step}"),
                );
            }
        }
    }
}
