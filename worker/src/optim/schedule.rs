//! Learning-rate schedules as pure functions of the optimizer step (never the
//! micro-step). `lr_at(s)` is the rate used by optimizer step `s` (0-based).

use crate::spec::{JobSpec, ScheduleKind};

#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    Constant,
    /// Cosine annealing from the base rate to `min_lr` over the post-warm-up steps.
    Cosine {
        min_lr: f64,
    },
    /// Multiply by `gamma` every `step_size` post-warm-up steps.
    Step {
        step_size: u64,
        gamma: f64,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub kind: Kind,
}

impl Schedule {
    pub fn from_spec(spec: &JobSpec, total_steps: u64) -> Self {
        let s = &spec.schedule;
        let kind = match s.kind {
            ScheduleKind::Cosine => Kind::Cosine {
                min_lr: s.min_lr.unwrap_or(0.0),
            },
            ScheduleKind::Step => Kind::Step {
                step_size: s.step_size.unwrap_or(1).max(1),
                gamma: s.gamma.unwrap_or(0.1),
            },
            // Warm-up applies to every kind; linear_warmup is only warm-up.
            ScheduleKind::Constant | ScheduleKind::LinearWarmup => Kind::Constant,
        };
        Self {
            base_lr: spec.optimizer.lr,
            warmup_steps: s.warmup_steps,
            total_steps,
            kind,
        }
    }

    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            // Linear warm-up: lr * (s + 1) / warmup_steps, reaching lr at the end.
            return self.base_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let t = step - self.warmup_steps;
        match self.kind {
            Kind::Constant => self.base_lr,
            Kind::Cosine { min_lr } => {
                let span = self.total_steps.saturating_sub(self.warmup_steps);
                if span == 0 {
                    return self.base_lr;
                }
                let progress = (t.min(span)) as f64 / span as f64;
                min_lr
                    + (self.base_lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
                        / 2.0
            }
            Kind::Step { step_size, gamma } => self.base_lr * gamma.powi((t / step_size) as i32),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sched(kind: Kind, warmup: u64) -> Schedule {
        Schedule {
            base_lr: 0.5,
            warmup_steps: warmup,
            total_steps: 100,
            kind,
        }
    }

    #[test]
    fn cosine_with_warmup() {
        let s = sched(Kind::Cosine { min_lr: 0.0 }, 10);
        assert!((s.lr_at(0) - 0.05).abs() < 1e-12);
        assert!((s.lr_at(9) - 0.5).abs() < 1e-12);
        assert!((s.lr_at(10) - 0.5).abs() < 1e-12);
        assert!((s.lr_at(55) - 0.25).abs() < 1e-12);
        assert!(s.lr_at(100).abs() < 1e-12);
    }

    #[test]
    fn step_decay() {
        let s = sched(
            Kind::Step {
                step_size: 30,
                gamma: 0.1,
            },
            0,
        );
        assert_eq!(s.lr_at(29), 0.5);
        assert!((s.lr_at(30) - 0.05).abs() < 1e-12);
        assert!((s.lr_at(60) - 0.005).abs() < 1e-12);
    }

    proptest! {
        #[test]
        fn lr_is_positive_and_bounded(step in 0u64..1000, warmup in 0u64..50) {
            for kind in [Kind::Constant, Kind::Cosine { min_lr: 0.01 }, Kind::Step { step_size: 7, gamma: 0.5 }] {
                let lr = sched(kind, warmup).lr_at(step);
                prop_assert!(lr > 0.0 && lr <= 0.5 + 1e-12);
            }
        }
    }
}
