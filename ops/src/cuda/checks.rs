//! Argument checks on the host, before anything is issued: each kernel's buffers
//! against its contract (as the CPU backend checks them), so that a bad launch is an
//! error naming what does not fit, never a device fault.
//!
//! Invariant: a check reads the buffers' rank, length and identity only; it issues
//! nothing.

use overlap_graph::{Collective, CopySeg, Stream};

use super::memory::CudaBuffer;
use super::muon;
#[cfg(doc)]
use crate::Kernel;
use crate::{CollectiveRoles, CommId, OpsError};

/// Checks one member's call against the communicator and the buffers its role needs.
pub(super) fn check_collective(
    rank: u32,
    stream: Stream,
    id: CommId,
    desc: &Collective,
    roles: &CollectiveRoles,
    send: &Option<CudaBuffer>,
    recv: &Option<CudaBuffer>,
) -> Result<(), String> {
    if desc.group != id.group || stream != id.stream {
        return Err(format!(
            "a collective on {} issued from the {stream} stream cannot use communicator {id}",
            desc.group
        ));
    }
    for (what, buf, want) in [("send", send, roles.send), ("recv", recv, roles.recv)] {
        match (buf, want) {
            (None, None) => {}
            (Some(b), Some(len)) if b.rank == rank && b.len == len => {}
            (Some(b), Some(len)) => {
                return Err(format!(
                    "{what} must be a buffer of {len} elements on rank {rank}, got {b:?}"
                ))
            }
            (None, Some(len)) => {
                return Err(format!(
                    "rank {rank} needs a {what} buffer of {len} elements"
                ))
            }
            (Some(b), None) => {
                return Err(format!("rank {rank} takes no {what} buffer, got {b:?}"))
            }
        }
    }
    Ok(())
}

/// Checks a [`Kernel::Combine`] (as the CPU backend does); returns the length of the
/// member's chunk and where in `dst` the combine writes it.
pub(super) fn check_combine(
    rank: u32,
    desc: &Collective,
    (size, index): (u32, u32),
    (own, own_offset): (&CudaBuffer, usize),
    (recv, recv_len): (&CudaBuffer, Option<usize>),
    dst: &CudaBuffer,
) -> Result<(usize, usize), OpsError> {
    const K: &str = "combine";
    let shape = |reason: String| OpsError::Shape { kernel: K, reason };
    for (what, buf) in [("own", own), ("recv", recv), ("dst", dst)] {
        expect(K, rank, what, buf, buf.len)?;
    }
    // `None`: the pieces were read in place and `recv` is only a key; check the rest
    // against the length a receive buffer would have.
    let recv_len = match recv_len {
        Some(len) => len,
        None => crate::exchange_roles(desc, size, index)
            .ok()
            .and_then(|r| r.recv)
            .unwrap_or(0),
    };
    let (c, at) = crate::combine_lengths(
        desc,
        (size, index),
        (own.len, own_offset),
        recv_len,
        dst.len,
    )
    .map_err(shape)?;
    if dst.same(own) && own_offset != at {
        return Err(shape(format!(
            "dst is own at own_offset {own_offset}: an in-place combine must write the chunk it reads (at {at})"
        )));
    }
    Ok((c, at))
}

/// Validates a [`Kernel::Adamw`] (`guard`: the norm of [`Kernel::IfFinite`], checked by
/// the caller).
pub(super) fn check_adamw(
    rank: u32,
    (param, grad, state): (&CudaBuffer, &CudaBuffer, &CudaBuffer),
    step: u64,
    guard: Option<&CudaBuffer>,
) -> Result<(), OpsError> {
    const K: &str = "adamw";
    let n = param.len;
    expect(K, rank, "param", param, n)?;
    expect(K, rank, "grad", grad, n)?;
    expect(K, rank, "state (m then v)", state, 2 * n)?;
    distinct(K, &[param, grad, state])?;
    guarded(K, guard, &[param, state])?;
    if step == 0 {
        return Err(OpsError::Shape {
            kernel: K,
            reason: "step is 1-based, got 0".into(),
        });
    }
    Ok(())
}

/// Validates a [`Kernel::Muon`] (`guard` as for [`check_adamw`]), including that its
/// batch's scratch can be laid out.
pub(super) fn check_muon(
    rank: u32,
    (param, grad, momentum): (&CudaBuffer, &CudaBuffer, &CudaBuffer),
    (rows, cols): (usize, usize),
    guard: Option<&CudaBuffer>,
) -> Result<(), OpsError> {
    const K: &str = "muon";
    let too_big = || OpsError::Shape {
        kernel: K,
        reason: format!("a {rows} × {cols} matrix has more elements than fit in memory"),
    };
    let n = rows.checked_mul(cols).ok_or_else(too_big)?;
    expect(K, rank, "param (rows × cols)", param, n)?;
    expect(K, rank, "grad (rows × cols)", grad, n)?;
    expect(K, rank, "momentum (rows × cols)", momentum, n)?;
    distinct(K, &[param, grad, momentum])?;
    guarded(K, guard, &[param, momentum])?;
    if n > 0 && !muon_fits((rows, cols)) {
        return Err(too_big());
    }
    Ok(())
}

/// Whether the scratch of a Muon batch of one `rows × cols` matrix can be laid out
/// (what [`check_muon`] requires of a non-empty matrix).
pub(super) fn muon_fits(shape: (usize, usize)) -> bool {
    muon::ClassLayout::new(&[(shape, 1)], crate::NsDtype::F32).is_some()
}

/// Checks that `buf` lives on `rank` and holds `len` elements.
pub(super) fn expect(
    kernel: &'static str,
    rank: u32,
    what: &str,
    buf: &CudaBuffer,
    len: usize,
) -> Result<(), OpsError> {
    if buf.rank == rank && buf.len == len {
        Ok(())
    } else {
        Err(OpsError::Shape {
            kernel,
            reason: format!(
                "{what} must be a buffer of {len} elements on rank {rank}, got {buf:?}"
            ),
        })
    }
}

/// Checks that the buffers are pairwise distinct.
pub(super) fn distinct(kernel: &'static str, bufs: &[&CudaBuffer]) -> Result<(), OpsError> {
    for (i, a) in bufs.iter().enumerate() {
        if bufs[i + 1..].iter().any(|b| a.same(b)) {
            return Err(OpsError::Shape {
                kernel,
                reason: format!("its buffers must be distinct, got {bufs:?}"),
            });
        }
    }
    Ok(())
}

/// Checks that an optimizer's guard (the norm of [`Kernel::IfFinite`]), if any, is none
/// of the buffers it writes: the kernels read it while they update those.
pub(super) fn guarded(
    kernel: &'static str,
    guard: Option<&CudaBuffer>,
    written: &[&CudaBuffer],
) -> Result<(), OpsError> {
    match guard {
        Some(g) if written.iter().any(|b| b.same(g)) => Err(OpsError::Shape {
            kernel,
            reason: format!("the norm guarding the step is also a buffer it updates: {g:?}"),
        }),
        _ => Ok(()),
    }
}

/// Validates one copy `from[src..src+len] → to[dst..dst+len]`.
pub(super) fn segment(
    kernel: &'static str,
    rank: u32,
    seg: &CopySeg,
    from: &CudaBuffer,
    to: &CudaBuffer,
) -> Result<(), OpsError> {
    let shape = |reason: String| OpsError::Shape { kernel, reason };
    for buf in [from, to] {
        expect(kernel, rank, "a segment's buffer", buf, buf.len)?;
    }
    if from.same(to) {
        return Err(shape(format!(
            "{from:?} is both a source and the destination"
        )));
    }
    for (what, off, buf) in [("source", seg.src, from), ("destination", seg.dst, to)] {
        match off.checked_add(seg.len) {
            Some(end) if end <= buf.len as u64 => {}
            _ => {
                return Err(shape(format!(
                    "segment of param {} ({what} offset {off}, {} elements) exceeds {buf:?}",
                    seg.param, seg.len
                )))
            }
        }
    }
    Ok(())
}
