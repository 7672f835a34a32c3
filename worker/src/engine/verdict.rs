//! Whether a job's skipped optimizer steps make it a failure (issue 37: a
//! job that applied no step, or skipped most of them, exited 0 as
//! "finished"). Pure: the run loop asks after every step and at its end.

/// Why the job must fail now for its skipped steps, None while it may go
/// on: more steps skipped than `max_fraction` of `total_steps` (the job
/// can no longer end at or under the bar, so it stops at once rather than
/// run the rest for nothing).
pub(crate) fn too_many_skipped(
    skipped: u64,
    total_steps: u64,
    max_fraction: f64,
    last_reason: Option<&str>,
) -> Option<String> {
    let allowed = (max_fraction * total_steps as f64).floor() as u64;
    (skipped > allowed).then(|| {
        format!(
            "{skipped} of its {total_steps} optimizer steps were skipped{}, more than max_skipped_fraction = {max_fraction} allows ({allowed}); the job failed rather than report an untrained model as finished{}",
            last_reason.map_or(String::new(), |r| format!(" (the last for {r})")),
            hint(last_reason)
        )
    })
}

/// Why a run that reached its last step must fail: no optimizer step was
/// applied in it.
pub(crate) fn nothing_applied(
    optimizer_steps: u64,
    steps: u64,
    last_reason: Option<&str>,
) -> Option<String> {
    (optimizer_steps == 0 && steps > 0).then(|| {
        format!(
            "no optimizer step was applied: all {steps} steps were skipped{}{}",
            last_reason.map_or(String::new(), |r| format!(" (the last for {r})")),
            hint(last_reason)
        )
    })
}

fn hint(reason: Option<&str>) -> &'static str {
    match reason {
        Some("no loss terms") => {
            "; no window had a target token (check loss_mask and that completions start within data.seq_len + 1 tokens)"
        }
        Some("non-finite gradients") => "; check the data and the initial weights for NaN or inf",
        Some("fp16 overflow") => "; lower loss_scaling.init_scale or train in bf16",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_is_a_share_of_the_job_and_nothing_applied_always_fails() {
        // 10 steps at 0.5: 5 may be skipped, the 6th fails the job.
        assert_eq!(too_many_skipped(5, 10, 0.5, None), None);
        let why = too_many_skipped(6, 10, 0.5, Some("no loss terms")).unwrap();
        assert!(
            why.starts_with("6 of its 10 optimizer steps were skipped (the last for no loss terms), more than max_skipped_fraction = 0.5 allows (5)"),
            "{why}"
        );
        assert!(why.contains("loss_mask"), "{why}");
        // 0 allows none; 1 allows all.
        assert!(too_many_skipped(1, 1000, 0.0, None).is_some());
        assert_eq!(too_many_skipped(1000, 1000, 1.0, None), None);
        assert_eq!(nothing_applied(1, 4, None), None);
        assert_eq!(nothing_applied(0, 0, None), None);
        let why = nothing_applied(0, 4, Some("non-finite gradients")).unwrap();
        assert!(why.contains("all 4 steps were skipped"), "{why}");
    }
}
