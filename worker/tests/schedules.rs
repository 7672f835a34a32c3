//! Learning-rate schedules against torch.optim.lr_scheduler: the rate the
//! engine reports for every optimizer step of a real run.

mod common;

use common::*;
use tempfile::TempDir;

/// One schedule: the `[schedule]` table and how training ends.
struct Case {
    kind: &'static str,
    warmup: u64,
    step_size: Option<u64>,
    gamma: Option<f64>,
    min_lr: Option<f64>,
    /// `max_steps`, or None for `epochs = 3` over 40 samples in windows of
    /// 8 (5 steps per epoch, total 15).
    max_steps: Option<u64>,
}

const fn case(kind: &'static str, warmup: u64, max_steps: Option<u64>) -> Case {
    Case {
        kind,
        warmup,
        step_size: None,
        gamma: None,
        min_lr: None,
        max_steps,
    }
}

const LR: f64 = 0.1;

/// Runs the engine with `c` and returns the LR of every committed step.
fn engine_lrs(c: &Case) -> Vec<f64> {
    let mut table = format!(
        "[schedule]\nkind = \"{}\"\nwarmup_steps = {}\n",
        c.kind, c.warmup
    );
    if let Some(s) = c.step_size {
        table += &format!("step_size = {s}\n");
    }
    if let Some(g) = c.gamma {
        table += &format!("gamma = {g:?}\n");
    }
    if let Some(m) = c.min_lr {
        table += &format!("min_lr = {m:?}\n");
    }
    let mut job = mlp_job(40, 8, 1, "global_count", &table);
    job = match c.max_steps {
        Some(n) => job.replace("epochs = 2", &format!("max_steps = {n}")),
        None => job.replace("epochs = 2", "epochs = 3"),
    };
    assert!(job.contains(&format!("lr = {LR}")));
    let dir = TempDir::new().unwrap();
    let mut e = engine(spec(&job), dir.path());
    let mut lrs = Vec::new();
    e.run(|ev| {
        if let accrue_worker::Event::Step(r) = ev {
            assert_eq!(r.step as usize, lrs.len() + 1);
            lrs.push(r.lr);
        }
    })
    .unwrap();
    lrs
}

/// Constant, step (given and default gamma), cosine (with and without a
/// floor) and linear warm-up, with warm-up of 0, 1 and several steps, over
/// every step of runs long enough to cross each boundary (end of warm-up,
/// several step decays, the cosine's end), by max_steps and by epochs: the
/// engine's LR of each step equals torch.optim.lr_scheduler's (LinearLR,
/// StepLR, CosineAnnealingLR, SequentialLR; see torch_reference.py
/// schedules). Tolerance 1e-12 relative to the base rate: PyTorch's
/// schedulers compute the rate recursively in f64 (the cosine by the ratio
/// of successive terms), the engine in closed form, so only rounding may
/// differ; an off-by-one step or a wrong span moves some step by 1e-3 or
/// more.
#[test]
fn lr_schedules_equal_torch_lr_scheduler() {
    let cases = [
        case("constant", 0, Some(12)),
        case("constant", 5, Some(12)),
        case("linear_warmup", 7, Some(12)),
        case("linear_warmup", 1, Some(4)),
        Case {
            step_size: Some(4),
            gamma: Some(0.5),
            ..case("step", 0, Some(30))
        },
        Case {
            step_size: Some(5),
            ..case("step", 3, Some(30))
        },
        Case {
            step_size: Some(1),
            gamma: Some(0.9),
            ..case("step", 1, Some(10))
        },
        case("cosine", 0, Some(30)),
        Case {
            min_lr: Some(0.01),
            ..case("cosine", 6, Some(30))
        },
        case("cosine", 1, Some(9)),
        Case {
            min_lr: Some(0.002),
            ..case("cosine", 4, None)
        },
    ];
    let ours: Vec<Vec<f64>> = cases.iter().map(engine_lrs).collect();
    let configs: Vec<serde_json::Value> = cases
        .iter()
        .zip(&ours)
        .map(|(c, lrs)| {
            let mut v = serde_json::json!({
                "kind": c.kind,
                "lr": LR,
                "warmup": c.warmup,
                "total": c.max_steps.unwrap_or(15),
            });
            assert_eq!(lrs.len() as u64, c.max_steps.unwrap_or(15), "{}", v);
            if let Some(s) = c.step_size {
                v["step_size"] = s.into();
            }
            if let Some(g) = c.gamma {
                v["gamma"] = g.into();
            }
            if let Some(m) = c.min_lr {
                v["min_lr"] = m.into();
            }
            v
        })
        .collect();
    let configs = serde_json::Value::from(configs);
    let theirs: Vec<Vec<f64>> =
        serde_json::from_str(&torch_reference(&["schedules", &configs.to_string()])).unwrap();
    assert_eq!(theirs.len(), cases.len());
    let mut worst = 0f64;
    let mut distinct = 0;
    for ((cfg, ours), theirs) in configs.as_array().unwrap().iter().zip(&ours).zip(&theirs) {
        assert_eq!(ours.len(), theirs.len(), "{cfg}");
        for (s, (a, b)) in ours.iter().zip(theirs).enumerate() {
            let diff = (a - b).abs() / LR;
            worst = worst.max(diff);
            assert!(
                diff <= 1e-12,
                "{cfg}: step {s}: engine lr {a}, torch {b}\nengine {ours:?}\ntorch  {theirs:?}"
            );
        }
        let mut values: Vec<f64> = ours.clone();
        values.dedup_by(|a, b| (*a - *b).abs() < 1e-15);
        distinct += values.len();
    }
    // The runs must exercise the schedules, not sit at a constant rate.
    assert!(distinct > 100, "only {distinct} rate changes over all runs");
    eprintln!(
        "{} schedules, {} steps: largest |engine - torch| / lr = {worst:e}",
        cases.len(),
        ours.iter().map(Vec::len).sum::<usize>()
    );
}
