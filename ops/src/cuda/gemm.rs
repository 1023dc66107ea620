//! [`Kernel::Gemm`]: the synthetic backward of `overlap bench`, bf16 GEMMs through
//! cuBLAS on operands the backend fills once.
//!
//! Invariant: the operands are read only and the product lands in the stream's
//! scratch, so no plan buffer is touched.

use cudarc::driver::sys;
use overlap_graph::Stream;

use super::backend::Shared;
use super::device;
use super::issue::Issue;
#[cfg(doc)]
use crate::Kernel;
use crate::OpsError;

impl Issue {
    /// `count` bf16 GEMMs `C = A·B` on `stream` (the synthetic backward of `overlap
    /// bench`): `A` and `B` are operands the backend fills once with pseudo-random bf16
    /// (as `torch.randn` operands, so the tensor cores do representative work), `C` is
    /// the stream's scratch.
    pub(super) fn gemm(
        &mut self,
        shared: &Shared,
        stream: Stream,
        (m, n, k): (u32, u32, u32),
        count: u32,
    ) -> Result<(), OpsError> {
        const K: &str = "gemm";
        let dims = |x: u32| {
            i32::try_from(x).map_err(|_| OpsError::Shape {
                kernel: K,
                reason: format!("dimension {x} exceeds cuBLAS's int"),
            })
        };
        let (mi, ni, ki) = (dims(m)?, dims(n)?, dims(k)?);
        if m == 0 || n == 0 || k == 0 || count == 0 {
            return Ok(());
        }
        let (m, n, k) = (m as usize, n as usize, k as usize);
        let a_bytes = (m * k * 2).next_multiple_of(256);
        let b_bytes = k * n * 2;
        let have = self
            .gemm
            .as_ref()
            .filter(|(d, _)| *d == (m as u32, n as u32, k as u32));
        let operands = match have {
            Some((_, mem)) => mem.ptr(),
            None => {
                let mem = shared.memory.alloc_raw(a_bytes + b_bytes)?;
                // Pseudo-random bf16 in [-1, 1) (xorshift, truncated f32 bits).
                let mut s = 0x9e37_79b9_7f4a_7c15u64;
                let words: Vec<u16> = (0..(a_bytes + b_bytes) / 2)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        let x = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                        (x.to_bits() >> 16) as u16
                    })
                    .collect();
                let device = &shared.device;
                // SAFETY: `mem` holds `words` bytes and nothing uses it yet; the host
                // stream is synchronised before `words` is released.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        mem.ptr(),
                        words.as_ptr().cast(),
                        words.len() * 2,
                        device.host_stream(),
                    )
                }
                .result()
                .map_err(|e| device::failed(K, e))?;
                device.sync_host_stream("gemm operands")?;
                let ptr = mem.ptr();
                self.gemm = Some(((m as u32, n as u32, k as u32), mem));
                ptr
            }
        };
        let c = self.scratch(shared, stream, m * n * 2)?;
        let blas = &self.blas[stream.index()];
        for _ in 0..count {
            blas.gemm_bf16((mi, ni, ki), operands, operands + a_bytes as u64, c)?;
        }
        Ok(())
    }
}
