//! Deterministic random numbers that match PyTorch's CPU generator.
//!
//! `torch.Generator().manual_seed(s)` is a 32-bit Mersenne Twister (mt19937)
//! seeded with the low 32 bits of `s`, and `torch.randperm(n, generator=g)` on
//! CPU is the swap loop in [`randperm`]. Reproducing both in Rust keeps the
//! data order identical to `torch.utils.data.DistributedSampler` without
//! touching libtorch's process-global generator (tests run engines on many
//! threads at once).

/// The 32-bit Mersenne Twister, as `at::mt19937`.
#[derive(Clone, Debug)]
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    /// Seeds the generator as `torch.Generator().manual_seed(seed)` does.
    pub fn new(seed: u64) -> Self {
        let mut state = [0u32; 624];
        state[0] = (seed & 0xffff_ffff) as u32;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Self { state, index: 624 }
    }

    fn twist(&mut self) {
        for i in 0..624 {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
            let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= 0x9908_b0df;
            }
            self.state[i] = next;
        }
        self.index = 0;
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    /// A uniform float in [0, 1) with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 24) as f32
    }

    /// A standard normal sample (Box-Muller).
    pub fn next_normal(&mut self) -> f32 {
        let u1 = (self.next_f32() as f64).max(1e-12);
        let u2 = self.next_f32() as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on CPU.
pub fn randperm(n: usize, seed: u64) -> Vec<usize> {
    let mut gen = Mt19937::new(seed);
    let mut perm: Vec<usize> = (0..n).collect();
    // PyTorch's randperm_cpu: for n below u32::MAX / 20 it swaps each slot
    // with `random() % (n - i)` positions ahead.
    for i in 0..n.saturating_sub(1) {
        let z = (gen.next_u32() as usize) % (n - i);
        perm.swap(i, i + z);
    }
    perm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_the_reference_sequence() {
        // The C++ standard requires the 10000th output of a default-seeded
        // (5489) std::mt19937 to be 4123659995.
        let mut g = Mt19937::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = g.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn randperm_is_a_permutation() {
        for n in [0usize, 1, 2, 7, 100] {
            let mut p = randperm(n, 3);
            p.sort_unstable();
            assert_eq!(p, (0..n).collect::<Vec<_>>());
        }
    }
}
