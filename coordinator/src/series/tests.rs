use super::*;
use proptest::prelude::*;

fn report(step: u64, loss: f64, grad: f64, skipped: bool) -> StepReport {
    StepReport {
        step,
        loss,
        grad_norm: grad,
        clip_coef: if grad.is_finite() {
            (1.0 / grad).min(1.0)
        } else {
            f64::NAN
        },
        skipped,
        samples_seen: step * 32,
        lr: 0.1 / step as f64,
        samples_per_sec: 1000.0 + step as f64,
        ..Default::default()
    }
}

/// Pushes steps 1..=losses.len() (at 10 ms apart) and returns the series.
fn series_of(rows: &[(f64, f64, bool)]) -> JobSeries {
    let mut s = new("j-1");
    for (i, &(loss, grad, skipped)) in rows.iter().enumerate() {
        let step = i as u64 + 1;
        push_step(&mut s, &report(step, loss, grad, skipped), 10 * step as i64);
    }
    s
}

/// Every step in exactly one bucket, in order, counts adding up.
fn assert_covers(buckets: &[SeriesBucket], first: u64, last: u64) {
    assert_eq!(buckets.first().map(|b| b.first_step), Some(first));
    assert_eq!(buckets.last().map(|b| b.last_step), Some(last));
    for w in buckets.windows(2) {
        assert_eq!(w[1].first_step, w[0].last_step + 1, "{w:?}");
    }
    for b in buckets {
        assert_eq!(b.count, b.last_step - b.first_step + 1, "{b:?}");
    }
}

fn min_of(xs: impl Iterator<Item = f64>) -> f64 {
    xs.filter(|x| x.is_finite()).fold(f64::INFINITY, f64::min)
}
fn max_of(xs: impl Iterator<Item = f64>) -> f64 {
    xs.filter(|x| x.is_finite())
        .fold(f64::NEG_INFINITY, f64::max)
}

#[test]
fn a_short_job_keeps_every_step_apart_with_its_values() {
    let rows: Vec<_> = (0..300)
        .map(|i| (1.0 / (i + 1) as f64, 2.0 + i as f64, false))
        .collect();
    let s = series_of(&rows);
    assert_eq!(s.buckets.len(), 300);
    assert_eq!(s.width, 1);
    assert_covers(&s.buckets, 1, 300);
    let cols = columns_json(&s.buckets);
    assert_eq!(cols["loss"][0], json!(1.0));
    assert_eq!(cols["loss"][299], json!(1.0 / 300.0));
    assert_eq!(cols["grad_norm"][9], json!(11.0));
    assert_eq!(cols["lr"][1], json!(0.05));
    assert_eq!(cols["samples_seen"][4], json!(160));
    assert_eq!(cols["wall_ms"][4], json!(50));
}

#[test]
fn a_long_job_stays_bounded_and_keeps_its_extremes() {
    let n = 100_000u64;
    // A spike in the middle that a plain "every k-th step" sample misses.
    let rows: Vec<_> = (1..=n)
        .map(|i| {
            let loss = if i == 54_321 {
                9.5
            } else {
                1.0 + ((i * 7919) % 1000) as f64 / 10_000.0
            };
            let grad = if i == 77_777 {
                1e4
            } else {
                1.0 + (i % 13) as f64
            };
            (loss, grad, i == 33_333 || i == 33_334 || i == 90_001)
        })
        .collect();
    let s = series_of(&rows);
    assert!(s.buckets.len() <= MAX_BUCKETS, "{}", s.buckets.len());
    assert!(s.buckets.len() > MAX_BUCKETS / 2, "{}", s.buckets.len());
    assert_eq!(
        s.width, 128,
        "100000 steps / 1024 buckets rounds up to 128 per bucket"
    );
    assert_covers(&s.buckets, 1, n);
    assert_eq!(max_of(s.buckets.iter().map(|b| b.loss_max)), 9.5);
    assert_eq!(
        min_of(s.buckets.iter().map(|b| b.loss_min)),
        min_of(rows.iter().map(|r| r.0))
    );
    assert_eq!(max_of(s.buckets.iter().map(|b| b.grad_norm_max)), 1e4);
    assert_eq!(s.buckets.iter().map(|b| b.skipped).sum::<u64>(), 3);
    assert_eq!(
        s.skipped
            .iter()
            .map(|r| (r.first, r.last))
            .collect::<Vec<_>>(),
        [(33_333, 33_334), (90_001, 90_001)],
        "skipped steps kept exactly"
    );
    let loss_mean: f64 = s.buckets.iter().map(|b| b.loss_sum).sum::<f64>() / n as f64;
    let want: f64 = rows.iter().map(|r| r.0).sum::<f64>() / n as f64;
    assert!((loss_mean - want).abs() < 1e-9, "{loss_mean} vs {want}");
    // The query merges further but keeps the spike.
    let q = query_json(&s, 0, 100);
    let points = q["points"]["loss_max"].as_array().unwrap();
    assert!(points.len() <= 100 && points.len() > 50, "{}", points.len());
    assert!(points.iter().any(|v| v == &json!(9.5)));
}

#[test]
fn non_finite_values_are_counted_as_skipped_and_never_averaged() {
    let s = series_of(&[
        (1.0, 2.0, false),
        (f64::NAN, f64::INFINITY, true),
        (3.0, 4.0, false),
    ]);
    let merged = downsample(&s.buckets, 1);
    assert_eq!(merged.len(), 1);
    let cols = columns_json(&merged);
    assert_eq!(cols["loss"][0], json!(2.0), "mean of the finite losses");
    assert_eq!(cols["grad_norm"][0], json!(3.0));
    assert_eq!(cols["skipped"][0], json!(1));
    let one = columns_json(&s.buckets);
    assert_eq!(one["loss"][1], Value::Null);
    assert_eq!(one["grad_norm_max"][1], Value::Null);
    assert_eq!(one["loss_min"][1], Value::Null);
}

#[test]
fn a_rollback_replaces_the_steps_done_again() {
    let mut s = new("j-1");
    for step in 1..=10 {
        push_step(&mut s, &report(step, 1.0, 1.0, step == 9), step as i64);
    }
    // Recovery from the checkpoint at step 5: steps 6.. again.
    for step in 6..=8 {
        push_step(&mut s, &report(step, 2.0, 1.0, false), 100 + step as i64);
    }
    assert_covers(&s.buckets, 1, 8);
    assert_eq!(s.buckets[7].loss_sum, 2.0);
    assert_eq!(s.buckets[7].wall_unix_ms, 108);
    assert!(s.skipped.is_empty(), "{:?}", s.skipped);
    assert_eq!(s.version, 13);
}

#[test]
fn skipped_ranges_and_evaluations_are_bounded() {
    let mut s = new("j-1");
    for step in 1..=(2 * MAX_SKIPPED_RANGES as u64 + 10) {
        // Every other step skipped: a range each.
        push_step(&mut s, &report(step, 1.0, 1.0, step % 2 == 1), 0);
    }
    assert_eq!(s.skipped.len(), MAX_SKIPPED_RANGES);
    assert_eq!(
        s.skipped[0].first, 1,
        "the oldest ranges join, from the first"
    );
    assert_eq!(
        s.skipped.last().map(|r| r.last),
        Some(2 * MAX_SKIPPED_RANGES as u64 + 9)
    );
    for i in 0..(MAX_EVALS as u64 + 1) {
        push_eval(
            &mut s,
            EvalResult {
                step: i,
                ..Default::default()
            },
            i as i64,
        );
    }
    assert!(s.evals.len() <= MAX_EVALS);
    assert_eq!(
        s.evals[0].eval.unwrap().step,
        0,
        "the first evaluation stays"
    );
    assert_eq!(s.evals.last().unwrap().eval.unwrap().step, MAX_EVALS as u64);
}

#[test]
fn the_eta_follows_the_recent_rate() {
    // 10 steps a second, 100 to go.
    let recent: Vec<_> = (0..20).map(|i| (i as u64, 1000 + 100 * i as i64)).collect();
    let eta = eta_s(&recent, 119).unwrap();
    assert!((eta - 10.0).abs() < 1e-9, "{eta}");
    assert_eq!(eta_s(&recent[..1], 100), None);
    assert_eq!(
        eta_s(&[(5, 0), (5, 100)], 100),
        None,
        "no progress since the rollback"
    );
    assert_eq!(eta_s(&[(100, 0)], 100), Some(0.0));
    // Only the last 30 s count: it got twice as slow.
    let mut slow: Vec<_> = (0..100).map(|i| (i as u64, 100 * i as i64)).collect();
    let (s0, t0) = *slow.last().unwrap();
    slow.extend((1..=200).map(|i| (s0 + i, t0 + 1000 * i as i64 / 5)));
    let eta = eta_s(&slow, s0 + 200 + 50).unwrap();
    assert!((eta - 10.0).abs() < 0.5, "{eta}");
}

#[test]
fn a_query_starts_at_from_step_and_checks_max_points() {
    let rows: Vec<_> = (0..50).map(|i| (i as f64, 1.0, false)).collect();
    let s = series_of(&rows);
    let q = query_json(&s, 41, 1000);
    assert_eq!(
        q["points"]["first_step"],
        json!((41..=50).collect::<Vec<u64>>())
    );
    assert_eq!(q["version"], json!(50));
    assert_eq!(check_points(1000), None);
    let e = check_points(1).unwrap();
    assert!(
        e.contains("max_points = 1") && e.contains("2..=10000"),
        "{e}"
    );
    assert!(check_points(10_001).is_some());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn any_job_is_bounded_covered_and_keeps_extremes_and_markers(
        rows in proptest::collection::vec(
            (prop_oneof![9 => 0.0..10.0f64, 1 => Just(f64::NAN)], 0.0..100.0f64, proptest::bool::weighted(0.05)),
            1..3000,
        ),
        max_points in 2usize..700,
    ) {
        let s = series_of(&rows);
        let n = rows.len() as u64;
        prop_assert!(s.buckets.len() <= MAX_BUCKETS);
        if rows.len() <= MAX_BUCKETS {
            prop_assert_eq!(s.buckets.len(), rows.len());
        }
        assert_covers(&s.buckets, 1, n);
        let raw_min = min_of(rows.iter().map(|r| r.0));
        let raw_max = max_of(rows.iter().map(|r| r.0));
        for b in [s.buckets.clone(), downsample(&s.buckets, max_points)] {
            prop_assert!(b.len() <= max_points.max(s.buckets.len().min(MAX_BUCKETS)));
            prop_assert_eq!(min_of(b.iter().map(|b| b.loss_min)), raw_min);
            prop_assert_eq!(max_of(b.iter().map(|b| b.loss_max)), raw_max);
            prop_assert_eq!(max_of(b.iter().map(|b| b.grad_norm_max)), max_of(rows.iter().map(|r| r.1)));
            prop_assert_eq!(b.iter().map(|b| b.skipped).sum::<u64>(), rows.iter().filter(|r| r.2).count() as u64);
            prop_assert_eq!(b.iter().map(|b| b.finite).sum::<u64>(), rows.iter().filter(|r| r.0.is_finite()).count() as u64);
        }
        let d = downsample(&s.buckets, max_points);
        prop_assert!(d.len() <= max_points);
        prop_assert!(s.buckets.len() <= max_points || d.len() * 2 > max_points);
        let skipped: Vec<u64> = s.skipped.iter().flat_map(|r| r.first..=r.last).collect();
        let want: Vec<u64> = (1..=n).filter(|i| rows[*i as usize - 1].2).collect();
        prop_assert_eq!(skipped, want);
    }
}

#[test]
fn a_rollback_into_a_merged_bucket_never_counts_a_step_twice() {
    let mut s = new("j-1");
    for step in 1..=3000 {
        push_step(&mut s, &report(step, 1.0, 1.0, false), step as i64);
    }
    assert_eq!(s.width, 4);
    // Resume at 2998: the bucket holding it (and 2997) is dropped.
    for step in 2998..=3005 {
        push_step(&mut s, &report(step, 2.0, 1.0, false), step as i64);
    }
    for w in s.buckets.windows(2) {
        assert!(w[1].first_step > w[0].last_step, "{w:?}");
    }
    let counted: u64 = s.buckets.iter().map(|b| b.count).sum();
    assert!((3000..=3005).contains(&counted), "{counted}");
    assert_eq!(s.buckets.last().unwrap().last_step, 3005);
}
