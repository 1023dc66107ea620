//! Seeded synthetic data: the gradients `overlap run` and `overlap verify` feed in, and
//! initial parameter values. Every value is a pure function of its coordinates, so any
//! rank, backend or reference computes the same numbers without communicating.

/// SplitMix64: a small, well-mixed 64-bit generator.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fill(key: u64, scale: f32, out: &mut [f32]) {
    let base = mix(key);
    for (i, x) in out.iter_mut().enumerate() {
        let bits = mix(base ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        // 24 random bits -> [-1, 1)
        let u = (bits >> 40) as f32 / (1u64 << 24) as f32;
        *x = (2.0 * u - 1.0) * scale;
    }
}

fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5EED_u64, |acc, &p| mix(acc ^ p))
}

/// The gradient rank `rank` produces for parameter `param` in micro-batch `micro_batch`
/// of step `step` (0-based), uniform in [-1, 1).
pub fn grad(seed: u64, step: u64, micro_batch: u32, rank: u32, param: u32, out: &mut [f32]) {
    fill(
        key(&[
            seed,
            1,
            step,
            u64::from(micro_batch),
            u64::from(rank),
            u64::from(param),
        ]),
        1.0,
        out,
    );
}

/// Initial values of a parameter's full tensor, uniform in [-0.1, 0.1).
pub fn init(seed: u64, param: u32, numel: usize) -> Vec<f32> {
    let mut v = vec![0.0; numel];
    fill(key(&[seed, 2, u64::from(param)]), 0.1, &mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradients_are_reproducible_and_distinct() {
        let (mut a, mut b, mut c) = (vec![0.0; 16], vec![0.0; 16], vec![0.0; 16]);
        grad(1, 0, 0, 0, 0, &mut a);
        grad(1, 0, 0, 0, 0, &mut b);
        grad(1, 0, 0, 1, 0, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
    }
}
